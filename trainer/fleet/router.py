"""The one server TRL's rollout worker talks to: an HTTP proxy on 127.0.0.1 inside the trainer
process that sends each ``/v1`` request to one replica of a ``trainer.fleet.pool.ReplicaPool`` (the
serving one with the fewest requests in flight; a later turn of an episode goes to the replica of
its previous turn, see ``trainer.fleet.affinity``) and, when that replica fails (connection refused
or reset, timeout, 503 while it re-anchors), sends the same request to another, so no request is
lost while any replica serves. With none serving, requests wait (one log line about every 10 s
naming each replica and its state) and go on when one returns; after ``wait_s`` they get 503 with
what to check. A 5xx other than 503 that every replica gives is the request's fault: it is handed
back instead of waited on.

The router adds the run's credentials toward each replica (``ReplicaPool.headers_for``), so it
must not serve every local process: each ``/v1`` request must carry ``Authorization: Bearer
<key>``, a key made for this run (:attr:`FleetRouter.key`, ``secrets.token_urlsafe``) and handed
only to TRL's rollout worker (``trainer.loop.trl_compat.send_request_headers``) and the
evaluations (``EvalRequest.headers``); without it the answer is 401 and nothing is forwarded.
``/health`` (the replicas' states and URLs, no credential) stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass

from trainer.fleet.affinity import EpisodeAffinity
from trainer.fleet.pool import ReplicaPool

log = logging.getLogger("trainer.fleet")

VERSION_HEADER = "X-Deltasync-Version"  # set by the replica's front (rollout.server)
REPLICA_HEADER = "X-Deltasync-Replica"  # set here: which replica answered
# Seconds the router keeps an idle client connection open: longer than its clients keep one to
# reuse (aiohttp, TRL's rollout worker: 15 s; httpx, the evaluation: 5 s). At uvicorn's default
# (5 s) the router closed connections TRL's worker then reused while a training step held its
# queue full: "Connection reset by peer" and a 1 s retry, 11 times in a 30-step run.
KEEP_ALIVE_S = 30
_HOP_HEADERS = {
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "content-length",
    "content-encoding",
    "authorization",
}


@dataclass
class _Answer:
    """A replica's answer, read whole: status, headers (case as sent), body bytes."""

    status_code: int
    headers: list[tuple[str, str]]
    content: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


