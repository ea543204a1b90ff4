"""The rules of one number-guessing game, with no I/O (standard library only).

A secret whole number in ``[LOW, HIGH]`` is drawn from the episode's seed, the same in every
session and process (all completions of a GRPO group play one secret). Each move guesses a number
and is answered ``higher`` (the secret is above it), ``lower``, ``correct``, or ``out_of_range``
(not in ``[LOW, HIGH]``: the move is used up all the same). The game is over once the guess is
correct or ``MAX_GUESSES`` moves were made; binary search always wins within them.

The reward (:meth:`Game.reward`: the score so far, final once the game is over) is 1.0 for a solved
game; otherwise half the closeness of the nearest guess, ``0.5 * (1 - min |guess - secret| /
(HIGH - LOW))`` (0 before a guess in range), so that games that are not solved still differ and
GRPO has a signal; minus ``OUT_OF_RANGE_PENALTY`` per out-of-range move. It lies in
``[-MAX_GUESSES * OUT_OF_RANGE_PENALTY, 1]``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

LOW, HIGH = 1, 100
MAX_GUESSES = 7
OUT_OF_RANGE_PENALTY = 0.1
FEEDBACK = ("higher", "lower", "correct", "out_of_range")


def secret_for(seed: int) -> int:
    """The secret of episode ``seed``: uniform in ``[LOW, HIGH]``, the same in every process."""
    return random.Random(seed).randint(LOW, HIGH)


@dataclass
class Game:
    """One game against ``secret``.

    Attributes:
        secret: the number to find, in ``[LOW, HIGH]``.
        guesses: the numbers guessed, in order (out-of-range ones included).
        feedback: the answer to each guess (one of ``FEEDBACK``).
    """

    secret: int
    guesses: list[int] = field(default_factory=list)
    feedback: list[str] = field(default_factory=list)

    @property
    def solved(self) -> bool:
        """Whether the last guess was the secret."""
        return bool(self.feedback) and self.feedback[-1] == "correct"

    @property
    def over(self) -> bool:
        """Whether the game is over: solved, or ``MAX_GUESSES`` moves made."""
        return self.solved or len(self.guesses) >= MAX_GUESSES

    @property
    def guesses_left(self) -> int:
        """Moves still allowed (0 once the game is over)."""
        return 0 if self.over else MAX_GUESSES - len(self.guesses)

    def guess(self, number: int) -> str:
        """Play ``number``; returns its feedback (one of ``FEEDBACK``).

        Raises:
            ValueError: the game is over (reset to play again).
        """
        if self.over:
            raise ValueError("expected a game in progress, found it over; reset to play again")
        if not LOW <= number <= HIGH:
            answer = "out_of_range"
        elif number == self.secret:
            answer = "correct"
        else:
            answer = "higher" if self.secret > number else "lower"
        self.guesses.append(number)
        self.feedback.append(answer)
        return answer

    def reward(self) -> float:
        """The game's score so far (the module's docstring), final once it is over."""
        if self.solved:
            base = 1.0
        else:
            misses = [
                abs(g - self.secret)
                for g, f in zip(self.guesses, self.feedback, strict=True)
                if f != "out_of_range"
            ]
            base = 0.5 * (1 - min(misses) / (HIGH - LOW)) if misses else 0.0
        return round(base - OUT_OF_RANGE_PENALTY * self.feedback.count("out_of_range"), 4)
