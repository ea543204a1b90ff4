"""The public front on the Space port (7860): generation API, health, token-guarded control.

Only these routes exist; vLLM's dev-mode routes (``/pause``, ``/collective_rpc``,
``/update_weights``, ...) live on the internal 127.0.0.1 port and are never proxied.

- ``/v1/*``: proxied to vLLM's OpenAI-compatible API (streaming included). While the replica has
  no verified bucket version yet (``require_synced``) or is paused for a recovery, answered 503.
- ``GET /health``: 200 with ``{"status", "held_version", "newest_seen", "ready"}`` while vLLM is
  healthy, else 503. Versions are not secrets.
- ``GET /control/status``: the full heartbeat (timings, errors). ``POST /control/sync``: poll now.
  Both need ``Authorization: Bearer <CONTROL_TOKEN>``; without a configured token they are refused.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from .sync_loop import SyncLoop

_HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}
_DROP_REQUEST_HEADERS = _HOP_HEADERS | {"authorization", "content-length"}


def _check_token(request: Request, token: str | None) -> None:
    if not token:
        raise HTTPException(403, "control routes are disabled: set the CONTROL_TOKEN secret")
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        raise HTTPException(
            401, "expected 'Authorization: Bearer <CONTROL_TOKEN>'", {"WWW-Authenticate": "Bearer"}
        )


def create_app(
    loop: SyncLoop,
    vllm_url: str,
    control_token: str | None,
    require_synced: bool = True,
    timeout_s: float = 3600.0,
) -> FastAPI:
    """Build the front app.

    Args:
        loop: the replica's sync loop (status, readiness, manual polls).
        vllm_url: ``http://127.0.0.1:<port>`` of the internal vLLM server.
        control_token: bearer token of ``/control/*`` (None: refused).
        require_synced: 503 on ``/v1/*`` until a bucket version is applied.
        timeout_s: upstream timeout of proxied requests, seconds.
    """
    client: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client["c"] = httpx.AsyncClient(base_url=vllm_url, timeout=timeout_s)
        yield
        await client["c"].aclose()

    app = FastAPI(title="deltasync vLLM rollout replica", lifespan=lifespan)

    def upstream() -> httpx.AsyncClient:
        if "c" not in client:  # used outside the lifespan (e.g. a TestClient without `with`)
            client["c"] = httpx.AsyncClient(base_url=vllm_url, timeout=timeout_s)
        return client["c"]

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            ok = (await upstream().get("/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            ok = False
        body = {
            "status": loop.status if ok else "engine-down",
            "held_version": loop.served_version,
            "newest_seen": loop.newest_seen,
            "ready": loop.ready and ok,
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

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def proxy(path: str, request: Request):
        if (require_synced and loop.served_version is None) or loop.dirty:
            why = "paused for a recovery" if loop.dirty else "has not applied a bucket version yet"
            return JSONResponse(
                {"error": f"replica {loop.replica_id} {why}; retry shortly"},
                status_code=503,
                headers={"Retry-After": "5"},
            )
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS
        }
        req = upstream().build_request(
            request.method,
            httpx.URL(path=f"/v1/{path}", query=request.url.query.encode()),
            headers=headers,
            content=await request.body(),
        )
        r = await upstream().send(req, stream=True)
        out_headers = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(
            r.aiter_raw(), r.status_code, out_headers, background=BackgroundTask(r.aclose)
        )

    return app
