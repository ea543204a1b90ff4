"""Wordle rules, as TextArena's Wordle-v0 plays them (what TRL's Wordle examples expect).

Pure functions over strings; standard library only, so the trainer's reward code can import
this module without openenv, torch or vLLM.

The rules:

- The target is a 5-letter word; the player has 6 guesses.
- A guess is written as ``[word]`` anywhere in a message; the first bracketed token counts.
- Feedback is one letter per position: ``G`` (green) right letter in the right place, ``Y``
  (yellow) the letter is in the word elsewhere, ``X`` (gray) not in the word. Duplicate
  letters: greens are marked first, then yellows from left to right, each consuming one
  unmatched copy of the letter in the target; copies beyond those are gray.
- A message with no bracketed token, a token that is not 5 ASCII letters, a repeat of an
  earlier guess or a word outside the allowed list is an invalid move: it does not use a
  guess, and a second invalid move in a row ends the game.
- Reward: 1.0 for a win; otherwise the partial credit of the last accepted guess,
  ``(greens + 0.5 * yellows) / 5`` (0.0 when no guess was accepted).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

WORD_LENGTH = 5
MAX_GUESSES = 6
# The invalid move that makes this many in a row ends the game.
INVALID_MOVES_TO_END = 2

GREEN = "G"
YELLOW = "Y"
GRAY = "X"
# Partial credit of a yellow letter relative to a green one.
YELLOW_CREDIT = 0.5

# TextArena's pattern: the first ``[token]`` of word characters (Unicode \w, so that a
# non-ASCII token is reported as such instead of as "no guess found").
_GUESS_PATTERN = re.compile(r"\[(\w+)\]")

# Machine-readable codes of invalid moves (``InvalidMove.code``).
NO_GUESS_FOUND = "no_guess_found"
NOT_ASCII_LETTERS = "not_ascii_letters"
WRONG_LENGTH = "wrong_length"
REPEATED_GUESS = "repeated_guess"
NOT_A_WORD = "not_a_word"
INVALID_MOVE_CODES = (NO_GUESS_FOUND, NOT_ASCII_LETTERS, WRONG_LENGTH, REPEATED_GUESS, NOT_A_WORD)


def is_lower_ascii_word(text: str) -> bool:
    """True when ``text`` is non-empty and made only of the letters a-z."""
    # ASCII + alphabetic + no uppercase == only a-z (three C-level scans, no Python loop).
    return text.isascii() and text.isalpha() and text.islower()


def feedback(guess: str, target: str) -> str:
    """Score ``guess`` against ``target``: one of ``G``/``Y``/``X`` per letter.

    Args:
        guess: lowercase ASCII word.
        target: lowercase ASCII word of the same length.

    Returns:
        A string as long as ``guess``, e.g. ``feedback("babes", "abbey") == "YYGGX"``.

    Raises:
        ValueError: when either word is not lowercase a-z or the lengths differ.
    """
    if not (is_lower_ascii_word(guess) and is_lower_ascii_word(target)):
        raise ValueError(
            f"feedback() takes lowercase a-z words, found guess={guess!r}, target={target!r}; "
            "lowercase the words and drop other characters first"
        )
    if len(guess) != len(target):
        raise ValueError(
            f"guess and target must have the same length, found {len(guess)} ({guess!r}) "
            f"and {len(target)} ({target!r})"
        )
    marks = [GRAY] * len(guess)
    unmatched: dict[str, int] = {}
    for i, (g, t) in enumerate(zip(guess, target, strict=True)):
        if g == t:
            marks[i] = GREEN
        else:
            unmatched[t] = unmatched.get(t, 0) + 1
    for i, g in enumerate(guess):
        if marks[i] != GREEN and unmatched.get(g, 0) > 0:
            marks[i] = YELLOW
            unmatched[g] -= 1
    return "".join(marks)


def feedback_counts(marks: str) -> tuple[int, int]:
    """Return ``(greens, yellows)`` of a feedback string such as ``"YYGGX"``."""
    return marks.count(GREEN), marks.count(YELLOW)


def extract_guess(message: str) -> str | None:
    """Return the first bracketed token of ``message``, lowercased, or None if there is none.

    The token is whatever word characters sit between the brackets (``"[Crane]"`` ->
    ``"crane"``, ``"[cranes]"`` -> ``"cranes"``, ``"[héllo]"`` -> ``"héllo"``); whether it is
    a usable guess is for :func:`check_guess` to say.
    """
    match = _GUESS_PATTERN.search(message)
    return None if match is None else match.group(1).lower()


@dataclass(frozen=True)
class InvalidMove:
    """Why a message is not an accepted guess.

    Attributes:
        code: one of ``INVALID_MOVE_CODES``.
        reason: a sentence for the player: what was expected, what was found, how to fix it.
    """

    code: str
    reason: str


def _shown(token: str, limit: int = 24) -> str:
    """``[token]`` for messages, shortened so that a huge token is not echoed back whole."""
    return f"[{token}]" if len(token) <= limit else f"[{token[:limit]}...] ({len(token)} chars)"


def check_guess(
    token: str | None, previous_guesses: Sequence[str], allowed: Collection[str]
) -> InvalidMove | None:
    """Decide whether ``token`` (from :func:`extract_guess`) is an acceptable guess.

    Args:
        token: the extracted token, or None when the message had no bracketed token.
        previous_guesses: the guesses already accepted in this game.
        allowed: the allowed-guess list (``wordle_env.wordlists.allowed_guesses()``).

    Returns:
        None when the guess is acceptable, else the :class:`InvalidMove`. Checks run in the
        order format, letters, length, repeat, dictionary.
    """
    if token is None:
        return InvalidMove(
            NO_GUESS_FOUND,
            f"expected a {WORD_LENGTH}-letter word in square brackets such as [crane], "
            "found no bracketed word; write your guess as [word]",
        )
    if not is_lower_ascii_word(token):
        return InvalidMove(
            NOT_ASCII_LETTERS,
            f"expected only the letters a-z inside the brackets, found {_shown(token)}; "
            "use an English word without accents, digits or symbols",
        )
    if len(token) != WORD_LENGTH:
        return InvalidMove(
            WRONG_LENGTH,
            f"expected a word of exactly {WORD_LENGTH} letters, found {_shown(token)} with "
            f"{len(token)}; guess a {WORD_LENGTH}-letter word",
        )
    if token in previous_guesses:
        return InvalidMove(
            REPEATED_GUESS,
            f"expected a word you have not guessed yet, found [{token}] again; guess a new word",
        )
    if token not in allowed:
        return InvalidMove(
            NOT_A_WORD,
            f"expected a word from the game's word list, found [{token}]; "
            "guess a common English word",
        )
    return None


def partial_credit(marks: str) -> float:
    """``(greens + 0.5 * yellows) / 5`` of one feedback string; 1.0 for ``"GGGGG"``."""
    greens, yellows = feedback_counts(marks)
    return (greens + YELLOW_CREDIT * yellows) / WORD_LENGTH


def game_reward(won: bool, last_feedback: str | None) -> float:
    """The episode reward: 1.0 for a win, else partial credit of the last accepted guess.

    Args:
        won: whether the target was guessed.
        last_feedback: feedback of the last accepted guess, None when none was accepted.

    Returns:
        A float in [0, 1].
    """
    if won:
        return 1.0
    return 0.0 if last_feedback is None else partial_credit(last_feedback)


@dataclass(frozen=True)
class RewardBreakdown:
    """Shaped-reward signals of one move, each in [0, 1], for trainers that want them.

    Attributes:
        greens: green letters of this move's guess / 5 (0 for an invalid move).
        yellows: yellow letters of this move's guess / 5 (0 for an invalid move).
        valid_format: 1 when the message held a bracketed token of 5 letters a-z.
        valid_guess: 1 when the guess was accepted (it used one of the 6 guesses).
        correct: 1 when this guess was the target.
        game_reward: the game's reward after this move (:func:`game_reward`).
    """

    greens: float
    yellows: float
    valid_format: float
    valid_guess: float
    correct: float
    game_reward: float

    def as_dict(self) -> dict[str, float]:
        """The fields as a plain ``{name: value}`` dict (JSON-ready)."""
        # Spelled out: dataclasses.asdict deep-copies every value, which shows in profiles.
        return {
            "greens": self.greens,
            "yellows": self.yellows,
            "valid_format": self.valid_format,
            "valid_guess": self.valid_guess,
            "correct": self.correct,
            "game_reward": self.game_reward,
        }


def reward_breakdown(
    token: str | None, marks: str | None, reward_after_move: float
) -> RewardBreakdown:
    """Build the :class:`RewardBreakdown` of one move.

    Args:
        token: the extracted token (None when no bracketed token was found).
        marks: the feedback of the accepted guess, None when the move was invalid.
        reward_after_move: :func:`game_reward` after the move.
    """
    well_formed = token is not None and len(token) == WORD_LENGTH and is_lower_ascii_word(token)
    greens, yellows = feedback_counts(marks) if marks is not None else (0, 0)
    return RewardBreakdown(
        greens=greens / WORD_LENGTH,
        yellows=yellows / WORD_LENGTH,
        valid_format=float(well_formed),
        valid_guess=float(marks is not None),
        correct=float(marks is not None and greens == WORD_LENGTH),
        game_reward=reward_after_move,
    )
