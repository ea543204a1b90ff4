"""The local Hub's two origins, as FastAPI apps: the Hub (``/api/...``, resolvers, ``/admin``)
and the Xet CAS with the file bridge (another port, as the real CAS and bridge are other hosts).

The Hub app's gate (:class:`Gate`, plain ASGI) runs before every route: armed faults first
(``/admin`` excepted), then the rate limit of the request's class, then the route; every request
is logged to ``<root>/requests.jsonl`` with its token's name, class, status and bytes.

Admin routes (admin token): ``POST /admin/tokens`` ``{"user", "role", "scopes"}`` -> the new
token; ``POST /admin/tokens/{name}/revoke`` and ``/restore``; ``POST /admin/faults`` (see
:meth:`Accounts.add_fault`), ``DELETE /admin/faults``; ``GET /admin/requests?since=<unix s>``
(counts by token and class); ``POST /admin/settings`` (:class:`BucketSettings` fields and
``limits``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from .accounts import Accounts, classify, count_requests, rate_limit_headers
from .buckets import Buckets, BucketSettings, Signer, bridge_router, bucket_router
from .cas import CasStore, cas_router


@dataclasses.dataclass
class HubConfig:
    """Where the local Hub keeps its state and listens.

    ``space_env``: environment added to every Space it runs, standing in for hardware this
    machine lacks (e.g. vLLM's CPU settings for a GPU Space)."""

    root: Path
    host: str = "127.0.0.1"
    port: int = 8330
    cas_port: int = 8331
    user: str = "me"
    space_env: dict = dataclasses.field(default_factory=dict)

    @property
    def hub_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def cas_url(self) -> str:
        return f"http://{self.host}:{self.cas_port}"


class Gate:
    """ASGI middleware: faults, rate limits and the request log (see the module docstring)."""

    def __init__(self, app, accounts: Accounts, who=None):
        self.app = app
        self.accounts = accounts
        self.who = who  # the CAS origin's gate: names the token of a request; no faults, no limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        path = scope["path"]
        kind = classify(path) if self.who is None else "cas"
        seen = {"status": 0, "bytes": 0}
        start = time.monotonic()

        async def record(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            hub_route = self.who is None and not path.startswith("/admin")
            fault = self.accounts.fault_for(request) if hub_route else None
            if fault is not None:
                if fault["kind"] == "429":
                    limit = self.accounts.limits.get(kind or "api", 0)
                    wait = int(fault.get("retry_after_s", 2))
                    headers = rate_limit_headers(kind or "api", limit, wait)
                    return await JSONResponse({"error": "rate limited"}, 429, headers)(
                        scope, receive, record
                    )
                if fault["kind"] == "503":
                    return await JSONResponse({"error": "unavailable"}, 503)(scope, receive, record)
                if (
                    fault["kind"] == "drop"
                ):  # a response cut off mid-body, then the connection closed
                    await record(
                        {
                            "type": "http.response.start",
                            "status": 200,
                            "headers": [(b"content-length", b"1000")],
                        }
                    )
                    await record({"type": "http.response.body", "body": b"{", "more_body": True})
                    return
                await asyncio.sleep(float(fault.get("delay_s", 5)))  # slow
            if kind in ("api", "resolver"):
                headers = self.accounts.throttle(request, kind)
                if headers is not None:
                    body = {"error": f"You have exceeded the {kind} rate limit"}
                    return await JSONResponse(body, 429, headers)(scope, receive, record)
            await self.app(scope, receive, record)
        finally:
            who = self.who(request) if self.who is not None else None
            seconds = time.monotonic() - start
            self.accounts.log(request, seen["status"], kind, seconds, seen["bytes"], who)


def admin_router(accounts: Accounts, settings: BucketSettings) -> APIRouter:
    """The ``/admin`` routes (see the module docstring); each needs the admin token."""
    r = APIRouter(prefix="/admin")

    def admin(request: Request) -> None:
        token = accounts.token_of(request)
        if token is None or token.role != "admin":
            raise HTTPException(401 if token is None else 403, "expected the admin token")

    @r.post("/tokens")
    async def new_token(request: Request):
        admin(request)
        body = await request.json()
        try:
            t = accounts.add(
                body.get("user", "me"), body["role"], body.get("scopes"), body.get("name")
            )
        except (KeyError, ValueError) as e:
            raise HTTPException(422, f"expected {{user, role, scopes?, name?}}: {e}") from e
        return {"name": t.name, "value": t.value, "role": t.role, "scopes": t.scopes}

    @r.post("/tokens/{name}/{action}")
    def revoke(name: str, action: str, request: Request):
        admin(request)
        if action not in ("revoke", "restore"):
            raise HTTPException(404, "expected /revoke or /restore")
        try:
            t = accounts.set_revoked(name, action == "revoke")
        except KeyError as e:
            raise HTTPException(404, str(e)) from e
        return {"name": t.name, "revoked": t.revoked}

    @r.post("/faults")
    async def fault(request: Request):
        admin(request)
        try:
            return accounts.add_fault(await request.json())
        except ValueError as e:
            raise HTTPException(422, str(e)) from e

    @r.delete("/faults")
    def clear(request: Request):
        admin(request)
        accounts.faults.clear()
        return {"faults": 0}

    @r.get("/requests")
    def requests(request: Request, since: float = 0.0):
        admin(request)
        return count_requests(accounts.root / "requests.jsonl", since)

    @r.post("/settings")
    async def change(request: Request):
        admin(request)
        body = await request.json()
        accounts.limits.update(body.pop("limits", {}))
        for k, v in body.items():
            if not hasattr(settings, k):
                raise HTTPException(422, f"unknown setting {k!r}")
            setattr(settings, k, v)
        return {**dataclasses.asdict(settings), "limits": accounts.limits}

    return r


class LocalHub:
    """The state and the two apps of one local Hub process (see the module docstring)."""

    def __init__(self, cfg: HubConfig, with_spaces: bool = True):
        self.cfg = cfg
        self.with_spaces = with_spaces
        root = Path(cfg.root)
        self.accounts = Accounts(root, cfg.user)
        self.cas = CasStore(root / "cas")
        self.signer = Signer(root)
        self.settings = BucketSettings()
        self.buckets = Buckets(root, self.cas)
        self.spaces = None

    def hub_app(self) -> FastAPI:
        """The Hub origin: buckets, Spaces, admin, behind the :class:`Gate`."""
        app = FastAPI(title="local Hub", docs_url=None, redoc_url=None, openapi_url=None)
        c = self.cfg
        app.include_router(admin_router(self.accounts, self.settings))
        app.include_router(
            bucket_router(
                self.accounts, self.buckets, self.signer, self.settings, c.hub_url, c.cas_url
            )
        )
        if self.with_spaces:
            from .spaces import spaces_router

            self.spaces = spaces_router(
                self.accounts, Path(c.root) / "spaces", c.hub_url, c.space_env
            )
            app.include_router(self.spaces)
        app.add_middleware(Gate, accounts=self.accounts)
        return app

    def cas_app(self) -> FastAPI:
        """The CAS origin: the Xet CAS API and the file bridge."""
        app = FastAPI(title="local Xet CAS", docs_url=None, redoc_url=None, openapi_url=None)

        def authorize(token: str | None, write: bool) -> str | None:
            """Refuse a missing, forged, expired or (for a write) read-only Xet token; the
            namespace of the bucket it was issued for (the uploader of a shard's files)."""
            payload = self.signer.open(token) if token else None
            if payload is None:
                raise HTTPException(401, "expected a valid, unexpired Xet access token")
            if write and not payload["w"]:
                raise HTTPException(403, "this Xet token is read-only")
            return str(payload.get("b") or "").split("/")[0] or None

        app.include_router(cas_router(self.cas, authorize, lambda request: self.cfg.cas_url))
        app.include_router(bridge_router(self.cas, self.signer, self.settings))

        def who(request: Request) -> str | None:
            auth = request.headers.get("authorization", "")
            signed = (
                auth[7:] if auth.lower().startswith("bearer ") else request.query_params.get("sig")
            )
            payload = self.signer.open(signed) if signed else None
            return payload.get("n") if payload else None

        app.add_middleware(Gate, accounts=self.accounts, who=who)
        return app

    async def serve(self) -> None:
        """Serve both origins until cancelled (uvicorn, quiet: the request log is the file)."""
        import uvicorn

        servers = [
            uvicorn.Server(
                uvicorn.Config(
                    app,
                    host=self.cfg.host,
                    port=port,
                    log_level="warning",
                    access_log=False,
                    timeout_graceful_shutdown=2,
                )
            )
            for app, port in ((self.hub_app(), self.cfg.port), (self.cas_app(), self.cfg.cas_port))
        ]
        try:
            # Each uvicorn server installs its own SIGTERM/SIGINT handler and the last one wins:
            # when one server stops, stop the other too.
            tasks = [asyncio.ensure_future(s.serve()) for s in servers]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for s in servers:
                s.should_exit = True
            await asyncio.gather(*tasks)
        finally:
            stop = getattr(self.spaces, "stop_all", None)
            if stop is not None:
                stop()


def describe(cfg: HubConfig) -> str:
    """One line for the terminal: where the Hub is, and where its tokens are."""
    return (
        f"local Hub: {cfg.hub_url} (Xet CAS {cfg.cas_url}); state {cfg.root}; tokens in "
        f"{Path(cfg.root) / 'tokens.json'}; requests logged to {Path(cfg.root) / 'requests.jsonl'}"
    )


def tokens(root: Path) -> dict[str, str]:
    """``{name: value}`` of the tokens saved under ``root`` (for scripts and tests)."""
    return {t["name"]: t["value"] for t in json.loads((Path(root) / "tokens.json").read_text())}
