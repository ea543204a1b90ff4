"""A guess's worth before its feedback (``trainer.task.wordle.credit``): the turn reward of
``--turn-credit`` on Wordle. Games are played on the real game (``wordle_env.game``); the
expectation is checked against the game's own scoring, answer by answer."""

from __future__ import annotations

import statistics

import pytest

from trainer.task.wordle import board, credit
from wordle_env import rules, wordlists
from wordle_env.game import WordleGame


def _play(target, words):
    game = WordleGame(target)
    for word in words:
        assert not game.play(f"[{word}]").invalid
    return list(game.guesses), list(game.marks)


@pytest.mark.parametrize(
    ("target", "words"), [("crane", ["slate", "grape", "crave"]), ("geese", ["eerie", "sheep"])]
)
def test_each_guess_is_worth_its_mean_credit_over_the_answers_still_possible(target, words):
    guesses, marks = _play(target, words)
    got = credit.expected_credits(guesses, marks)
    for i, word in enumerate(guesses):
        possible = [
            a for a in wordlists.answers() if board.is_consistent(a, guesses[:i], marks[:i])
        ]
        assert target in possible
        by_the_game = statistics.fmean(
            rules.partial_credit(rules.feedback(word, a)) for a in possible
        )
        assert got[i] == pytest.approx(by_the_game, abs=1e-12)
    assert got[0] == credit.guess_value(guesses[0])


def test_a_guess_that_uses_the_board_is_worth_more_than_one_that_does_not():
    guesses, marks = _play("crane", ["slate"])  # a and e green; s, l, t grey
    uses_it = credit.expected_credits(guesses + ["crave"], marks + ["XXGXG"])[1]
    ignores_it = credit.expected_credits(guesses + ["lusty"], marks + ["XXXXX"])[1]
    assert board.is_consistent("crave", guesses, marks)
    assert not board.is_consistent("lusty", guesses, marks)  # greys again, greens dropped
    assert uses_it > ignores_it
    # a word that fits the board is worth more than opened cold; one that ignores it, less
    assert uses_it > credit.guess_value("crave")
    assert ignores_it < credit.guess_value("lusty")


def test_rows_the_game_could_not_have_given_are_refused():
    with pytest.raises(ValueError, match="one feedback row per guess"):
        credit.expected_credits(["slate", "crane"], ["XXGXG"])
    with pytest.raises(ValueError, match="no answer fits the feedback"):
        credit.expected_credits(["slate", "crane"], ["GGGGG", "XXXXX"])  # a guess after a win
    with pytest.raises(ValueError, match="5-letter lowercase"):
        credit.expected_credits(["slates"], ["XXGXGX"])
