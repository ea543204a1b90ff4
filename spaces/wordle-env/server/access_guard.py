"""ASGI middleware in front of the whole app: who may use the server, and how many sessions one
client may hold, so that a public Wordle Space is neither open to anyone nor fillable by one
client.

- **Key** (``WORDLE_API_KEY``): when the server has one, every route but ``/health`` (the
  container's and the Hub's probe) needs ``Authorization: Bearer <key>``: HTTP requests get 401,
  WebSocket handshakes (``/ws``, ``/ws/ui``, ``/mcp``) are refused with 401 before they are
  accepted. The key is compared in constant time (``hmac.compare_digest``) and never logged or
  echoed. Without a key (a private Space, where the Hub's proxy checks the HF token; a local
  server) every request passes.
- **Sessions per client** (``WORDLE_MAX_SESSIONS_PER_CLIENT``): at most that many concurrent
  session WebSockets (``/ws``, and ``/mcp`` when MCP is on) per client; the next handshake is
  refused with 429 naming the cap and its variable. A session's slot is freed when its
  connection ends. The client is the key when the server has one (every holder of the key
  shares one budget), else the client's address (:func:`client_address`). The server-wide cap
  (``WORDLE_MAX_SESSIONS``) still applies on top: openenv answers ``CAPACITY_REACHED``.

Every refusal is JSON ``{"detail": ..., "cap": NAME, "limit": N, "variable": VAR}`` (the key's:
``cap`` is ``"api_key"``, without ``limit``), the shape of the rollout Space's refusals.

Which address is the client's: a Space is reached through the Hub's proxy, so the TCP peer is
the proxy for everyone. With ``forwarded_hops`` = N > 0 (``WORDLE_FORWARDED_HOPS``) the client is
the N-th address from the right of ``X-Forwarded-For``: the right-most entries are the ones the
trusted proxies appended, the left-most ones a client can forge. 1 (the default) trusts one proxy,
the Hub's; 0 ignores the header and uses the peer address (a server reached directly). Without
the header, or with fewer entries than N, the peer address is used. (The rollout Space's front
applies the same rule, ``rollout/limits.py``; Spaces do not import each other.)
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable

from .message_guard import ASGIApp, Receive, Scope, Send, refuse

log = logging.getLogger("wordle.access_guard")

OPEN_PATHS = ("/health",)  # answered without the key: the container's and the Hub's probe
KEY_VARIABLE = "WORDLE_API_KEY"
CAP_VARIABLE = "WORDLE_MAX_SESSIONS_PER_CLIENT"
KEY_CLIENT = "the holders of WORDLE_API_KEY"  # the one client of a keyed server


def client_address(headers: Iterable[tuple[bytes, bytes]], peer: str | None, hops: int) -> str:
    """The client's address: the ``hops``-th entry from the right of ``X-Forwarded-For`` (every
    such header, in order, split on commas; see the module's doc), else ``peer``
    (``"unknown"`` without one)."""
    if hops > 0:
        entries = [
            entry.strip()
            for name, value in headers
            if name.lower() == b"x-forwarded-for"
            for entry in value.decode("latin-1").split(",")
            if entry.strip()
        ]
        if len(entries) >= hops:
            return entries[-hops]
    return peer or "unknown"


def _key_problem(headers: Iterable[tuple[bytes, bytes]], key: bytes) -> str | None:
    """Why the request's ``Authorization`` does not carry ``Bearer <key>``, or None when it
    does. The value sent is never echoed."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if not values:
        return "found no Authorization header"
    scheme, _, token = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return "found an Authorization header of another scheme"
    if not hmac.compare_digest(token.strip(), key):
        return "found a Bearer token that is not this server's key"
    return None


class AccessGuard:
    """Wraps the app (outermost); see the module's doc.

    Args:
        app: the app behind (``MessageGuard`` around openenv's app).
        api_key: the server's key; empty: no key needed.
        max_sessions_per_client: concurrent session WebSockets per client.
        forwarded_hops: trusted proxies in front of the server (:func:`client_address`).
        session_paths: the WebSocket paths that hold a session (``/ws``, ``/mcp`` when on).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str = "",
        max_sessions_per_client: int,
        forwarded_hops: int = 1,
        session_paths: tuple[str, ...] = ("/ws",),
    ) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else b""
        self.max_sessions_per_client = max_sessions_per_client
        self.forwarded_hops = forwarded_hops
        self.session_paths = session_paths
        self.sessions: dict[str, int] = {}  # client -> open sessions (only clients holding one)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = scope.get("headers") or []
        if self._key and path not in OPEN_PATHS:
            problem = _key_problem(headers, self._key)
            if problem is not None:
                log.info("refused %s %s from %s: %s", kind, path, self._address(scope), problem)
                await refuse(
                    scope,
                    receive,
                    send,
                    401,
                    {
                        "detail": f"expected the header 'Authorization: Bearer <key>' with this "
                        f"server's key, {problem}; send the key the deploy kept for this Space "
                        f"(the trainer sends ${KEY_VARIABLE} to ENV_URL)",
                        "cap": "api_key",
                        "variable": KEY_VARIABLE,
                    },
                    headers=((b"www-authenticate", b'Bearer realm="wordle"'),),
                )
                return
        if kind != "websocket" or path not in self.session_paths:
            await self.app(scope, receive, send)
            return
        client = KEY_CLIENT if self._key else self._address(scope)
        held = self.sessions.get(client, 0)
        if held >= self.max_sessions_per_client:
            cap = self.max_sessions_per_client
            log.warning("refused a session of %s: it holds %d (%s)", client, held, CAP_VARIABLE)
            await refuse(
                scope,
                receive,
                send,
                429,
                {
                    "detail": f"expected at most {cap} sessions at once per client "
                    f"({CAP_VARIABLE}={cap}), found {held} open for {client}; close one "
                    f'(send {{"type": "close"}}) or wait for one to end, or raise '
                    f"{CAP_VARIABLE} on the server",
                    "cap": "max_sessions_per_client",
                    "limit": cap,
                    "variable": CAP_VARIABLE,
                },
                headers=((b"retry-after", b"1"),),
            )
            return
        self.sessions[client] = held + 1  # no await between the check and this: no race
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.sessions[client] - 1
            if left:
                self.sessions[client] = left
            else:
                del self.sessions[client]

    def _address(self, scope: Scope) -> str:
        peer = scope.get("client")
        return client_address(
            scope.get("headers") or [], peer[0] if peer else None, self.forwarded_hops
        )
