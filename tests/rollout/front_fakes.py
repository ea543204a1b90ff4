"""Fakes of the front security tests (``test_front_security.py``): a fake vLLM upstream that
records every request (raw request-target as received) and lists its models as vLLM does, a sync
loop stand-in for a full-weight or a LoRA replica, a front served by uvicorn on 127.0.0.1, and raw
requests written over a plain socket (no client normalises ``..``, ``%2e`` or ``//``)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import uvicorn

from deltasync.status import ReplicaHeartbeat
from rollout.lora import AdapterRoutes

SECRET_ROOT = "/home/owner/private/models/tiny"
ADAPTER_ROOT = "/dev/shm/deltasync-stage-1000/adapters/front-test/policy-v1"  # vLLM's lora_path


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class FakeUpstream(ThreadingHTTPServer):
    """Records every request (raw request-target as received) and answers like vLLM would: a
    generation route with the path and the ``model`` it received, ``/v1/models`` with the base
    model and, for ``adapter="lora"``, the adapter ``policy-v1`` loaded at runtime."""

    daemon_threads = True

    def __init__(self, port: int, adapter: str | None = None) -> None:
        super().__init__(("127.0.0.1", port), _UpstreamHandler)
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        self.adapter = adapter

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
            cards = [{"id": "tiny", "object": "model", "root": SECRET_ROOT, "max_model_len": 9}]
            if server.adapter == "lora":  # vLLM lists each adapter loaded at runtime
                cards.append(
                    {"id": "policy-v1", "object": "model", "root": ADAPTER_ROOT, "parent": "tiny"}
                )
            out = {"object": "list", "data": cards}
        else:
            out = {"upstream_path": self.path, "model": json.loads(body or b"{}").get("model")}
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
    """The parts of SyncLoop the front reads: a replica that serves version 1; with
    ``adapter="lora"`` a LoRA replica whose ``policy`` is ``policy-v1``."""

    replica_id = "front-test"
    served_version = 1
    newest_seen = 1
    dirty = False
    ready = True
    status = "ok"

    def __init__(self, adapter: str | None = None) -> None:
        self.routes = None  # a full-weight replica
        if adapter == "lora":
            self.routes = AdapterRoutes("policy")
            self.routes.publish("policy-v1", 1)

    def wake(self) -> None:
        pass

    def heartbeat(self) -> ReplicaHeartbeat:
        return ReplicaHeartbeat(
            replica_id=self.replica_id,
            held_version=1,
            newest_seen=1,
            lag_versions=0,
            lag_s=0.0,
            status="ok",
            apply_path="reload" if self.routes is None else "lora",
        )


@dataclass
class Front:
    port: int
    upstream: FakeUpstream
    loop: FakeLoop
    servers: list = field(default_factory=list)

    def in_flight(self, timeout_s: float = 5.0) -> int:
        """Requests holding an adapter version (0 on a full-weight replica), once the front
        has released what finished answering (within ``timeout_s``)."""
        if self.loop.routes is None:
            return 0
        deadline = time.monotonic() + timeout_s
        while self.loop.routes.in_flight("policy-v1") and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.loop.routes.in_flight("policy-v1")


def serve_front(app, port: int, http: str) -> tuple[uvicorn.Server, threading.Thread]:
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
