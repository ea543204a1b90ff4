"""The OpenEnv ``Environment`` of the Wordle Space: one ``WordleGame`` per session.

openenv creates one instance per WebSocket session (``SUPPORTS_CONCURRENT_SESSIONS``),
so instances share nothing but the read-only word lists. Game errors (invalid moves, steps
before reset or after the end) come back inside the observation; only bad ``reset`` options
raise (``WordleResetError``), which the app turns into an HTTP 422 or a WebSocket error frame.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from wordle_env import rules, wordlists
from wordle_env.game import PROMPT, WordleGame
from wordle_env.models import (
    GAME_OVER,
    NO_ACTIVE_GAME,
    SESSION_CLOSED,
    WordleAction,
    WordleMessage,
    WordleObservation,
    WordleState,
)

_README = Path(__file__).resolve().parent.parent / "README.md"
_MAX_EPISODE_ID_CHARS = 255
_RESET_OPTIONS = ("seed", "episode_id", "target")
MAX_SEED = 2**63 - 1  # seeds are 0 .. MAX_SEED (what a signed 64-bit integer holds)


def _describe(value: object) -> str:
    """A short description of a bad option value (never the whole of a huge one)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _is_short_text(value: object) -> bool:
    """A str of at most 255 characters that encodes to UTF-8 (no lone surrogates)."""
    if not isinstance(value, str) or len(value) > _MAX_EPISODE_ID_CHARS:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class WordleResetError(ValueError):
    """``reset`` got options it cannot use; the message says which and how to fix them."""


