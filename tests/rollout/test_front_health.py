"""A busy replica is not a dead one: the front's ``/health`` asks vLLM's own ``/health`` on a
client of its own, and when that times out while vLLM still answers generation requests (an
evaluation's load on 2 cores), it answers 200 with ``"busy": true`` instead of 503; an engine that
answers nothing, or refuses connections, is down. Real uvicorn front, a real HTTP upstream on
127.0.0.1 whose ``/health`` hangs on demand."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import uvicorn

from rollout.server import create_app
from trainer.local.ports import free_port


class SlowHealthUpstream(ThreadingHTTPServer):
    """Answers generation at once; ``/health`` waits until ``health_free`` is set."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.health_free = threading.Event()
        self.port = self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _handle(self):
        n = int(self.headers.get("content-length") or 0)
        if n:
            self.rfile.read(n)
        if self.path == "/health":
            self.server.health_free.wait(30)
        data = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _handle

    def log_message(self, format, *args):
        pass


class _Loop:
    replica_id, served_version, newest_seen, dirty, ready, status = "t", 3, 3, False, True, "ok"
    routes = None


@pytest.fixture
def front():
    started = []

    def start(upstream_port: int, grace: float = 60.0):
        port = free_port()
        app = create_app(
            _Loop(),
            f"http://127.0.0.1:{upstream_port}",
            control_token=None,
            health_timeout_s=0.3,
            busy_grace_s=grace,
        )
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        started.append(server)
        return f"http://127.0.0.1:{port}"

    yield start
    for server in started:
        server.should_exit = True


@pytest.fixture
def upstream():
    up = SlowHealthUpstream()
    threading.Thread(target=up.serve_forever, daemon=True).start()
    yield up
    up.health_free.set()
    up.shutdown()
    up.server_close()


def test_a_slow_health_probe_of_an_engine_that_still_answers_is_busy_not_down(front, upstream):
    url = front(upstream.port)
    before = httpx.get(f"{url}/health", timeout=10)
    assert before.status_code == 503 and before.json()["status"] == "engine-down"  # no answer yet
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
    busy = httpx.get(f"{url}/health", timeout=10)
    assert busy.status_code == 200
    assert busy.json() == {
        "status": "ok",
        "held_version": 3,
        "newest_seen": 3,
        "ready": True,
        "busy": True,
    }
    upstream.health_free.set()
    calm = httpx.get(f"{url}/health", timeout=10)
    assert calm.status_code == 200 and calm.json()["busy"] is False


def test_an_engine_silent_past_the_grace_is_down(front, upstream):
    url = front(upstream.port, grace=0.2)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
    time.sleep(0.3)  # the grace itself is what is tested: nothing answered for longer than it
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 503 and r.json()["ready"] is False


def test_a_refused_connection_is_down_whatever_answered_before(front, upstream):
    url = front(upstream.port)
    upstream.health_free.set()
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
    upstream.shutdown()
    upstream.server_close()
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "engine-down"
