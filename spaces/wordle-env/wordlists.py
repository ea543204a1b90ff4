"""The shipped word lists (``words/*.txt``, see ``words/SOURCE.md``) and the seed -> target map.

Lists are read from the installed package on first use and cached; nothing is downloaded.
Standard library only.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources

from wordle_env.rules import WORD_LENGTH, is_lower_ascii_word

ANSWERS_FILE = "answers.txt"
ALLOWED_FILE = "allowed.txt"
# Changing this salt changes which word every seed plays; do not change it casually.
_SEED_SALT = b"deltasync-wordle-v1:"


class WordListError(ValueError):
    """A shipped word list is missing or malformed (a packaging problem, not a user error)."""


def _read_words(name: str) -> tuple[str, ...]:
    path = resources.files("wordle_env").joinpath("words", name)
    if not path.is_file():
        raise WordListError(
            f"word list {name!r} not found at {path}; it ships inside the deltasync package "
            "(package data wordle_env/words/*.txt): reinstall deltasync"
        )
    words = tuple(line.strip() for line in path.read_text(encoding="ascii").splitlines())
    bad = [w for w in words if len(w) != WORD_LENGTH or not is_lower_ascii_word(w)]
    if bad or not words:
        raise WordListError(
            f"word list {name!r} must hold one {WORD_LENGTH}-letter lowercase a-z word per "
            f"line, found {len(words)} lines of which {len(bad)} are bad (first: {bad[:3]}); "
            "regenerate it as words/SOURCE.md describes"
        )
    return words


@functools.cache
def answers() -> tuple[str, ...]:
    """The possible targets, sorted (3,568 common words; index order is part of the seed map)."""
    return _read_words(ANSWERS_FILE)


@functools.cache
def allowed_guesses() -> frozenset[str]:
    """Every word accepted as a guess (6,748 words); a superset of :func:`answers`.

    Raises:
        WordListError: when an answer is missing from the allowed list.
    """
    allowed = frozenset(_read_words(ALLOWED_FILE))
    missing = [w for w in answers() if w not in allowed]
    if missing:
        raise WordListError(
            f"every answer must also be an allowed guess, found {len(missing)} answers "
            f"missing from {ALLOWED_FILE} (first: {missing[:3]}); regenerate the lists"
        )
    return allowed


def target_for_seed(seed: int) -> str:
    """The target word that ``reset(seed=seed)`` plays, the same in every process and session.

    ``answers()[sha256(salt + decimal seed) mod len(answers())]``: stable across Python
    versions and machines, and independent of any random-number generator.

    Raises:
        TypeError: when ``seed`` is not an int (bool is refused too).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, found {type(seed).__name__} {seed!r}")
    digest = hashlib.sha256(_SEED_SALT + str(seed).encode("ascii")).digest()
    pool = answers()
    return pool[int.from_bytes(digest[:8], "big") % len(pool)]
