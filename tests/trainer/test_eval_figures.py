"""The evaluation block's figures that explain the environment's reward: a word's value as a guess,
the games with no accepted guess and where the model stops (``trainer.task.wordle.figures``)."""

from __future__ import annotations

import random
import statistics

import pytest

from trainer.task.wordle.credit import guess_value
from trainer.task.wordle.figures import EpisodeResult, summarize
from trainer.task.wordle.game_env import EpisodeStats
from wordle_env import rules, wordlists


@pytest.mark.parametrize("word", ["crane", "eerie", "geese", "llama", "fuzzy", "sassy"])
def test_a_words_value_is_its_mean_credit_as_the_game_scores_it(word):
    """Repeated letters included: the vectorised value matches the game's own feedback, answer by
    answer, averaged over every answer."""
    by_the_game = statistics.fmean(
        rules.partial_credit(rules.feedback(word, answer)) for answer in wordlists.answers()
    )
    assert guess_value(word) == pytest.approx(by_the_game, abs=1e-12)


def test_words_of_common_letters_are_worth_more_and_bad_input_is_refused():
    assert guess_value("slate") > guess_value("crane") > guess_value("fuzzy")
    random_words = random.Random(0).sample(wordlists.answers(), 200)
    assert 0 < statistics.fmean(guess_value(w) for w in random_words) < guess_value("slate")
    for bad in ("cranes", "Crane", "cr4ne"):
        with pytest.raises(ValueError, match="5-letter lowercase"):
            guess_value(bad)


def _game(guesses: list[str], reward: float) -> EpisodeResult:
    stats = EpisodeStats(accepted=len(guesses), guesses=list(guesses), done=True)
    return EpisodeResult(
        seed=0,
        turns=max(1, len(guesses)),
        wellformed=1,
        stats=stats,
        env_reward=reward,
        end="invalid",
    )


def test_the_block_counts_games_without_a_guess_and_averages_each_guess_value():
    block = summarize([_game([], 0.0), _game(["crane"], 0.3), _game(["slate", "fuzzy"], 0.2)])
    assert block["no_guess_rate"] == pytest.approx(1 / 3, abs=1e-4)
    words = ["crane", "slate", "fuzzy"]
    assert block["guess_value_mean"] == pytest.approx(
        statistics.fmean(guess_value(w) for w in words), abs=1e-4
    )
    assert summarize([_game([], 0.0), _game([], 0.0)])["guess_value_mean"] is None


def _played(target: str, moves: list[str], end: str) -> EpisodeResult:
    """A game that sent ``moves`` through the real game rules and then ended by ``end``."""
    from types import SimpleNamespace

    from wordle_env.game import WordleGame

    game, stats = WordleGame(target), EpisodeStats()
    for word in moves:
        move = game.play(f"[{word}]")
        stats.record(
            SimpleNamespace(
                done=game.done,
                won=game.won,
                guesses=list(game.guesses),
                feedback=list(game.marks),
                error_code=None if move.invalid is None else move.invalid.code,
            )
        )
    return EpisodeResult(0, len(moves) + 1, len(moves), stats, game.reward, end)


def test_the_stop_figures_split_the_model_stops_by_the_row_it_read():
    """Stops count only where the model wrote no call right after an accepted row and the game
    could go on; a row is good from ``GOOD_ROW`` credit up."""
    from trainer.task.wordle.figures import GOOD_ROW, stop_rates

    good, poor = "crank", "fuzzy"  # against "crane": 0.8 and 0
    assert rules.partial_credit(rules.feedback(good, "crane")) >= GOOD_ROW
    assert rules.partial_credit(rules.feedback(poor, "crane")) < GOOD_ROW
    games = [
        _played("crane", [poor, good], "malformed"),  # stopped on the good row
        _played("crane", [good, poor], "malformed"),  # went on after it, stopped on the poor one
        _played("crane", [poor, "zzzzz"], "malformed"),  # an invalid move, then no call: no stop
        _played("crane", [poor, good, "crane"], "won"),  # a win: its last row decides nothing
    ]
    rates = stop_rates(games)
    # good rows that could go on: game 1's 2nd, game 2's 1st, game 4's 2nd; stopped after 1
    assert rates["stop_after_good_rate"] == pytest.approx(1 / 3, abs=1e-4)
    # poor rows: game 1's 1st, game 2's 2nd (stopped), game 3's 1st, game 4's 1st
    assert rates["stop_after_poor_rate"] == pytest.approx(1 / 4, abs=1e-4)
    credits = [rules.partial_credit(rules.feedback(w, "crane")) for w in (good, poor)]
    assert rates["stopped_row_credit_mean"] == pytest.approx(statistics.fmean(credits), abs=1e-4)
    assert summarize(games)["stop_after_good_rate"] == rates["stop_after_good_rate"]
    assert stop_rates([games[3]])["stopped_row_credit_mean"] is None
