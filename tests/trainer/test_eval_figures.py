"""The evaluation block's figures that explain the environment's reward: a word's value as a guess
and the games with no accepted guess (``trainer.task.evaluate``)."""

from __future__ import annotations

import random
import statistics

import pytest

from trainer.task.credit import guess_value
from trainer.task.evaluate import EpisodeResult, summarize
from trainer.task.wordle_task import EpisodeStats
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
