"""One Wordle game as a state machine over ``rules``: messages in, feedback text out. No I/O.

The server's environment wraps a ``WordleGame`` per session; tests and the trainer can use it
directly. Texts follow TextArena's Wordle (``"Feedback:"`` then the spaced letters and the
``G``/``Y``/``X`` row; ``"You attempted an invalid move"``) so parsers written for TRL's
Wordle examples work on them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from wordle_env import rules, wordlists

PROMPT = (
    "You are playing Wordle.\n"
    f"A secret {rules.WORD_LENGTH}-letter English word has been chosen. You have "
    f"{rules.MAX_GUESSES} guesses to find it.\n"
    "Write each guess as a word in square brackets, e.g. [crane]; only the first bracketed "
    "word of a message counts.\n"
    "Feedback for each letter:\n"
    "  - G (green): correct letter in the correct position\n"
    "  - Y (yellow): the letter is in the word but in another position\n"
    "  - X (gray): the letter is not in the word (or has no further copies in it)\n"
    "Greens are marked first, then yellows from left to right.\n"
    "A guess that is not a 5-letter word from the game's list, or that repeats an earlier "
    "guess, is an invalid move: it does not use a guess, but two invalid moves in a row end "
    "the game.\n"
    "Enter your guess to begin."
)


class GameOverError(RuntimeError):
    """A move was sent to a game that has already ended."""


@dataclass(frozen=True)
class MoveResult:
    """What one message did to the game.

    Attributes:
        token: the extracted bracketed token (None when the message had none).
        marks: the ``G``/``Y``/``X`` feedback when the guess was accepted, else None.
        invalid: why the move was invalid, None when the guess was accepted.
        reply: the text the game appended to the transcript for this move.
        breakdown: the shaped-reward signals of this move.
    """

    token: str | None
    marks: str | None
    invalid: rules.InvalidMove | None
    reply: str
    breakdown: rules.RewardBreakdown


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}es"


class WordleGame:
    """A single game against a fixed target.

    Args:
        target: the secret word; must be in the allowed list.
        allowed: the allowed-guess list; defaults to ``wordlists.allowed_guesses()``.

    Raises:
        ValueError: when ``target`` is not a word of the allowed list.
    """

    def __init__(self, target: str, allowed: Collection[str] | None = None) -> None:
        self._allowed = wordlists.allowed_guesses() if allowed is None else allowed
        if not isinstance(target, str) or target not in self._allowed:
            raise ValueError(
                f"target must be a {rules.WORD_LENGTH}-letter lowercase word from the allowed "
                f"list, found {target!r}; pick one from wordle_env.wordlists.answers()"
            )
        self.target = target
        self.guesses: list[str] = []
        self.marks: list[str] = []
        self.invalid_streak = 0
        self.won = False
        self.done = False
        self._replies: list[str] = []

    @property
    def guesses_left(self) -> int:
        """Guesses still available (0 to 6)."""
        return rules.MAX_GUESSES - len(self.guesses)

    @property
    def reward(self) -> float:
        """The game's reward so far (``rules.game_reward``); final once ``done``."""
        return rules.game_reward(self.won, self.marks[-1] if self.marks else None)

    @property
    def transcript(self) -> str:
        """The prompt followed by every reply so far, separated by blank lines."""
        return "\n\n".join([PROMPT, *self._replies])

    def play(self, message: str) -> MoveResult:
        """Apply one player message.

        Args:
            message: free text holding the guess as ``[word]``.

        Returns:
            The :class:`MoveResult`; game errors (invalid moves) are reported there, not raised.

        Raises:
            GameOverError: when the game has already ended (check ``done`` first).
        """
        if self.done:
            raise GameOverError(
                f"the game is over (the word was {self.target!r}); start a new game to play on"
            )
        token = rules.extract_guess(message)
        invalid = rules.check_guess(token, self.guesses, self._allowed)
        if invalid is not None:
            self.invalid_streak += 1
            reply = f"You attempted an invalid move. Reason: {invalid.reason}."
            if self.invalid_streak >= rules.INVALID_MOVES_TO_END:
                self.done = True
                reply += (
                    " That was the second invalid move in a row, so the game is over. "
                    f"The secret word was [{self.target}]."
                )
            else:
                reply += " This did not use a guess; another invalid move in a row ends the game."
            marks = None
        else:
            assert token is not None  # check_guess accepted it
            marks = rules.feedback(token, self.target)
            self.invalid_streak = 0
            self.guesses.append(token)
            self.marks.append(marks)
            reply = (
                f"You submitted [{token}].\nFeedback:\n{' '.join(token.upper())}\n"
                f"{' '.join(marks)}\n"
            )
            if token == self.target:
                self.won = self.done = True
                reply += f"You guessed the word in {_plural(len(self.guesses), 'guess')}. You win!"
            elif self.guesses_left == 0:
                self.done = True
                reply += (
                    f"You have used all {rules.MAX_GUESSES} guesses. "
                    f"The secret word was [{self.target}]."
                )
            else:
                reply += f"You have {_plural(self.guesses_left, 'guess')} left."
        self._replies.append(reply)
        reward = self.reward
        return MoveResult(
            token=token,
            marks=marks,
            invalid=invalid,
            reply=reply,
            breakdown=rules.reward_breakdown(token, marks, reward),
        )