class FleetRouter:
    """The single server TRL sees: ``/v1/*`` spread over ``pool`` with retries; ``/health``.

    Args:
        pool: the replicas (started by the caller).
        wait_s: how long a request waits while no replica serves before it gets 503.
        request_timeout_s: per attempt; a replica that takes longer is marked down and the
            request goes to another.
        log_every_s: seconds between the "waiting for a replica" lines.
        key: the bearer key every ``/v1`` request must carry (None: a new one,
            ``secrets.token_urlsafe(32)``); clients send :attr:`headers`. Never logged.
    """

    def __init__(
        self,
        pool: ReplicaPool,
        wait_s: float = 900.0,
        request_timeout_s: float = 300.0,
        log_every_s: float = 10.0,
        key: str | None = None,
    ):
        self.pool = pool
        self._key = key or secrets.token_urlsafe(32)
        self.wait_s = wait_s
        self.request_timeout_s = request_timeout_s
        self.log_every_s = log_every_s
        self._waiting_logged = float(
            "-inf"
        )  # when the last "waiting for a replica" line was logged
        self.max_request_s = 0.0  # the longest request answered: generation, retries and waits
        self._server = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        self.affinity = EpisodeAffinity()

    @property
    def headers(self) -> dict[str, str]:
        """The header a client of this router sends: ``Authorization: Bearer <key>``."""
        return {"Authorization": f"Bearer {self._key}"}

    def _authorized(self, authorization: str | None) -> bool:
        """Whether a request's ``Authorization`` header carries this run's key (compared in
        constant time)."""
        expected = self.headers["Authorization"].encode()
        return hmac.compare_digest((authorization or "").encode(), expected)

    def _remember_turn(
        self, prompt: list[int], resp: _Answer, url: str, version: int | None
    ) -> None:
        """After an answer: remember its replica (for the episode's next turn) and the version
        that generated it (for the sample's staleness)."""
        try:
            choices = json.loads(resp.content).get("choices") or []
        except (ValueError, AttributeError):  # not a JSON object: the answer goes back as it is
            return
        if len(choices) == 1 and isinstance(choices[0].get("token_ids"), list):
            self.affinity.remember(prompt, choices[0]["token_ids"], url, version)

    def app(self):
        """The ASGI app (Starlette)."""
        import aiohttp
        from starlette.applications import Starlette
        from starlette.requests import ClientDisconnect, Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        sessions: dict[str, aiohttp.ClientSession] = {}

        def http(url: str) -> aiohttp.ClientSession:
            """One aiohttp session (connection pool) per replica, made on the server's event
            loop. httpx's pool did work per request that grows with its open connections: with
            TRL's 64 episodes in flight the router took 0.9 of a core of the trainer process
            (py-spy: ``is_idle`` and ``is_socket_readable`` over every connection) and held the
            GIL the training step needs (docs/BENCHMARKS.md section 6 (the main job))."""
            if url not in sessions:
                sessions[url] = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, connect=5.0),
                    # as many connections as requests in flight; an idle one is closed after
                    # 2 s, before the replica's server closes its end (uvicorn: 5 s): reusing a
                    # connection the server just closed failed a request (ClientOSError) and
                    # marked a healthy replica down for 3 s in a make train run
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                    auto_decompress=False,  # bytes pass through as the replica sent them
                    skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                )
            return sessions[url]

        async def forward(r_url: str, request: Request, path: str, body: bytes, headers: dict):
            async with http(r_url).request(
                request.method,
                r_url + path,
                data=body,
                headers=headers,
                params=list(request.query_params.multi_items()),
                allow_redirects=False,
            ) as resp:
                content = await resp.read()
                return _Answer(resp.status, list(resp.headers.items()), content)

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            yield
            for session in sessions.values():  # closed on the loop that made them
                await session.close()
            sessions.clear()

        async def health(request: Request) -> Response:
            serving = any(r["state"] == "serving" for r in self.pool.replica_rows())
            return JSONResponse(
                {"status": "ok" if serving else "waiting", "replicas": self.pool.replica_rows()},
                status_code=200 if serving else 503,
            )

        async def proxy(request: Request) -> Response:
            if not self._authorized(request.headers.get("authorization")):
                return JSONResponse(
                    {
                        "error": "expected 'Authorization: Bearer <key>' with this run's router "
                        "key, found "
                        + ("another key" if request.headers.get("authorization") else "none")
                        + ": the trainer hands its key to TRL's rollout worker and its "
                        "evaluations only; other processes cannot use the run's replicas"
                    },
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            try:
                body = await request.body()
            except ClientDisconnect:  # the client went away mid-request: nothing to forward
                log.info("a client disconnected before its request arrived: %s", request.url.path)
                return Response(status_code=400)
            path = request.url.path
            prompt = _token_prompt(path, body)
            prefer = self.affinity.replica_for(prompt) if prompt else None
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
            t0 = time.monotonic()
            tried: set[str] = set()
            answered: _Answer | None = None  # a 5xx other than 503 from a live replica
            while True:
                r = self.pool.acquire(tried, prefer)
                if r is None and answered is not None:
                    # Every serving replica answered this request with a server error: it is
                    # the request, not the fleet. Hand the last answer back instead of waiting.
                    return _response(answered, None)
                if r is None:
                    waited = time.monotonic() - t0
                    if waited > self.wait_s:
                        msg = (
                            f"no rollout replica served for {waited:.0f}s: {self.pool.describe()}"
                            ". Check that the rollout replicas run and follow this bucket "
                            "(their /health, their heartbeats in the bucket) and VLLM_URL."
                        )
                        log.error(msg)
                        return JSONResponse({"error": msg}, status_code=503)
                    # one line per log_every_s for the router, not one per waiting request
                    if (
                        waited >= self.log_every_s
                        and time.monotonic() - self._waiting_logged >= self.log_every_s
                    ):
                        self._waiting_logged = time.monotonic()
                        log.warning(
                            "waiting %.0fs for a rollout replica: %s", waited, self.pool.describe()
                        )
                    await asyncio.to_thread(self.pool.wait_change, 0.5)
                    tried.clear()  # every replica may be tried again once one changes
                    continue
                try:
                    resp = await forward(
                        r.url, request, path, body, {**headers, **self.pool.headers_for(r.url)}
                    )
                except (aiohttp.ClientError, TimeoutError) as e:  # refused, reset, timed out
                    timed_out = isinstance(e, TimeoutError | aiohttp.ServerTimeoutError)
                    self.pool.release(r, f"{type(e).__name__} on {path}", timed_out=timed_out)
                    tried.add(r.url)
                    continue
                tried.add(r.url)
                if resp.status_code == 503:  # re-anchoring, restarting: down until healthy
                    self.pool.release(r, f"{path} answered 503")
                    continue
                if resp.status_code >= 500:
                    self.pool.release(r, None, count_failure=True)
                    answered = resp
                    continue
                header = resp.header(VERSION_HEADER)
                version = int(header) if header and header.isdigit() else None
                self.pool.release(r, None, version)
                if prompt and resp.status_code == 200:
                    self._remember_turn(prompt, resp, r.url, version)
                    self.affinity.hits += prefer == r.url
                self.max_request_s = max(self.max_request_s, time.monotonic() - t0)
                return _response(resp, r.replica_id)

        return Starlette(
            routes=[
                Route("/health", health, methods=["GET"]),
                Route("/v1/{rest:path}", proxy, methods=["GET", "POST"]),
            ],
            lifespan=lifespan,
        )

    def start(self, port: int) -> str:
        """Serve on ``127.0.0.1:port`` in a daemon thread; returns the base URL."""
        import uvicorn

        config = uvicorn.Config(
            self.app(),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="fleet-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the fleet router did not start on 127.0.0.1:{port}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


def _token_prompt(path: str, body: bytes) -> list[int] | None:
    """The token-id prompt of a ``/v1/completions`` request (what TRL's rollout worker sends),
    else None."""
    if path != "/v1/completions" or not body:
        return None
    try:
        prompt = json.loads(body).get("prompt")
    except (ValueError, AttributeError):  # not a JSON object: the replica answers it
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


def _response(resp: _Answer, replica_id: str | None):
    """A replica's answer as the router's (hop-by-hop headers dropped, the replica named)."""
    from starlette.responses import Response

    out = {k: v for k, v in resp.headers if k.lower() not in _HOP_HEADERS}
    if replica_id is not None:
        out[REPLICA_HEADER] = replica_id
    return Response(resp.content, resp.status_code, out)