class WordleEnvironment(Environment[WordleAction, WordleObservation, WordleState]):
    """Wordle behind the OpenEnv API (``reset``/``step``/``state``), one game per instance.

    The per-instance ``random.Random`` (seeded from the OS) picks targets for unseeded
    resets; seeded resets use ``wordlists.target_for_seed`` and touch no RNG at all.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._rng = random.Random()
        self._game: WordleGame | None = None
        self._episode_id: str | None = None
        self._seed: int | None = None
        self._step_count = 0
        self._closed = False

    # -- OpenEnv API -------------------------------------------------------------------------

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        target: str | None = None,
        **kwargs: Any,
    ) -> WordleObservation:
        """Start a new game.

        Args:
            seed: picks the target deterministically (``wordlists.target_for_seed``), the same
                in every session and process, so a GRPO group can share a word; an integer
                in ``[0, MAX_SEED]``.
            episode_id: id to report in ``state``; a UUID when None.
            target: play this word (must be an allowed guess); for tests. Not with ``seed``.
            **kwargs: refused; listed so that openenv forwards unknown options here and
                they get an error instead of being dropped silently.

        Returns:
            The first observation (``reward`` 0.0, ``done`` False).

        Raises:
            WordleResetError: unknown option, wrong types, a seed out of range, ``seed`` and
                ``target`` together,
                an unknown target word, or a session the server already closed.
        """
        if kwargs:
            raise WordleResetError(
                f"unknown reset option(s) {sorted(kwargs)}; expected only {list(_RESET_OPTIONS)}"
            )
        if self._closed:
            raise WordleResetError(
                "this session was closed by the server (idle expiry or shutdown); "
                "open a new connection and reset there"
            )
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
        ):
            raise WordleResetError(
                f"seed must be an integer in [0, {MAX_SEED}] or null, found {_describe(seed)}; "
                'send e.g. {"type": "reset", "data": {"seed": 7}}'
            )
        if episode_id is not None and not _is_short_text(episode_id):
            raise WordleResetError(
                f"episode_id must be valid text of at most {_MAX_EPISODE_ID_CHARS} characters "
                f"or null, found {type(episode_id).__name__} of length "
                f"{len(episode_id) if isinstance(episode_id, str) else 'n/a'}"
            )
        if target is not None and seed is not None:
            raise WordleResetError(
                f"pass either seed or target, not both (found seed={seed}, target={target!r})"
            )
        if target is not None and (
            not isinstance(target, str) or target not in wordlists.allowed_guesses()
        ):
            raise WordleResetError(
                f"target must be a {rules.WORD_LENGTH}-letter lowercase word from the allowed "
                f"list, found {target!r}"
            )
        if target is None:
            target = (
                wordlists.target_for_seed(seed)
                if seed is not None
                else self._rng.choice(wordlists.answers())
            )
        self._game = WordleGame(target)
        self._episode_id = episode_id if episode_id is not None else str(uuid.uuid4())
        self._seed = seed
        self._step_count = 0
        return self._observation(reply="")

    async def reset_async(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        target: str | None = None,
        **kwargs: Any,
    ) -> WordleObservation:
        """``reset`` run inline on the event loop: a game costs microseconds, a thread hop more."""
        return self.reset(seed=seed, episode_id=episode_id, target=target, **kwargs)

    def step(
        self, action: WordleAction, timeout_s: float | None = None, **kwargs: Any
    ) -> WordleObservation:
        """Play one message. Never raises for game errors; they come back in the observation.

        Args:
            action: the player's message.
            timeout_s: accepted for API compatibility and ignored (a step takes microseconds).

        Returns:
            The observation after the move. Without a running game (no reset yet, or the game
            is over, or the session was closed) the observation has ``done`` True and
            ``error_code`` ``no_active_game`` / ``game_over`` / ``session_closed``.

        Raises:
            TypeError: when ``action`` is not a ``WordleAction`` (a programming error).
        """
        if not isinstance(action, WordleAction):
            raise TypeError(f"step() takes a WordleAction, found {type(action).__name__}")
        if self._closed:
            return self._error(
                SESSION_CLOSED,
                "this session was closed by the server (idle expiry or shutdown); "
                "open a new connection and reset there",
            )
        if self._game is None:
            return self._error(
                NO_ACTIVE_GAME,
                "no game is running: send reset first (over HTTP, /reset and /step are "
                "stateless in OpenEnv; play through the WebSocket session at /ws)",
            )
        if self._game.done:
            return self._error(
                GAME_OVER,
                f"the game is over (reward {self._game.reward:.2f}); send reset to play again",
            )
        result = self._game.play(action.message)
        self._step_count += 1
        error = result.invalid
        return self._observation(
            reply=result.reply,
            breakdown=result.breakdown.as_dict(),
            error_code=None if error is None else error.code,
            error=None if error is None else error.reason,
        )

    async def step_async(
        self, action: WordleAction, timeout_s: float | None = None, **kwargs: Any
    ) -> WordleObservation:
        """``step`` run inline on the event loop (see ``reset_async``)."""
        return self.step(action, timeout_s=timeout_s, **kwargs)

    @property
    def state(self) -> WordleState:
        """The session's state (built on demand); ``target`` is revealed only once the game is
        over."""
        game = self._game
        if game is None:
            return WordleState()
        return WordleState(
            episode_id=self._episode_id,
            step_count=self._step_count,
            seed=self._seed,
            guesses=list(game.guesses),
            feedback=list(game.marks),
            invalid_streak=game.invalid_streak,
            game_active=not game.done,
            done=game.done,
            won=game.won,
            target=game.target if game.done else None,
        )

    def close(self) -> None:
        """Mark the session closed: later steps report ``session_closed``, resets raise."""
        self._closed = True

    def get_metadata(self) -> EnvironmentMetadata:
        """Name, description and README of this environment (for ``/metadata`` and the UI)."""
        return EnvironmentMetadata(
            name="wordle",
            description=(
                "Wordle (TextArena rules): 5-letter words, 6 guesses, [word] guesses, seeded "
                "resets, concurrent WebSocket sessions"
            ),
            readme_content=_README.read_text(encoding="utf-8") if _README.is_file() else None,
            version="0.1.0",
        )

    # -- helpers -----------------------------------------------------------------------------

    def _observation(
        self,
        reply: str,
        breakdown: dict[str, float] | None = None,
        error_code: str | None = None,
        error: str | None = None,
    ) -> WordleObservation:
        game = self._game
        assert game is not None
        breakdown = breakdown or {}
        return WordleObservation(
            prompt=PROMPT,
            messages=[WordleMessage(content=game.transcript)],
            reply=reply,
            guesses=list(game.guesses),
            feedback=list(game.marks),
            guesses_left=game.guesses_left,
            invalid_streak=game.invalid_streak,
            won=game.won,
            target=game.target if game.done else None,
            error_code=error_code,
            error=error,
            reward_breakdown=breakdown,
            done=game.done,
            reward=game.reward,
            metadata={"reward_breakdown": breakdown},
        )

    def _error(self, code: str, message: str) -> WordleObservation:
        """An observation for a message that could not be played at all."""
        game = self._game
        if game is None:
            return WordleObservation(
                prompt=PROMPT,
                reply=message,
                error_code=code,
                error=message,
                done=True,
                reward=0.0,
            )
        observation = self._observation(reply=message, error_code=code, error=message)
        observation.done = True
        return observation
