"""The public front on the Space port (7860): generation API, health, token-guarded control.

Only the routes in ``V1_ROUTES`` and ``FRONT_ROUTES`` exist; everything else is 404 and never
reaches vLLM. vLLM's dev-mode routes (``/pause``, ``/collective_rpc``, ``/update_weights``,
``/metrics``, ...) live on the internal 127.0.0.1 port and are never proxied.

Every request passes ``PathGuard`` first, which decides on the path bytes exactly as received
(ASGI ``raw_path``), before any decoding or normalisation: a path holding a dot segment
(``/./``, ``/../``, a trailing ``/.`` or ``/..``), an empty segment (``//``), a backslash, or a
percent-encoded ``.``, ``/``, ``\\`` or ``%`` (any case, so double encodings too) is answered 400;
a path that is not byte-for-byte one of the routes is answered 404, a route with the wrong method
405. The upstream URL is the allow-list constant, never the request's path; the query string is
not forwarded (vLLM's three routes take none).

- ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``: proxied to vLLM
  (streaming included). With ``api_key`` set they need ``Authorization: Bearer <ROLLOUT_API_KEY>``
  (401 otherwise); the header is never forwarded. Request bodies over ``max_body_bytes`` get 413,
  with or without ``Content-Length``, after reading at most that many bytes. While the replica
  has no verified bucket version yet (``require_synced``) or is paused for a recovery, answered
  503. ``/v1/models`` reports each model's ``root`` as its served name, not vLLM's local path.
  Generation requests are capped per client (``rollout.limits``): in flight
  (``MAX_CONCURRENT_REQUESTS``, 429 beyond), ``n`` (``MAX_N``) and ``max_tokens`` /
  ``max_completion_tokens`` (``MAX_TOKENS``, 400 beyond); the upstream timeout is
  ``UPSTREAM_TIMEOUT_S``.
  On a LoRA replica it lists the stable ``ADAPTER_NAME`` (``parent``: the base model), not the
  versioned names behind it (``rollout.lora.public_cards``).
  Every answer carries ``X-Deltasync-Version``: the oldest bucket version that generated it.
  On a LoRA replica (``ADAPTER=lora``) a request for ``ADAPTER_NAME`` is sent to the newest
  loaded version ``{ADAPTER_NAME}-v{N}`` as it arrives and stamped N; it finishes on that
  version, which stays loaded until no request uses it (``rollout.lora``). Before the first
  version it is answered 503; requests for the base model are passed on, unstamped.
- ``GET /health``: 200 with ``{"status", "held_version", "newest_seen", "ready", "busy"}`` while
  vLLM is healthy, else 503. vLLM's own ``/health`` is asked on a client of its own (never queued
  behind generation); when it times out while vLLM answered a proxied request within
  ``busy_grace_s``, the engine is busy, not dead: 200 with ``"busy": true``. Versions are not
  secrets.
- ``GET /control/status``: the full heartbeat (timings, errors). ``POST /control/sync``: poll now.
  Both need ``Authorization: Bearer <CONTROL_TOKEN>``; without a configured token they are refused.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .limits import GENERATION_ROUTES, ConcurrencyGate, GenerationLimits, check_body, client_address
from .lora import AdapterRoutes, Lease, public_cards, route_body
from .sync_loop import SyncLoop

log = logging.getLogger("rollout.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The only vLLM routes the front forwards, with their methods. The upstream path is the key.
V1_ROUTES: dict[str, frozenset[str]] = {
    "/v1/completions": frozenset({"POST"}),
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/models": frozenset({"GET"}),
}
# The front's own routes (never forwarded).
FRONT_ROUTES: dict[str, frozenset[str]] = {
    "/health": frozenset({"GET"}),
    "/control/status": frozenset({"GET"}),
    "/control/sync": frozenset({"POST"}),
}
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

# Response header of every proxied /v1 answer: the bucket version that generated it.
VERSION_HEADER = "X-Deltasync-Version"
_HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}
_DROP_REQUEST_HEADERS = _HOP_HEADERS | {
    "authorization",
    "content-length",
    "expect",
    "proxy-authorization",
    "cookie",
}
# %2e '.', %2f '/', %5c '\', %25 '%' (so %252e and other double encodings too), any case.
_ENCODED_SEPARATOR = re.compile(rb"%(2e|2f|5c|25)", re.IGNORECASE)


def raw_path_problem(raw_path: bytes) -> str | None:
    """Why a request path (its bytes as received, query string excluded) is refused, or None.

    Refused: a path that does not start with ``/``, holds a backslash, an empty segment (``//``),
    a dot segment (``.`` or ``..``, anywhere, trailing included), or a percent-encoded ``.``,
    ``/``, ``\\`` or ``%`` in either case. These are the forms that a decoder or a URL library
    may turn into a different path than the one checked.
    """
    if not raw_path.startswith(b"/"):
        return "the path must start with '/'"
    if b"\\" in raw_path:
        return "the path holds a backslash"
    if _ENCODED_SEPARATOR.search(raw_path):
        return "the path holds a percent-encoded '.', '/', '\\' or '%'"
    segments = raw_path.split(b"/")[1:]
    if any(seg in (b".", b"..") for seg in segments):
        return "the path holds a '.' or '..' segment"
    if any(seg == b"" for seg in segments[:-1]) or raw_path.startswith(b"//"):
        return "the path holds an empty segment ('//')"
    return None


async def _send_json(send: Send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class PathGuard:
    """ASGI middleware: refuses every request whose raw path is not exactly an allowed route.

    Args:
        app: the front's FastAPI app.
        routes: ``{path: methods}`` of every route that exists; anything else is 404 (400 for
            the forms ``raw_path_problem`` refuses, 405 for a route with another method).

    An allowed request reaches ``app`` with ``scope["path"]`` and ``scope["raw_path"]`` set to
    the route constant. WebSocket connections are refused (the front has none).
    """

    def __init__(self, app: ASGIApp, *, routes: dict[str, frozenset[str]]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        raw = scope.get("raw_path")
        if raw is None:  # servers that do not provide it: the path is all we have
            raw = scope.get("path", "").encode("utf-8", "surrogateescape")
        raw = raw.partition(b"?")[0]  # some clients' raw_path includes the query string
        problem = raw_path_problem(raw)
        route = None if problem else raw.decode("ascii", "replace")
        methods = self.routes.get(route) if route is not None else None
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
            return
        if problem is not None:
            await _send_json(
                send, 400, {"error": f"bad request path: {problem}; use one of {list(self.routes)}"}
            )
            return
        if methods is None:
            await _send_json(
                send, 404, {"error": f"no such route; the routes are {list(self.routes)}"}
            )
            return
        if scope["method"] not in methods:
            allow = ", ".join(sorted(methods))
            await _send_json(
                send,
                405,
                {"error": f"{scope['method']} is not allowed on {route}; use {allow}"},
                [(b"allow", allow.encode())],
            )
            return
        # Downstream sees the constant, whatever decoding the server did.
        await self.app(dict(scope, path=route, raw_path=route.encode()), receive, send)


class _BodyTooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, reading at most ``limit + 1`` bytes.

    Raises:
        _BodyTooLarge: ``Content-Length`` declares more than ``limit`` bytes, or the (chunked)
            body turned out longer; what is left of it is never read.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _BodyTooLarge(int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge(size)
        chunks.append(chunk)
    return b"".join(chunks)


def _bearer(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    return auth[7:] if auth.lower().startswith("bearer ") else ""


def _check_token(request: Request, token: str | None) -> None:
    if not token:
        raise HTTPException(403, "control routes are disabled: set the CONTROL_TOKEN secret")
    given = _bearer(request)
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        raise HTTPException(
            401, "expected 'Authorization: Bearer <CONTROL_TOKEN>'", {"WWW-Authenticate": "Bearer"}
        )


def _api_key_refusal(request: Request, api_key: str | None) -> JSONResponse | None:
    """401 when ``api_key`` is set and the request does not carry it, else None."""
    if not api_key:
        return None
    given = _bearer(request)
    if given and hmac.compare_digest(given.encode(), api_key.encode()):
        return None
    found = "a different key" if given else "no bearer token"
    return JSONResponse(
        {
            "error": f"expected 'Authorization: Bearer <ROLLOUT_API_KEY>', found {found}; "
            "send the key this replica was started with"
        },
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def _public_models(body: bytes, routes: AdapterRoutes | None) -> bytes:
    """vLLM's ``/v1/models`` body with each model's ``root`` (its local path) set to its id; on
    a LoRA replica (``routes``) the stable adapter name in place of the versioned ones."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body  # not JSON (an error page): passed on as it is
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return json.dumps(doc).encode()
    if routes is not None:
        doc["data"] = public_cards(doc["data"], routes)
    for card in doc["data"]:
        if isinstance(card, dict) and "id" in card:
            card["root"] = card["id"]
    return json.dumps(doc).encode()


def _releaser(routes: AdapterRoutes | None, lease: Lease | None) -> Callable[[], None]:
    """A function that releases ``lease`` once, however often it is called."""
    done = [routes is None or lease is None]

    def release() -> None:
        if not done[0]:
            done[0] = True
            routes.release(lease)

    return release


def _no_slot() -> None:
    """The slot of a request that holds none (``/v1/models``)."""


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        try:
            first()
        finally:
            second()

    return both


def _closer(r: httpx.Response, release: Callable[[], None]):
    """Closes the upstream answer and runs ``release`` (idempotent) after a streamed reply, also
    when its body was never iterated."""

    async def close() -> None:
        try:
            await r.aclose()
        finally:
            release()

    return close


async def _relay(r: httpx.Response, release: Callable[[], None]):
    """The upstream body, chunk by chunk; ``release`` runs when it ends or is abandoned."""
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    finally:
        release()


def create_app(
    loop: SyncLoop,
    vllm_url: str,
    control_token: str | None,
    require_synced: bool = True,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    health_timeout_s: float = 5.0,
    busy_grace_s: float = 120.0,
    limits: GenerationLimits | None = None,
) -> FastAPI:
    """Build the front app (wrapped in ``PathGuard``).

    Args:
        loop: the replica's sync loop (status, readiness, manual polls).
        vllm_url: ``http://127.0.0.1:<port>`` of the internal vLLM server.
        control_token: bearer token of ``/control/*`` (None: refused).
        require_synced: 503 on ``/v1/*`` until a bucket version is applied.
        timeout_s: upstream timeout of proxied requests, seconds (``UPSTREAM_TIMEOUT_S``).
        api_key: bearer token the ``/v1`` routes require (None or empty: open, the local default).
        max_body_bytes: largest request body forwarded, bytes; larger ones get 413.
        health_timeout_s: seconds ``/health`` waits for vLLM's own ``/health`` (on a client of
            its own, so it never queues behind generation in the proxy's connection pool).
        busy_grace_s: a vLLM ``/health`` that times out while vLLM answered a proxied request
            within this many seconds is a busy engine, not a dead one: ``/health`` answers 200
            with ``"busy": true`` (a refused connection is always ``engine-down``).
        limits: the per-client caps of generation requests (``rollout.limits``); None: the
            defaults.

    Raises:
        ValueError: ``max_body_bytes`` is not positive.
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be > 0, found {max_body_bytes}")
    client: dict[str, httpx.AsyncClient] = {}
    limits = limits or GenerationLimits()
    gate = ConcurrencyGate(limits.max_concurrent)

    answered = {"at": None}  # monotonic time vLLM last answered a proxied request

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client["c"] = httpx.AsyncClient(base_url=vllm_url, timeout=timeout_s)
        yield
        await client["c"].aclose()
        if "h" in client:
            await client["h"].aclose()

    app = FastAPI(
        title="deltasync vLLM rollout replica",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(PathGuard, routes={**V1_ROUTES, **FRONT_ROUTES})

    def upstream() -> httpx.AsyncClient:
        if "c" not in client:  # used outside the lifespan (e.g. a TestClient without `with`)
            client["c"] = httpx.AsyncClient(base_url=vllm_url, timeout=timeout_s)
        return client["c"]

    def prober() -> httpx.AsyncClient:
        if "h" not in client:  # its own pool: a probe never waits behind generation
            client["h"] = httpx.AsyncClient(base_url=vllm_url, timeout=health_timeout_s)
        return client["h"]

    @app.get("/health")
    async def health() -> JSONResponse:
        busy = False
        try:
            ok = (await prober().get("/health")).status_code == 200
        except httpx.TimeoutException:  # alive but slow, if it still answers requests
            last = answered["at"]
            ok = busy = last is not None and time.monotonic() - last <= busy_grace_s
        except httpx.HTTPError:
            ok = False
        body = {
            "status": loop.status if ok else "engine-down",
            "held_version": loop.served_version,
            "newest_seen": loop.newest_seen,
            "ready": loop.ready and ok,
            "busy": busy,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/control/status")
    async def control_status(request: Request) -> JSONResponse:
        _check_token(request, control_token)
        return JSONResponse(loop.heartbeat().model_dump(mode="json"))

    @app.post("/control/sync")
    async def control_sync(request: Request) -> JSONResponse:
        _check_token(request, control_token)
        loop.wake()
        return JSONResponse({"woken": True, "held_version": loop.served_version})

    async def proxy(route: str, request: Request) -> Response:
        refusal = _api_key_refusal(request, api_key)
        if refusal is not None:
            return refusal
        if (require_synced and loop.served_version is None) or loop.dirty:
            why = "paused for a recovery" if loop.dirty else "has not applied a bucket version yet"
            return JSONResponse(
                {"error": f"replica {loop.replica_id} {why}; retry shortly"},
                status_code=503,
                headers={"Retry-After": "5"},
            )
        try:
            body = await _read_body(request, max_body_bytes)
        except _BodyTooLarge as e:
            return JSONResponse(
                {
                    "error": f"request body is at least {e.size} bytes; the limit is "
                    f"{max_body_bytes} bytes (MAX_BODY_BYTES); send a smaller request"
                },
                status_code=413,
                headers={"Connection": "close"},
            )
        leave = _no_slot
        if route in GENERATION_ROUTES:
            too_big = check_body(body, limits)
            if too_big is not None:
                return JSONResponse(too_big, status_code=400)
            who = (
                "api-key"
                if api_key
                else client_address(
                    request.headers,
                    request.client.host if request.client else None,
                    limits.forwarded_hops,
                )
            )
            slot = gate.enter(who)
            if slot is None:
                return JSONResponse(gate.refusal(), status_code=429, headers={"Retry-After": "1"})
            leave = slot
        try:
            return await _forward(route, request, body, leave)
        except BaseException:
            leave()
            raise

    async def _forward(
        route: str, request: Request, body: bytes, leave: Callable[[], None]
    ) -> Response:
        """Send the checked request upstream and relay the answer; ``leave`` ends its
        concurrency slot once the answer is relayed (or none came)."""
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS
        }
        served, routes, release = loop.served_version, loop.routes, _releaser(None, None)
        if routes is not None and route != "/v1/models":
            routed = route_body(body, routes)
            if routed.waiting:
                leave()
                return JSONResponse(
                    {"error": f"no version of adapter {routes.name!r} is loaded yet; retry"},
                    status_code=503,
                    headers={"Retry-After": "5"},
                )
            body, release = routed.body, _releaser(routes, routed.lease)
            served = routed.lease.version if routed.lease else None
        release = _both(release, leave)
        r = None
        try:
            # The URL is the allow-list constant `route`; nothing of the request's path or query.
            r = await _send_upstream(request.method, route, headers, body)
        finally:
            if not isinstance(r, httpx.Response):
                release()  # no upstream answer to stream: the lease ends here
        if isinstance(r, Response):
            return r
        out_headers = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}
        # The oldest bucket version that generated a token of this response: the one held when
        # the request arrived (an apply pauses generation and keeps requests in flight, so later
        # tokens may come from a newer version, never an older one).
        if served is not None:
            out_headers[VERSION_HEADER] = str(served)
        if route == "/v1/models":
            try:
                data = _public_models(await r.aread(), routes)
            finally:
                await r.aclose()
            for name in ("content-length", "content-encoding"):  # aread() decoded the body
                out_headers.pop(name, None)
            return Response(data, r.status_code, out_headers)
        return StreamingResponse(
            _relay(r, release),
            r.status_code,
            out_headers,
            background=BackgroundTask(_closer(r, release)),
        )

    async def _send_upstream(method: str, route: str, headers: dict, body: bytes):
        """Send to vLLM; a transport error (vLLM closed a pooled keep-alive connection as it was
        reused, or restarted) is retried once on a new connection, as no response byte came
        back; a second one is answered 502 with Retry-After instead of a 500 traceback."""
        for attempt in (1, 2):
            req = upstream().build_request(method, route, headers=headers, content=body)
            try:
                r = await upstream().send(req, stream=True)
                answered["at"] = time.monotonic()
                return r
            except httpx.TransportError as e:
                if attempt == 2:
                    log.warning("vLLM did not answer %s twice: %r", route, e)
                    return JSONResponse(
                        {
                            "error": f"the replica's engine did not answer ({type(e).__name__}); retry"
                        },
                        status_code=502,
                        headers={"Retry-After": "1"},
                    )

    def endpoint_for(route: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await proxy(route, request)

        return endpoint

    for route, methods in V1_ROUTES.items():
        app.add_api_route(
            route, endpoint_for(route), methods=sorted(methods), include_in_schema=False
        )

    return app
