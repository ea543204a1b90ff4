"""ASGI middleware in front of openenv's app: message size caps, idle expiry, and the
public surfaces that are off unless a deployment turns them on.

openenv's ``/ws`` handler answers most bad input with an error frame and keeps the
session, but a frame that is valid JSON yet not an object (``[]``, ``"x"``), a binary frame,
deeply nested JSON or JSON with lone surrogate escapes makes it drop the whole session; and
its idle reaper frees the session slot without closing the socket, so an expired client could
keep playing outside the cap. This middleware closes those gaps without replacing any route:

- WebSocket ``/ws`` (and ``/mcp``): frames over ``max_message_bytes`` (``MESSAGE_TOO_LARGE``),
  binary frames and non-object JSON (``INVALID_MESSAGE``), JSON nested deeper than
  ``MAX_JSON_DEPTH`` or holding lone surrogate escapes (``INVALID_JSON``; openenv cannot
  serialize its echo of such input) get an error frame shaped like openenv's
  (``{"type": "error", "data": {"message", "code"}}``) and the session stays usable. A client
  silent for ``idle_timeout_s`` gets ``SESSION_EXPIRED`` and the connection is closed (code
  1000), which also ends the session in openenv.
- HTTP: request bodies over ``max_message_bytes`` get 413 before the app reads them.
- MCP (``/mcp`` over HTTP and WebSocket): refused with 404 unless ``mcp_enabled``
  (``WORDLE_ENABLE_MCP=1``). Wordle does not use MCP, and its sessions would take the slots
  of the trainer's ``/ws`` sessions.
- The web UI's WebSocket ``/ws/ui`` (only served with ``WORDLE_ENABLE_WEB=1``): at most
  ``max_ui_connections`` at once (more are refused with 403), each closed after
  ``idle_timeout_s`` without a frame from the client, frames over ``max_message_bytes`` refused.
- A client that leaves while openenv is closing its session (the usual order for a
  client that sends ``{"type": "close"}`` and hangs up) is logged as one INFO line, not as an
  ERROR with a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("wordle.message_guard")

MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
INVALID_MESSAGE = "INVALID_MESSAGE"
INVALID_JSON = "INVALID_JSON"
SESSION_EXPIRED = "SESSION_EXPIRED"
UI_PATHS = ("/ws/ui",)
_EXAMPLE = '{"type": "step", "data": {"message": "[crane]"}}'
# Deeper JSON is refused: openenv echoes invalid input in its validation errors and
# pydantic cannot serialize that echo past a few hundred levels (the session would drop).
MAX_JSON_DEPTH = 32


def json_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why parsed JSON ``value`` would break openenv's echo of it, or None if it is fine.

    Two things do: nesting deeper than ``max_depth`` lists/objects, and strings (values or
    keys) holding lone UTF-16 surrogates (``"\\ud800"`` escapes), which cannot be encoded
    back to UTF-8.
    """
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    return (
                        "JSON holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which "
                        "is not valid Unicode text; send valid UTF-8 text"
                    )
            continue
        if isinstance(node, dict):
            children: list[Any] = [*node.keys(), *node.values()]
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            return f"JSON nested more than {max_depth} levels deep; send a flat message"
        stack.extend((child, depth + 1) for child in children)
    return None


if sys.version_info >= (3, 11):

    async def _receive_within(receive: Receive, timeout_s: float) -> Message:
        """``await receive()``, raising ``TimeoutError`` after ``timeout_s``.

        ``asyncio.timeout`` arms one timer handle; ``wait_for`` (3.10) creates a task per call.
        """
        async with asyncio.timeout(timeout_s):
            return await receive()

else:  # pragma: no cover - Python 3.10

    async def _receive_within(receive: Receive, timeout_s: float) -> Message:
        """``await receive()``, raising ``asyncio.TimeoutError`` after ``timeout_s``."""
        return await asyncio.wait_for(receive(), timeout=timeout_s)


def _is_mcp(path: str) -> bool:
    """Whether a (decoded) request path is one of openenv's MCP routes."""
    stripped = "/" + path.strip("/")
    return stripped == "/mcp" or stripped.startswith("/mcp/")


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "(unknown)"


