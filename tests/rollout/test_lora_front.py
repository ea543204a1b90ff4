"""The public front of a LoRA replica (no vLLM; fast): a request for the stable adapter name is
sent upstream under the newest versioned name at arrival and stamped with that version; it holds
that version while its response streams (a newer version published meanwhile does not retire
it), and releases it when the stream ends or when the upstream never answered; requests for the
base model pass unchanged and unstamped; the stable name before any version is answered 503.
``GET /v1/models`` lists the base model and the stable name (once vLLM holds the version it routes
to), never the versioned names nor a local path.

The front runs under uvicorn on 127.0.0.1 in front of a fake upstream that streams its answer in
two chunks, the second only when the test says so, and lists its models as vLLM does."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import uvicorn

from rollout.lora import AdapterRoutes, Lease
from rollout.server import VERSION_HEADER, create_app

from .conftest import free_port

STAGE = "/tmp/deltasync-stage-1000/adapters/lora-front"  # where the replica writes adapters


def vllm_card(name: str, created: int) -> dict:
    """vLLM's ``/v1/models`` card of an adapter loaded at runtime (``lora_path`` as ``root``)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": f"{STAGE}/{name}",
        "parent": "tiny",
        "max_model_len": None,
        "permission": [{"id": f"modelperm-{created:032x}", "object": "model_permission"}],
    }


class Upstream(ThreadingHTTPServer):
    """Answers every POST with the ``model`` it received, in two chunks; the second waits for
    ``go`` to be set. ``GET /v1/models`` lists the base model and the adapters in ``loaded``
    ({name: created}), as vLLM does."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.models: list[str] = []
        self.go = threading.Event()
        self.loaded: dict[str, int] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name): /v1/models only
        base = {"id": "tiny", "object": "model", "root": "/home/owner/models/tiny", "parent": None}
        cards = [base, *(vllm_card(n, t) for n, t in self.server.loaded.items())]
        data = json.dumps({"object": "list", "data": cards}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.models.append(body["model"])
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for part in (b'{"model": ', json.dumps(body["model"]).encode() + b"}"):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
            self.server.go.wait(30)
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format, *args) -> None:
        pass


class Loop:
    """The parts of a LoRA replica's SyncLoop the front reads."""

    replica_id, newest_seen, dirty, status = "lora-front", 1, False, "ok"

    def __init__(self) -> None:
        self.routes = AdapterRoutes("policy")

    @property
    def served_version(self) -> int | None:
        current = self.routes.current
        return current.version if current else None

    @property
    def ready(self) -> bool:
        return self.served_version is not None

    def wake(self) -> None:
        pass


@pytest.fixture
def front():
    """Start a front for a ``Loop`` in front of ``upstream_url``; yields a starter."""
    servers = []

    def start(loop: Loop, upstream_url: str, require_synced: bool = True) -> str:
        port = free_port()
        app = create_app(loop, upstream_url, None, require_synced=require_synced)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    yield start
    for s in servers:
        s.should_exit = True


def completion(model: str) -> dict:
    return {"model": model, "prompt": "x", "max_tokens": 2}


def test_a_request_keeps_the_version_it_arrived_on(front):
    upstream = Upstream()
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    loop = Loop()
    loop.routes.publish("policy-v1", 1)
    url = front(loop, upstream.url)
    with httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=completion("policy")) as r:
            assert r.status_code == 200 and r.headers[VERSION_HEADER] == "1"
            assert upstream.models == ["policy-v1"]
            assert loop.routes.in_flight("policy-v1") == 1
            loop.routes.publish("policy-v2", 2)  # a new version while the answer streams
            assert loop.routes.take_idle() == []  # v1 is still in use
            upstream.go.set()
            assert json.loads(r.read()) == {"model": "policy-v1"}
        deadline = time.monotonic() + 5
        while loop.routes.in_flight("policy-v1") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.routes.in_flight("policy-v1") == 0
        r2 = c.post("/v1/completions", json=completion("policy"))
        assert r2.headers[VERSION_HEADER] == "2" and r2.json() == {"model": "policy-v2"}
        base = c.post("/v1/completions", json=completion("tiny"))  # the base model
        assert base.json() == {"model": "tiny"} and VERSION_HEADER.lower() not in base.headers
    assert loop.routes.take_idle() == ["policy-v1"]
    assert loop.routes.acquire("policy") == Lease("policy-v2", 2)
    upstream.shutdown()


def test_no_version_yet_is_503_and_a_failed_upstream_releases(front):
    loop = Loop()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    url = front(loop, dead, require_synced=False)
    with httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/completions", json=completion("policy"))
        assert r.status_code == 503 and "no version of adapter 'policy'" in r.json()["error"]
        loop.routes.publish("policy-v4", 4)
        r = c.post("/v1/completions", json=completion("policy"))
        assert r.status_code == 502
    assert loop.routes.in_flight("policy-v4") == 0


def test_models_lists_the_stable_name_not_the_versions(front):
    upstream = Upstream()
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    loop = Loop()
    upstream.loaded = {"other-v1": 5}  # an adapter that is not this replica's: kept
    url = front(loop, upstream.url, require_synced=False)
    with httpx.Client(base_url=url, timeout=30) as c:

        def models() -> tuple[list[dict], httpx.Response]:
            r = c.get("/v1/models")
            assert r.status_code == 200 and STAGE not in r.text and "/home/owner" not in r.text
            return r.json()["data"], r

        cards, _ = models()  # no version yet: nothing to route `policy` to
        assert [card["id"] for card in cards] == ["tiny", "other-v1"]
        upstream.loaded |= {"policy-v1": 10}
        loop.routes.publish("policy-v1", 1)
        cards, r = models()
        assert [card["id"] for card in cards] == ["tiny", "other-v1", "policy"]
        assert cards[2] == {**vllm_card("policy-v1", 10), "id": "policy", "root": "policy"}
        assert cards[2]["parent"] == "tiny" and r.headers[VERSION_HEADER] == "1"
        upstream.loaded |= {"policy-v2": 20, "policy-v3": 30}  # v3 loaded, not routed yet
        loop.routes.publish("policy-v2", 2)
        cards, r = models()
        assert [card["id"] for card in cards] == ["tiny", "other-v1", "policy"]
        assert cards[2]["created"] == 20 and r.headers[VERSION_HEADER] == "2"
        assert "policy-v" not in r.text
        del upstream.loaded["policy-v2"]  # vLLM lost the routed version: `policy` cannot answer
        assert [card["id"] for card in models()[0]] == ["tiny", "other-v1"]
    upstream.shutdown()
