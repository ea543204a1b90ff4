"""A Wordle game's state as text a small model and a real one can both read: the feedback cells
of the last guess and the running constraints of the whole game, in plain words.

The environment answers a guess with two aligned rows (``C R A N E`` over ``X G Y X X``). Reading
them needs the model to align the two rows by position, which a small model does not learn (the
round-2 runs: 1-2% of guesses fit the feedback; the ablation in docs/BENCHMARKS.md section 6 (the
main job): 0.02 without the board). The trainer's tool reply keeps that text and adds the same facts
as separate items::

    Letters: c1 grey, r2 green, a3 yellow, n4 grey, e5 grey,
    Constraints: r at 2, a in word, c not in word, n not in word, e not in word,
    Tried: crane.

Each item, with the space before it and the comma after it, is one token of the local tokenizer
(``trainer.task.wordle.model``; ``" r2 green,"``): a *cell* (position, letter, mark; 5 x 26 x 3 =
390), a *known* letter at a position (130), a letter *present* in the word (26), a letter *absent*
from it (26). Framing the separators into the item halves the board's tokens (measured: 45 -> 23 per
turn), which every warm-start, rollout and training token pays for. A hub model reads the same
text with its own tokenizer.

Consistency (:func:`is_consistent`) is the mechanism metric of the task: a guess is consistent when
it could still be the secret word given every earlier feedback row, by the environment's own rules
(``wordle_env.rules.feedback``).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

from wordle_env import rules

LETTERS = string.ascii_lowercase
WORD_LENGTH = 5
MARK_WORDS = {rules.GREEN: "green", rules.YELLOW: "yellow", rules.GRAY: "grey"}


def cell_token(position: int, letter: str, mark: str) -> str:
    """One feedback cell, e.g. ``cell_token(2, "r", "G") == "r2 green"`` (position 1-based)."""
    return f"{letter}{position} {MARK_WORDS[mark]}"


def known_token(position: int, letter: str) -> str:
    """A letter known at a position (a green), e.g. ``"r at 2"`` (position 1-based)."""
    return f"{letter} at {position}"


def present_token(letter: str) -> str:
    """A letter in the word whose place is not known from it (a yellow): ``"a in word"``."""
    return f"{letter} in word"


def absent_token(letter: str) -> str:
    """A letter not in the word (grey and never green or yellow): ``"c not in word"``."""
    return f"{letter} not in word"


@dataclass(frozen=True)
class TokenParts:
    """What an item token means, for the local model's spelling init
    (``trainer.task.wordle.model``).

    Attributes:
        kind: ``cell``, ``known``, ``present`` or ``absent``.
        letter: a-z.
        position: 1..5 for cells and known letters, else 0.
        mark: ``G``/``Y``/``X`` for cells, else "".
    """

    kind: str
    letter: str
    position: int = 0
    mark: str = ""


def framed(item: str) -> str:
    """An item as it stands in a board line, separators included: ``" r2 green,"``."""
    return f" {item},"


def item_tokens() -> dict[str, TokenParts]:
    """Every item token (572 framed strings, see :func:`framed`) and what it means, in a fixed
    order."""
    out: dict[str, TokenParts] = {}
    for p in range(1, WORD_LENGTH + 1):
        for letter in LETTERS:
            for mark in (rules.GREEN, rules.YELLOW, rules.GRAY):
                out[framed(cell_token(p, letter, mark))] = TokenParts("cell", letter, p, mark)
            out[framed(known_token(p, letter))] = TokenParts("known", letter, p)
    for letter in LETTERS:
        out[framed(present_token(letter))] = TokenParts("present", letter)
        out[framed(absent_token(letter))] = TokenParts("absent", letter)
    return out


@dataclass(frozen=True)
class Constraints:
    """The running constraints of a game.

    Attributes:
        known: (position 1-based, letter) of every green, sorted.
        present: letters marked yellow somewhere, sorted.
        absent: letters marked grey and never green or yellow, sorted.
    """

    known: tuple[tuple[int, str], ...]
    present: tuple[str, ...]
    absent: tuple[str, ...]


def constraints(guesses: Sequence[str], marks: Sequence[str]) -> Constraints:
    """The constraints implied by accepted ``guesses`` and their feedback ``marks`` (one ``G``/``Y``
    /``X`` string per guess, as ``WordleObservation.feedback``)."""
    known, present, grey = set(), set(), set()
    for guess, row in zip(guesses, marks, strict=True):
        for i, (letter, mark) in enumerate(zip(guess, row, strict=True)):
            if mark == rules.GREEN:
                known.add((i + 1, letter))
            elif mark == rules.YELLOW:
                present.add(letter)
            else:
                grey.add(letter)
    in_word = present | {letter for _, letter in known}
    return Constraints(tuple(sorted(known)), tuple(sorted(present)), tuple(sorted(grey - in_word)))


def render(guesses: Sequence[str], marks: Sequence[str]) -> str:
    """The board text added to the tool reply (module docstring); "" before the first guess."""
    if not guesses:
        return ""
    last, row = guesses[-1], marks[-1]
    cells = [cell_token(i + 1, c, m) for i, (c, m) in enumerate(zip(last, row, strict=True))]
    c = constraints(guesses, marks)
    items = [known_token(p, letter) for p, letter in c.known]
    items += [present_token(letter) for letter in c.present]
    items += [absent_token(letter) for letter in c.absent]
    lines = ["Letters:" + "".join(map(framed, cells))]
    if items:
        lines.append("Constraints:" + "".join(map(framed, items)))
    lines.append(f"Tried: {', '.join(guesses)}.")
    return "\n".join(lines)


def is_consistent(guess: str, guesses: Sequence[str], marks: Sequence[str]) -> bool:
    """Whether ``guess`` could be the secret word given every earlier guess and its feedback:
    ``rules.feedback(earlier, guess) == marks`` for each (a word already tried never is).

    Args:
        guess: a lowercase 5-letter word.
        guesses, marks: the accepted guesses before it and their feedback rows.
    """
    if not rules.is_lower_ascii_word(guess) or len(guess) != WORD_LENGTH:
        return False
    return all(
        g != guess and rules.feedback(g, guess) == m for g, m in zip(guesses, marks, strict=True)
    )


# An accepted guess in the game's reply (``wordle_env.game``): the guess, then its feedback row.
_ACCEPTED = re.compile(r"You submitted \[([a-z]+)\]\.\nFeedback:\n[A-Z ]+\n([GYX ]+)\n")


def accepted_moves(completion: Sequence[dict]) -> tuple[list[str], list[str]]:
    """The accepted guesses of one episode and their feedback rows (``G``/``Y``/``X`` strings),
    read from the game's replies in its tool messages (invalid moves and tool errors have none).

    Args:
        completion: the episode's messages after the prompt, as TRL's ``RolloutSample.completion``
            holds them (assistant turns and ``{"role": "tool", "content": <reply>}``).
    """
    guesses, marks = [], []
    for message in completion:
        content = message.get("content")
        if message.get("role") != "tool" or not isinstance(content, str):
            continue
        m = _ACCEPTED.match(content)
        if m is not None:
            guesses.append(m.group(1))
            marks.append(m.group(2).replace(" ", ""))
    return guesses, marks


def _reason_prefixes() -> dict[str, str]:
    """Each invalid move's code and the start of the reason the game gives for it (the text
    before ``, found``), from ``wordle_env.rules.check_guess`` itself, so that they cannot drift."""
    tries = ((None, ()), ("ab1de", ()), ("abc", ()), ("abcde", ("abcde",)), ("abcde", ()))
    out = {}
    for token, before in tries:
        invalid = rules.check_guess(token, before, ())
        out[invalid.code] = invalid.reason.split(", found")[0]
    return out


_REASONS = _reason_prefixes()


def move_tally(completion: Sequence[dict]) -> tuple[int, dict[str, int]]:
    """``(accepted guesses, invalid moves by code)`` of one episode, read from the game's replies
    in its tool messages (``wordle_env.rules.INVALID_MOVE_CODES``); a call the tool could not run
    (no reply from the game) is in neither."""
    accepted, invalid = 0, {}
    for message in completion:
        content = message.get("content")
        if message.get("role") != "tool" or not isinstance(content, str):
            continue
        if _ACCEPTED.match(content):
            accepted += 1
            continue
        for code, prefix in _REASONS.items():
            if prefix in content:
                invalid[code] = invalid.get(code, 0) + 1
                break
    return accepted, invalid


def consistency(completion: Sequence[dict]) -> tuple[int, int]:
    """``(consistent, checked)`` of one episode, as ``trainer.task.wordle.game_env.EpisodeStats``
    counts them: ``checked`` accepted guesses from the 2nd on, ``consistent`` of them could still be
    the secret word given all earlier feedback (:func:`is_consistent`)."""
    guesses, marks = accepted_moves(completion)
    consistent = sum(
        is_consistent(guesses[i], guesses[:i], marks[:i]) for i in range(1, len(guesses))
    )
    return consistent, max(0, len(guesses) - 1)
