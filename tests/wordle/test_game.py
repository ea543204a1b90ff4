"""One game as a state machine (``wordle_env.game.WordleGame``).

Covers: the invalid-move rules (no turn used, a second invalid move in a row ends the game,
a valid guess resets the streak), wins and losses with their rewards, the feedback text that
TRL's Wordle parsers read, and refusing moves after the end.
"""

from __future__ import annotations

import pytest

from wordle_env import rules
from wordle_env.game import PROMPT, GameOverError, WordleGame


def _trl_feedback_counts(transcript: str) -> tuple[int, int]:
    """What TRL's Wordle example does: last ``G/Y/X`` row after the first ``Feedback:``."""
    after = transcript.split("Feedback:", 1)[-1]
    for line in reversed([ln.strip() for ln in after.split("\n") if ln.strip()]):
        row = line.replace(" ", "")
        if row and all(c in "GYX" for c in row):
            return row.count("G"), row.count("Y")
    return 0, 0


def test_win_on_third_guess() -> None:
    game = WordleGame("abbey")
    first = game.play("[babes]")
    assert (first.marks, first.invalid, game.guesses_left, game.done) == ("YYGGX", None, 5, False)
    assert game.reward == pytest.approx(0.6)
    assert "You have 5 guesses left." in first.reply
    game.play("my guess: [crane]")
    last = game.play("[abbey]")
    assert (last.marks, game.won, game.done, game.reward) == ("GGGGG", True, True, 1.0)
    assert last.breakdown.correct == 1.0 and "You win!" in last.reply
    assert game.guesses == ["babes", "crane", "abbey"]


def test_loss_after_six_guesses_scores_the_last_guess() -> None:
    game = WordleGame("abbey")
    for word in ["crane", "slate", "moist", "pouch", "lying"]:
        game.play(f"[{word}]")
        assert not game.done
    result = game.play("[babes]")
    assert game.done and not game.won
    assert game.guesses_left == 0
    assert game.reward == pytest.approx(rules.partial_credit("YYGGX")) == pytest.approx(0.6)
    assert "The secret word was [abbey]." in result.reply


def test_invalid_move_does_not_use_a_turn_and_valid_guess_resets_streak() -> None:
    game = WordleGame("crane")
    result = game.play("crane without brackets")
    assert result.invalid is not None and result.invalid.code == rules.NO_GUESS_FOUND
    assert (game.guesses_left, game.invalid_streak, game.done) == (6, 1, False)
    assert result.reply.startswith("You attempted an invalid move.")
    game.play("[slate]")
    assert (game.guesses_left, game.invalid_streak) == (5, 0)
    game.play("[zzzzz]")
    assert (game.invalid_streak, game.done) == (1, False)


@pytest.mark.parametrize(
    ("moves", "reward"),
    [
        (["", "[cranes]"], 0.0),
        (["[qwert]", "[héllo]"], 0.0),
        # slate vs crane is XXGXG (0.4); then two repeats in a row end the game.
        (["[slate]", "[slate]", "[slate]"], 0.4),
    ],
)
def test_second_invalid_move_in_a_row_ends_the_game(moves: list[str], reward: float) -> None:
    game = WordleGame("crane")
    for move in moves[:-1]:
        game.play(move)
        assert not game.done
    result = game.play(moves[-1])
    assert game.done and not game.won
    assert "second invalid move in a row" in result.reply
    assert game.reward == pytest.approx(reward)


def test_moves_after_the_end_raise() -> None:
    game = WordleGame("crane")
    game.play("[crane]")
    with pytest.raises(GameOverError, match="game is over"):
        game.play("[slate]")


def test_transcript_is_prompt_then_replies_and_parses_like_textarena() -> None:
    game = WordleGame("abbey")
    assert game.transcript == PROMPT
    game.play("[babes]")
    game.play("[kebab]")
    assert game.transcript.startswith(PROMPT)
    assert game.transcript.count("Feedback:") == 2
    # TRL's parser finds the latest feedback row: kebab vs abbey is XYGYY.
    assert _trl_feedback_counts(game.transcript) == (1, 3)


def test_unknown_target_is_refused() -> None:
    with pytest.raises(ValueError, match="target must be"):
        WordleGame("qwert")
