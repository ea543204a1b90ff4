"""What a Wordle guess is worth before its feedback comes: its mean partial credit over the answers
that could still be the secret word.

Partial credit is the game's own ``(greens + 0.5 yellows) / 5`` (``wordle_env.rules``). Over every
answer it is the word's value as an opening (:func:`guess_value`, an evaluation figure); over the
answers consistent with the feedback so far it is the guess's expected credit given the board
(:func:`expected_credits`, the task's turn reward). The second is the conditional expectation of
the credit the guess then earns, given what the player had seen: the same mean as the credit
itself, without the luck of which consistent answer is the secret (Rao-Blackwellisation; e.g.
Casella and Robert 1996, Biometrika 83(1)). A guess that keeps the greens, moves the yellows and
drops the grey letters is worth more than one that does not, whatever the secret turns out to be.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from trainer.task.wordle import board
from wordle_env import rules, wordlists


def answer_codes(words: Sequence[str]) -> np.ndarray:
    """``words`` as an (N, 5) uint8 array of ASCII codes."""
    return np.frombuffer("".join(words).encode(), dtype=np.uint8).reshape(-1, rules.WORD_LENGTH)


@functools.cache
def _all_answers() -> np.ndarray:
    """The game's answer list (N = 3,568) as :func:`answer_codes`."""
    return answer_codes(wordlists.answers())


def mean_credit(word: str, answers: np.ndarray) -> float:
    """The mean partial credit ``word`` earns as a guess against each row of ``answers``, scored
    as ``wordle_env.rules`` scores (greens first; each letter's yellows are the fewer of its
    non-green copies in the guess and in the answer), for all rows at once.

    Args:
        word: an accepted guess: 5 lowercase ASCII letters.
        answers: (N, 5) uint8 ASCII codes (:func:`answer_codes`), N >= 1.

    Returns:
        a float in [0, 1].

    Raises:
        ValueError: ``word`` is not 5 lowercase ASCII letters, or ``answers`` is empty.
    """
    if len(word) != rules.WORD_LENGTH or not rules.is_lower_ascii_word(word):
        raise ValueError(f"expected a 5-letter lowercase a-z word, found {word!r}")
    if len(answers) == 0:
        raise ValueError(f"expected at least one answer to score {word!r} against, found none")
    guess = np.frombuffer(word.encode(), dtype=np.uint8)
    green = answers == guess  # (N, 5)
    yellows = np.zeros(len(answers))
    for letter in set(guess.tolist()):
        in_guess = ((guess == letter) & ~green).sum(axis=1)
        in_answer = ((answers == letter) & ~green).sum(axis=1)
        yellows += np.minimum(in_guess, in_answer)
    credit = (green.sum(axis=1) + rules.YELLOW_CREDIT * yellows) / rules.WORD_LENGTH
    return float(credit.mean())


@functools.lru_cache(maxsize=1 << 16)
def guess_value(word: str) -> float:
    """The mean partial credit ``word`` earns against every answer
    (``wordle_env.wordlists.answers()``), in [0, 1]: how good a word is apart from the luck of the
    target (e.g. ``crane`` 0.202).

    Raises:
        ValueError: ``word`` is not 5 lowercase ASCII letters.
    """
    return mean_credit(word, _all_answers())


def expected_credits(guesses: Sequence[str], marks: Sequence[str]) -> list[float]:
    """Each accepted guess's expected partial credit given the feedback before it: its mean credit
    over the answers consistent with every earlier guess and feedback row
    (``board.is_consistent``); the first guess's is its :func:`guess_value`.

    Args:
        guesses: one game's accepted guesses, in order (lowercase 5-letter words).
        marks: their feedback rows (``G``/``Y``/``X`` strings, as ``WordleObservation.feedback``).

    Returns:
        one float in [0, 1] per guess.

    Raises:
        ValueError: a guess is not 5 lowercase letters, the lists differ in length, or no answer
            fits the feedback (the rows were not the game's, or the secret is not an answer).
    """
    if len(guesses) != len(marks):
        raise ValueError(
            f"expected one feedback row per guess, found {len(guesses)} guesses "
            f"and {len(marks)} rows"
        )
    out: list[float] = []
    candidates = wordlists.answers()
    for i, word in enumerate(guesses):
        if i == 0:
            out.append(guess_value(word))
        else:
            out.append(mean_credit(word, answer_codes(candidates)))
        candidates = [a for a in candidates if board.is_consistent(a, [word], [marks[i]])]
        if not candidates and i + 1 < len(guesses):
            raise ValueError(
                f"no answer fits the feedback {guesses[: i + 1]} -> {marks[: i + 1]}; "
                "expected the rows the game gave (wordle_env.rules.feedback) on an answer-list word"
            )
    return out
