"""The public front when vLLM drops a connection: a request whose connection vLLM closed without an
answer (a keep-alive connection closed as it was reused, seen during a sync in `make train`) is
sent again once; if vLLM drops it again the caller gets 502 with Retry-After, never a 500."""

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from rollout.server import create_app
from trainer.local.ports import free_port


class DroppingUpstream:
    """An HTTP/1.1 server on 127.0.0.1 that reads each request and closes the connection without
    answering for the first ``drops`` requests, then answers 200."""

    def __init__(self, drops: int):
        self.drops = drops
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                body += conn.recv(65536)
            self.requests += 1
            if self.requests <= self.drops:
                return  # closed without a response byte
            out = json.dumps({"ok": True}).encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(out)}\r\nconnection: close\r\n\r\n".encode()
                + out
            )


class _Loop:
    replica_id, served_version, newest_seen, dirty, ready, status = "t", 1, 1, False, True, "ok"
    routes = None  # a full-weight replica


@pytest.fixture
def front():
    def start(drops: int):
        upstream = DroppingUpstream(drops)
        port = free_port()
        app = create_app(_Loop(), f"http://127.0.0.1:{upstream.port}", control_token=None)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        started.append((server, upstream))
        return f"http://127.0.0.1:{port}", upstream

    started = []
    yield start
    for server, upstream in started:
        server.should_exit = True
        upstream.sock.close()


def test_one_dropped_connection_is_retried(front):
    url, upstream = front(drops=1)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2]}, timeout=10)
    assert r.status_code == 200 and r.json() == {"ok": True}
    assert upstream.requests == 2


def test_twice_dropped_is_502_with_retry_after(front):
    url, upstream = front(drops=10)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2]}, timeout=10)
    assert r.status_code == 502 and r.headers["retry-after"] == "1"
    assert "did not answer" in r.json()["error"]
    assert upstream.requests == 2
