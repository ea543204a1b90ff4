"""``NumberGuessEnv``: TRL's tool environment of the number-guessing game, one game per rollout,
played on the game's server (the Space in ``space/``) with openenv's WebSocket client.

TRL builds the class with no arguments, calls ``reset(**row)`` before a rollout (its text is
appended to the prompt's last message), offers the public methods as tools (here ``guess``: its
signature and Google-style docstring are the tool's schema) and adds ``get_reward()`` to the
rewards when the rollout ends. The generic evaluation (``trainer.task.tool_eval``) builds it with
``env_url`` and ``env_headers``, stops an episode once ``done`` is true and closes it (a context
manager).

The server keeps the game (the secret, the guesses, the reward); this client only turns its
observations into the text the model reads (:func:`reset_text`, :func:`tool_reply`). It never
imports the Space: openenv's ``GenericEnvClient`` speaks the protocol with plain dicts. TRL's
spawned rollout process imports this module, so the server's address comes from the environment
(``DELTASYNC_ENV_URL``, and its key from ``WORDLE_API_KEY``: ``trainer.task.base``).
"""

from __future__ import annotations

import logging
import os
import re

from trainer.task.base import ENV_KEY_VAR, ENV_URL_VAR, env_headers
from trainer.trust import TrustedUrls

log = logging.getLogger("examples.number_guess.env")

# The tool replies (:func:`tool_reply`), as :func:`parse_reply` reads them back.
_REPLY = re.compile(r"(Higher than|Lower than|Correct:) (-?\d+)\.|(-?\d+) is out of range")
_FEEDBACK = {"Higher than": "higher", "Lower than": "lower", "Correct:": "correct"}


class EnvUnreachable(ConnectionError):
    """The game's server could not start a game (no URL, refused, or unreachable)."""


def reset_text(low: int, high: int, guesses: int) -> str:
    """The text appended to the prompt at the start of a game."""
    return f"\nThe secret is a whole number from {low} to {high}. You have {guesses} guesses."


def tool_reply(feedback: str, number: int, guesses_left: int, done: bool, low=1, high=100) -> str:
    """The tool message the model reads after guessing ``number``.

    Args:
        feedback: the server's answer: ``higher``, ``lower``, ``correct``, ``out_of_range`` or
            ``game_over`` (a guess after the end).
        number: the number guessed.
        guesses_left: moves still allowed.
        done: the game is over.
        low, high: the secret's range (named in an out-of-range reply).
    """
    head = {
        "higher": f"Higher than {number}.",
        "lower": f"Lower than {number}.",
        "correct": f"Correct: {number}.",
        "out_of_range": f"{number} is out of range ({low} to {high}).",
    }.get(feedback)
    if head is None:
        return "The game is over."
    if done:
        return head + " Game over."
    return head + f" {guesses_left} {'guess' if guesses_left == 1 else 'guesses'} left."


def parse_reply(text: str) -> tuple[str, int] | None:
    """``(feedback, number)`` of a :func:`tool_reply`, or None for any other text (a tool error,
    the game-over reply)."""
    m = _REPLY.match(text or "")
    if m is None:
        return None
    if m.group(3) is not None:
        return "out_of_range", int(m.group(3))
    return _FEEDBACK[m.group(1)], int(m.group(2))


class NumberGuessEnv:
    """One number-guessing game per rollout (TRL's ``environment_factory``).

    Args:
        env_url: the server's URL; None: ``$DELTASYNC_ENV_URL`` (TRL's spawned process).
        env_headers: headers of the connection (the server's key); None with ``env_url`` None:
            the run's rule (``trainer.task.base.env_headers``: ``$WORDLE_API_KEY``, else the HF
            token for a private Space).

    Attributes:
        moves: ``(number, feedback)`` of each guess the server answered, in order.
        reward: the game's reward so far (the server's), final once :attr:`done`.
    """

    def __init__(self, env_url: str | None = None, env_headers: dict | None = None):
        self._url = env_url
        self._headers = env_headers
        self._client = None
        self.moves: list[tuple[int, str]] = []
        self.reward = 0.0
        self._done = False

    @property
    def done(self) -> bool:
        """Whether the game is over (solved, or out of guesses)."""
        return self._done

    def _connect(self) -> None:
        url = self._url or os.environ.get(ENV_URL_VAR)
        if not url:
            raise EnvUnreachable(
                f"expected the number-guess server's URL in ${ENV_URL_VAR} (set by the trainer) "
                "or as env_url, found none; pass --env-url or let the local default start it"
            )
        headers = self._headers
        if self._url is None:  # TRL's process: the run's rule for the one URL it was given
            trust = TrustedUrls.of([url])
            headers = env_headers(
                url, os.environ.get(ENV_KEY_VAR), os.environ.get("HF_TOKEN"), trust
            )
        from openenv.core.generic_client import GenericEnvClient  # openenv imports gradio: ~7 s

        self._client = GenericEnvClient(base_url=url, headers=headers or None).sync()
        self._client.connect()

    def _close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception as e:  # broken already; the next reset opens a new connection
                log.debug("closing a broken number-guess connection: %r", e)
        self._client = None

    def __enter__(self) -> NumberGuessEnv:
        return self

    def __exit__(self, *exc) -> None:
        """Close the connection (the generic evaluation closes each episode's)."""
        self._close()

    def reset(self, seed: int, **_row) -> str:
        """Start the game of this row's ``seed`` (the server draws the secret from it); returns
        the text appended to the prompt.

        Raises:
            EnvUnreachable: no URL, or the server refused or could not be reached twice (a
                closed connection is replaced once).
        """
        self.moves, self.reward, self._done = [], 0.0, False
        try:
            return self._start(seed)
        except EnvUnreachable:
            raise
        except Exception as e:  # e.g. a session the server closed: one new connection
            log.info("number-guess reset failed (%r); reconnecting once", e)
            self._close()
        try:
            return self._start(seed)
        except EnvUnreachable:
            raise
        except Exception as e:
            self._close()
            where = self._url or os.environ.get(ENV_URL_VAR)
            raise EnvUnreachable(
                f"expected the number-guess server at {where} to start a game, found {e!r}; "
                f"check that it runs and that its key (${ENV_KEY_VAR}) is the server's"
            ) from e

    def _start(self, seed) -> str:
        if self._client is None:
            self._connect()
        obs = self._client.reset(seed=int(seed)).observation
        return reset_text(obs["low"], obs["high"], obs["guesses_left"])

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: a whole number in the game's range.

        Returns:
            Whether the secret is higher or lower than the guess, or that it is correct.
        """
        if self._client is None:
            raise EnvUnreachable("expected a game started by reset, found none")
        try:
            value = int(number)
        except (TypeError, ValueError):
            raise ValueError(f"expected a whole number, found {number!r}") from None
        result = self._client.step({"number": value})
        obs = result.observation
        self._done = bool(result.done)
        self.reward = float(result.reward or 0.0)
        if obs["feedback"] != "game_over":
            self.moves.append((value, obs["feedback"]))
        return tool_reply(
            obs["feedback"], value, obs["guesses_left"], self._done, obs["low"], obs["high"]
        )

    def get_reward(self) -> float:
        """The game's reward (the server's: 1 solved, else half the nearest guess's closeness,
        less 0.1 an out-of-range guess)."""
        return self.reward