async def refuse(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    content: dict[str, Any],
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Answer an HTTP request or a WebSocket handshake with ``status`` and the JSON ``content``
    (its ``detail`` says why), without calling the app. A handshake is refused before it is
    accepted, with that HTTP status where the server supports it (uvicorn does), else closed
    with 1008 (policy violation) and the detail as the reason."""
    body = json.dumps(content).encode()
    start = {
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
    }
    if scope["type"] == "http":
        await send({"type": "http.response.start", **start})
        await send({"type": "http.response.body", "body": body})
        return
    first = await receive()  # websocket.connect (or a disconnect: nothing to answer)
    if first["type"] != "websocket.connect":
        return
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", **start})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        reason = str(content.get("detail", ""))[:120]
        await send({"type": "websocket.close", "code": 1008, "reason": reason})


def error_frame(code: str, message: str) -> str:
    """An error frame as openenv writes them (its clients raise on ``type == "error"``)."""
    return json.dumps({"type": "error", "data": {"message": message, "code": code}})


@dataclass
class _ScreenedReceive:
    """A WebSocket's ``receive`` as the app behind the guard sees it: idle-expired and screened.

    Args:
        source: the server's ``receive``.
        idle_timeout_s: seconds to wait for the client's next message; then ``on_idle()`` runs
            (it tells the client and closes the connection) and the app sees a disconnect.
        on_idle: called once the client has been silent for ``idle_timeout_s``.
        admit: called with each ``websocket.receive`` frame; True passes it to the app, False
            drops it (``admit`` answers the client itself if it should hear why).
        closed: turns True once the connection is over: the client left or ``on_idle`` ran.
    """

    source: Receive
    idle_timeout_s: float
    on_idle: Callable[[], Awaitable[None]]
    admit: Callable[[Message], Awaitable[bool]]
    closed: bool = False

    async def receive(self) -> Message:
        """The client's next message that the app should see (a disconnect after idling)."""
        while True:
            try:
                message = await _receive_within(self.source, self.idle_timeout_s)
            except asyncio.TimeoutError:
                self.closed = True
                await self.on_idle()
                return {"type": "websocket.disconnect", "code": 1000}
            if message["type"] == "websocket.disconnect":
                self.closed = True
            if message["type"] != "websocket.receive" or await self.admit(message):
                return message


class MessageGuard:
    """Wraps an ASGI app; see the module docstring for what it checks.

    Args:
        app: the openenv FastAPI app.
        max_message_bytes: largest WebSocket frame / HTTP body accepted, in bytes.
        idle_timeout_s: seconds a session may wait for the client's next frame.
        ws_paths: the WebSocket endpoints that hold a session each: openenv's ``/ws``
            and ``/mcp`` (the latter only when ``mcp_enabled``).
        mcp_enabled: serve openenv's MCP routes; False answers every ``/mcp`` request
            404 (HTTP) or refuses the WebSocket handshake with 404.
        max_ui_connections: concurrent ``/ws/ui`` connections allowed (the web UI's
            WebSocket, only present with the web UI on); more are refused with 403.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_message_bytes: int,
        idle_timeout_s: float,
        ws_paths: tuple[str, ...] = ("/ws", "/mcp"),
        mcp_enabled: bool = False,
        max_ui_connections: int = 8,
    ) -> None:
        self.app = app
        self.max_message_bytes = max_message_bytes
        self.idle_timeout_s = idle_timeout_s
        self.ws_paths = ws_paths
        self.mcp_enabled = mcp_enabled
        self.max_ui_connections = max_ui_connections
        self.ui_connections = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        path = scope.get("path", "")
        if kind in ("http", "websocket") and not self.mcp_enabled and _is_mcp(path):
            await self._refuse(
                scope,
                receive,
                send,
                404,
                "MCP is off on this server (WORDLE_ENABLE_MCP=1 turns it on); play Wordle "
                "through the WebSocket session at /ws",
            )
        elif kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket" and path in self.ws_paths:
            await self._websocket(scope, receive, send)
        elif kind == "websocket" and path in UI_PATHS:
            await self._ui_websocket(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, message: str
    ) -> None:
        await refuse(scope, receive, send, status, {"detail": message})

    # -- HTTP --------------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_message_bytes:
            await self._too_large(send, int(declared))
            return
        chunks: list[bytes] = []
        size = 0
        first: Message
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: let the app see it
                first = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_message_bytes:
                await self._too_large(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        body = json.dumps(
            {
                "detail": f"request body is at least {size} bytes; the limit is "
                f"{self.max_message_bytes} bytes (WORDLE_MAX_MESSAGE_BYTES); send a smaller body"
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    # -- WebSocket ---------------------------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def answer_bad_frame(message: Message) -> bool:
            problem = self._check_frame(message)
            if problem is not None:  # the app never sees it; the client gets the error frame
                await send({"type": "websocket.send", "text": problem})
            return problem is None

        frames = _ScreenedReceive(
            receive, self.idle_timeout_s, lambda: self._expire(send, scope), answer_bad_frame
        )

        async def guarded_send(message: Message) -> None:
            # openenv always sends a close when its session ends, even after the client
            # has gone (uvicorn then raises ClientDisconnected and logs a traceback) or after
            # the guard closed the connection. Nothing can go out then, so it is dropped.
            if message["type"] != "websocket.close":
                await send(message)
                return
            if frames.closed:
                return
            try:
                await send(message)
            except OSError as exc:  # uvicorn's ClientDisconnected: the client hung up first
                log.info(
                    "client %s left before the server closed its session (%s)",
                    _client(scope),
                    type(exc).__name__,
                )

        await self.app(scope, frames.receive, guarded_send)

    async def _ui_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The web UI's ``/ws/ui``: capped in number, idle-expired, frames size-capped."""
        if self.ui_connections >= self.max_ui_connections:
            await self._refuse(
                scope,
                receive,
                send,
                403,
                f"the web UI already has {self.max_ui_connections} connections "
                "(WORDLE_MAX_UI_CONNECTIONS); close another tab or try again later",
            )
            return
        self.ui_connections += 1

        async def close_idle() -> None:
            try:
                await send({"type": "websocket.close", "code": 1000, "reason": "idle"})
            except OSError as exc:
                log.info(
                    "idle web UI client %s was already gone (%s)",
                    _client(scope),
                    type(exc).__name__,
                )

        async def small_enough(message: Message) -> bool:
            # Too large for a UI keep-alive: dropped, the connection stays.
            text, data = message.get("text"), message.get("bytes")
            size = len(text.encode()) if text is not None else len(data or b"")
            return size <= self.max_message_bytes

        frames = _ScreenedReceive(receive, self.idle_timeout_s, close_idle, small_enough)

        async def ui_send(message: Message) -> None:
            if frames.closed and message["type"] == "websocket.close":
                return
            try:
                await send(message)
            except OSError as exc:
                if message["type"] != "websocket.close":
                    raise
                log.info("web UI client %s left first (%s)", _client(scope), type(exc).__name__)

        try:
            await self.app(scope, frames.receive, ui_send)
        finally:
            self.ui_connections -= 1

    async def _expire(self, send: Send, scope: Scope) -> None:
        text = error_frame(
            SESSION_EXPIRED,
            f"session closed after {self.idle_timeout_s:g} s without a message "
            "(WORDLE_IDLE_TIMEOUT_S); reconnect and reset to play again",
        )
        try:
            await send({"type": "websocket.send", "text": text})
            await send({"type": "websocket.close", "code": 1000, "reason": "idle timeout"})
        except OSError as exc:  # uvicorn's ClientDisconnected: the client is gone already
            log.info("idle session from %s was already disconnected: %s", scope.get("client"), exc)

    def _check_frame(self, message: Message) -> str | None:
        """Return an error frame for a frame openenv would choke on, else None."""
        text = message.get("text")
        if text is None:
            data = message.get("bytes") or b""
            return error_frame(
                INVALID_MESSAGE,
                f"expected a JSON text frame, found a binary frame of {len(data)} bytes; "
                f"send the JSON as text, e.g. {_EXAMPLE}",
            )
        size = len(text) if len(text) * 4 <= self.max_message_bytes else len(text.encode())
        if size > self.max_message_bytes:
            return error_frame(
                MESSAGE_TOO_LARGE,
                f"message is {size} bytes; the limit is {self.max_message_bytes} bytes "
                f"(WORDLE_MAX_MESSAGE_BYTES); send just the guess, e.g. {_EXAMPLE}",
            )
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None  # openenv answers INVALID_JSON itself and keeps the session
        except RecursionError:
            problem = f"JSON nested more than {MAX_JSON_DEPTH} levels deep; send a flat message"
        except ValueError as exc:  # e.g. an integer of more than 4300 digits (int conversion)
            problem = f"JSON holds a value Python cannot read ({exc}); send ordinary numbers"
        else:
            problem = json_problem(parsed)
        if problem is not None:
            return error_frame(INVALID_JSON, f"{problem}, e.g. {_EXAMPLE}")
        if not isinstance(parsed, dict):
            return error_frame(
                INVALID_MESSAGE,
                f"expected a JSON object, found a JSON {type(parsed).__name__}; "
                f"send e.g. {_EXAMPLE}",
            )
        return None
