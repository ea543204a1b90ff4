"""``WordleEnv``: the OpenEnv client of the Wordle Space (one WebSocket session per instance).

Built on openenv's ``EnvClient`` (openenv 0.10); it never imports the server. Async by default,
``.sync()`` gives the blocking wrapper::

    async with WordleEnv(base_url="https://<space>.hf.space") as env:
        result = await env.reset(seed=7)
        result = await env.step("[crane]")
        print(result.observation.feedback, result.reward, result.done)

Server error frames raise :class:`WordleServerError` (``.code`` is the server's code, e.g.
``CAPACITY_REACHED`` -> :class:`WordleCapacityError`, ``SESSION_EXPIRED`` ->
:class:`WordleSessionExpiredError`); a refused handshake (no key, over the per-client session
cap) raises :class:`WordleRefusedError` with the server's reason. A server with a key
(``WORDLE_API_KEY``) needs ``WordleEnv(base_url=..., headers={"Authorization": "Bearer <key>"})``.
Game errors (invalid guesses) do not raise, they come back in
``observation.error_code`` / ``observation.error``. A connection the server closed without a
reason raises ``ConnectionError``. After the server closed a session, the next call
opens a new one; ``reset`` does that by itself (once), so long-lived clients survive idle
expiry.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.protocol import State

from wordle_env.models import WordleAction, WordleObservation, WordleState

log = logging.getLogger(__name__)


class WordleServerError(RuntimeError):
    """The server answered with an error frame.

    Attributes:
        code: the server's error code (openenv's ``WSErrorCode`` values or the Space's
            ``MESSAGE_TOO_LARGE`` / ``INVALID_MESSAGE`` / ``SESSION_EXPIRED``).
        data: the whole ``data`` object of the frame.
    """

    def __init__(self, code: str, message: str, data: dict[str, Any]) -> None:
        super().__init__(f"server error {code}: {message}")
        self.code = code
        self.data = data


class WordleCapacityError(WordleServerError):
    """The server already holds its maximum number of sessions; retry later or raise its cap
    (``WORDLE_MAX_SESSIONS``)."""


class WordleSessionExpiredError(WordleServerError):
    """The server closed this session after it sat idle; open a new client and reset."""


class WordleRefusedError(ConnectionError):
    """The server refused the WebSocket handshake: 401 without its key (``WORDLE_API_KEY``:
    pass ``headers={"Authorization": "Bearer <key>"}``), 429 when this client already holds
    ``WORDLE_MAX_SESSIONS_PER_CLIENT`` sessions, 404 for a route that is off.

    Attributes:
        status: the HTTP status of the refusal.
        detail: the server's explanation (its JSON ``detail``, else the body's text).
    """

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(f"{url} refused the connection with HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


def _refusal(url: str, error: BaseException | None) -> WordleRefusedError | None:
    """The handshake refusal behind a failed connect (websockets' ``InvalidStatus``), or None
    when the connect failed otherwise."""
    if not isinstance(error, InvalidStatus):
        return None
    body = error.response.body or b""
    try:
        detail = str(json.loads(body)["detail"])
    except (ValueError, KeyError, TypeError):
        detail = body.decode("utf-8", "replace")[:500] or "no explanation"
    return WordleRefusedError(url, error.response.status_code, detail)


_ERRORS_BY_CODE: dict[str, type[WordleServerError]] = {
    "CAPACITY_REACHED": WordleCapacityError,
    "SESSION_EXPIRED": WordleSessionExpiredError,
}


class WordleEnv(EnvClient[WordleAction, WordleObservation, WordleState]):
    """Client of one Wordle session.

    Args:
        base_url: ``http(s)://`` or ``ws(s)://`` address of the Space; ``/ws`` is appended.
        **kwargs: passed to ``EnvClient`` (``connect_timeout_s``, ``message_timeout_s``, ...).
    """

    async def _connect_async(self) -> WordleEnv:
        """Open the session's WebSocket; a refused handshake raises :class:`WordleRefusedError`
        with the server's reason (openenv's own error says only the status)."""
        try:
            return await super()._connect_async()
        except ConnectionError as error:
            refused = _refusal(self._ws_url or "the Wordle server", error.__cause__)
            if refused is None:
                raise
            raise refused from error

    async def _reset_async(  # type: ignore[override]
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        target: str | None = None,
    ) -> StepResult[WordleObservation]:
        """``reset(seed=None, episode_id=None, target=None)``: start a new game in this session
        (``await env.reset(...)``, or ``env.sync().reset(...)``; ``EnvClient`` dispatches both
        here).

        Args:
            seed: picks the target deterministically (the same in every session).
            episode_id: id reported by ``state()``.
            target: play this exact word (tests); not together with ``seed``.

        If the server has closed this session (idle expiry, restart), a new connection is
        opened and the reset sent again, once.

        Raises:
            WordleServerError: e.g. ``EXECUTION_ERROR`` for unusable options, with the
                server's explanation; ``WordleCapacityError`` when the server is full.
            WordleRefusedError: the server refused the connection (no key, or this client
                already holds ``WORDLE_MAX_SESSIONS_PER_CLIENT`` sessions); not retried.
            ConnectionError: the server cannot be reached.
        """
        options = {"seed": seed, "episode_id": episode_id, "target": target}
        options = {k: v for k, v in options.items() if v is not None}
        try:
            return await super()._reset_async(**options)
        except WordleRefusedError:  # no key, or this client's cap: a new connection is refused too
            raise
        except (WordleSessionExpiredError, ConnectionError) as error:
            # A reset needs nothing from the old session, so a session the server closed
            # (idle expiry, restart) is replaced by a new connection, once.
            log.info("Wordle session was closed (%s); reconnecting to reset", error)
            return await super()._reset_async(**options)

    async def _step_async(  # type: ignore[override]
        self, action: WordleAction | str, **kwargs: Any
    ) -> StepResult[WordleObservation]:
        """``step(action)``: send one message (a ``WordleAction`` or its text, e.g.
        ``"[crane]"``)."""
        if isinstance(action, str):
            action = WordleAction(message=action)
        return await super()._step_async(action, **kwargs)

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        # openenv's EnvClient silently replaces a socket the server closed with a new session;
        # for a step that would be a game that does not exist. Raise why the old one ended.
        if self._ws is not None and self._ws.state in (State.CLOSING, State.CLOSED):
            response = await self._closing_frame("the server closed this session")
        else:
            try:
                await self._send(message)
                response = await self._receive()
            except ConnectionClosed as closed:
                response = await self._closing_frame(f"the server closed this session ({closed})")
        if response.get("type") == "error":
            data = response.get("data") or {}
            code = str(data.get("code", "UNKNOWN"))
            error_cls = _ERRORS_BY_CODE.get(code, WordleServerError)
            raise error_cls(code, str(data.get("message", "no message")), data)
        return response

    async def _closing_frame(self, what: str) -> dict[str, Any]:
        """The error frame a server sends just before it closes a session (capacity reached,
        idle expiry); the socket is dropped, so the next call opens a new session (reset before
        stepping).

        Raises:
            ConnectionError: the server closed without saying why.
        """
        last = await self._last_frame()
        self._ws = None
        self._ws_loop = None
        if last is None or last.get("type") != "error":
            raise ConnectionError(f"{what}; reset to start a new session")
        return last

    async def _last_frame(self) -> dict[str, Any] | None:
        """A frame the server sent before closing, still buffered; None when there is none."""
        if self._ws is None:
            return None
        try:
            raw = await asyncio.wait_for(self._ws.recv(), timeout=1.0)
        except (ConnectionClosed, asyncio.TimeoutError):
            return None
        return json.loads(raw)

    def _step_payload(self, action: WordleAction) -> dict[str, Any]:
        return action.model_dump(exclude_defaults=True) | {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[WordleObservation]:
        fields = dict(payload.get("observation") or {})
        breakdown = fields.get("reward_breakdown") or {}
        observation = WordleObservation.model_validate(
            {
                **fields,
                "reward": payload.get("reward"),
                "done": payload.get("done", False),
                "metadata": {"reward_breakdown": breakdown},
            }
        )
        return StepResult(observation=observation, reward=observation.reward, done=observation.done)

    def _parse_state(self, payload: dict[str, Any]) -> WordleState:
        return WordleState.model_validate(payload)
