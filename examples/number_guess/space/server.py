"""The number-guessing environment server: openenv's ``create_app`` around
:class:`NumberGuessEnvironment` (the rules: ``game.py``), behind a key.

Routes: openenv's ``/ws`` (one WebSocket session a game: what clients use), ``/reset``, ``/step``
and ``/state`` (stateless HTTP: each call gets a fresh environment, so a game cannot be played over
them), ``/schema``, ``/metadata``, ``/health``; and ``/stats`` (games, moves and solved games since
the server started). With a key (``NUMBER_GUESS_API_KEY``) every route but ``/health`` needs
``Authorization: Bearer <key>``, checked by Starlette's ``AuthenticationMiddleware`` before
anything else runs: HTTP requests without it get 401 and the reason, a WebSocket handshake is
refused (HTTP 403). Without a key (a private Space, where the Hub checks the HF token; a local
server) every request passes.

Settings (environment variables, read by :func:`load_settings`): ``PORT`` (7860),
``NUMBER_GUESS_HOST`` (0.0.0.0), ``NUMBER_GUESS_API_KEY`` (none), ``NUMBER_GUESS_MAX_SESSIONS``
(256 concurrent games), ``NUMBER_GUESS_IDLE_TIMEOUT_S`` (600).

Run: ``python -m server`` in this folder.
"""

from __future__ import annotations

import hmac
import os
import random
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from game import HIGH, LOW, MAX_GUESSES, Game, secret_for  # beside this file
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, ConcurrencyConfig, Observation, State
from starlette.authentication import AuthenticationBackend, AuthenticationError
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse

OPEN_PATHS = ("/health",)  # answered without the key: the container's and the Hub's probe
KEY_VARIABLE = "NUMBER_GUESS_API_KEY"
STATS = {"games": 0, "moves": 0, "solved": 0}  # this process's tally (``GET /stats``)


class SettingsError(ValueError):
    """An environment variable holds a value the server cannot use."""


@dataclass(frozen=True)
class Settings:
    """The server's settings (the module's docstring names their variables).

    Attributes:
        host: interface to bind.
        port: TCP port.
        api_key: the key every route but ``/health`` needs; empty: none. Never printed.
        max_sessions: concurrent WebSocket sessions (games); the next gets openenv's
            ``CAPACITY_REACHED``.
        idle_timeout_s: seconds a session may sit idle before openenv ends it.
    """

    host: str = "0.0.0.0"
    port: int = 7860
    api_key: str = field(default="", repr=False)
    max_sessions: int = 256
    idle_timeout_s: float = 600.0


def _number(env, name: str, default, kind, low, high):
    """Variable ``name`` of ``env`` as ``kind`` in ``[low, high]``, ``default`` when unset."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise SettingsError(f"{name}: expected a number in [{low}, {high}], found {raw!r}")
    return value


def load_settings(env=None) -> Settings:
    """The settings from ``env`` (default ``os.environ``).

    Raises:
        SettingsError: a variable is out of its range; the message names it and the range.
    """
    env = os.environ if env is None else env
    return Settings(
        host=(env.get("NUMBER_GUESS_HOST") or "").strip() or "0.0.0.0",
        port=_number(env, "PORT", 7860, int, 1, 65535),
        api_key=(env.get(KEY_VARIABLE) or "").strip(),
        max_sessions=_number(env, "NUMBER_GUESS_MAX_SESSIONS", 256, int, 1, 100_000),
        idle_timeout_s=_number(env, "NUMBER_GUESS_IDLE_TIMEOUT_S", 600.0, float, 1.0, 86_400.0),
    )


class NumberGuessAction(Action):
    """One guess."""

    number: int


class NumberGuessObservation(Observation):
    """The answer to a guess (after ``reset``: the game's rules, ``feedback`` empty).

    Attributes:
        feedback: ``higher``, ``lower``, ``correct``, ``out_of_range``, or ``game_over`` (a guess
            with no game in progress: reset first).
        guess: the number guessed (None after ``reset``).
        guesses_left: moves still allowed.
        low, high: the secret's range.
    """

    feedback: str = ""
    guess: int | None = None
    guesses_left: int = MAX_GUESSES
    low: int = LOW
    high: int = HIGH


class NumberGuessEnvironment(Environment[NumberGuessAction, NumberGuessObservation, State]):
    """One game a session; ``reset(seed=...)`` draws the secret from the seed."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._game: Game | None = None
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> NumberGuessObservation:
        """A new game: its secret drawn from ``seed`` (None: a random one)."""
        seed = random.randrange(2**63) if seed is None else int(seed)
        self._game = Game(secret_for(seed))
        self._state = State(episode_id=episode_id, step_count=0)
        STATS["games"] += 1
        return NumberGuessObservation(reward=0.0, done=False)

    def step(self, action: NumberGuessAction, timeout_s=None, **kwargs) -> NumberGuessObservation:
        """The answer to one guess (``game_over``, done, without a game in progress)."""
        game = self._game
        if game is None or game.over:
            reward = game.reward() if game is not None else 0.0
            return NumberGuessObservation(
                feedback="game_over", guess=action.number, guesses_left=0, reward=reward, done=True
            )
        feedback = game.guess(action.number)
        self._state.step_count += 1
        STATS["moves"] += 1
        STATS["solved"] += int(game.solved)
        return NumberGuessObservation(
            feedback=feedback,
            guess=action.number,
            guesses_left=game.guesses_left,
            reward=game.reward(),
            done=game.over,
        )

    @property
    def state(self) -> State:
        return self._state


class BearerKey(AuthenticationBackend):
    """Starlette authentication: ``Authorization: Bearer <key>`` on every path but
    ``OPEN_PATHS``, compared in constant time; the key is never echoed or logged."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()

    async def authenticate(self, conn: HTTPConnection):
        if conn.url.path in OPEN_PATHS:
            return None
        scheme, _, token = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            raise AuthenticationError("found no 'Authorization: Bearer' header")
        if not hmac.compare_digest(token.strip().encode(), self._key):
            raise AuthenticationError("found a Bearer token that is not this server's key")
        return None


def _refused(conn: HTTPConnection, exc: AuthenticationError) -> JSONResponse:
    return JSONResponse(
        {
            "detail": f"expected 'Authorization: Bearer <key>' with this server's key, {exc}; "
            f"send the key the deploy kept for this Space ({KEY_VARIABLE} on the server)",
            "variable": KEY_VARIABLE,
        },
        status_code=401,
        headers={"WWW-Authenticate": 'Bearer realm="number-guess"'},
    )


def build_app(settings: Settings) -> FastAPI:
    """openenv's app for ``settings``, its ``/stats`` route, and the key in front of both."""
    os.environ["ENABLE_WEB_INTERFACE"] = "false"  # one shared game, and it cannot send the key
    app = create_app(
        NumberGuessEnvironment,
        NumberGuessAction,
        NumberGuessObservation,
        env_name="number_guess",
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=settings.max_sessions, session_timeout=settings.idle_timeout_s
        ),
    )
    app.add_api_route("/stats", lambda: dict(STATS), methods=["GET"])
    if settings.api_key:
        app.add_middleware(
            AuthenticationMiddleware, backend=BearerKey(settings.api_key), on_error=_refused
        )
    return app


settings = load_settings()
app = build_app(settings)


def main() -> None:
    """Serve :data:`app` on ``settings.host:settings.port``."""
    print(f"number-guess env: {settings}", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
