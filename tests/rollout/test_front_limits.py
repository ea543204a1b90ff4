"""The front's per-client caps (``rollout.limits``), from raw HTTP requests against the real front
app under uvicorn, in front of an upstream that holds generation requests until released:

- ``n``/``best_of`` over ``MAX_N`` and ``max_tokens``/``max_completion_tokens`` over
  ``MAX_TOKENS`` are refused 400 before reaching vLLM, with a JSON error naming the cap and the
  variable that raises it; requests within the caps reach vLLM with their body unchanged;
- more than ``MAX_CONCURRENT_REQUESTS`` generation requests in flight from one client get 429
  (per client address taken from the right of X-Forwarded-For, so forged left-hand entries do not
  buy a new budget; per key when the replica has a ROLLOUT_API_KEY), and a finished request
  frees its slot;
- the defaults admit the trainer's own traffic; the new variables are read and checked.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.config import ConfigError, RolloutConfig
from rollout.limits import (
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_N,
    DEFAULT_MAX_TOKENS,
    GenerationLimits,
    client_address,
)
from rollout.server import create_app

from .conftest import free_port
from .front_fakes import FakeLoop, body_of, send, serve_front, status_of

KEY = "k-limits-1"


class HoldingUpstream(ThreadingHTTPServer):
    """vLLM stand-in: a generation request waits until ``release`` is set; records bodies."""

    daemon_threads = True

    def __init__(self, port: int) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.release = threading.Event()
        self.bodies: list[bytes] = []
        self.waiting = 0
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        with self.server.lock:
            self.server.bodies.append(body)
            self.server.waiting += 1
        self.server.release.wait(20)
        with self.server.lock:
            self.server.waiting -= 1
        data = b'{"choices": [{"text": "ok"}]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:
        pass


@pytest.fixture(scope="module")
def fronts():
    upstream = HoldingUpstream(free_port())
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    limits = GenerationLimits(max_concurrent=2, max_n=4, max_tokens=64, forwarded_hops=1)
    running, ports = [], {}
    for name, key in (("open", None), ("keyed", KEY)):
        app = create_app(FakeLoop(None), url, control_token="ctl", api_key=key, limits=limits)
        port = free_port()
        running.append(serve_front(app, port, "h11"))
        ports[name] = port
    yield upstream, ports
    upstream.release.set()
    for server, thread in running:
        server.should_exit = True
        thread.join(10)
    upstream.shutdown()


def post(port, doc, *headers, route=b"/v1/completions"):
    return send(port, "POST", route, json.dumps(doc).encode(), *headers)


def error_of(r: bytes) -> dict:
    return json.loads(body_of(r))


@pytest.mark.parametrize(
    "route, doc, cap, variable",
    [
        (b"/v1/completions", {"n": 5, "max_tokens": 8}, "max_n", "MAX_N"),
        (b"/v1/completions", {"best_of": 9, "max_tokens": 8}, "max_n", "MAX_N"),
        (b"/v1/completions", {"n": 1, "max_tokens": 65}, "max_tokens", "MAX_TOKENS"),
        (b"/v1/chat/completions", {"max_completion_tokens": 100}, "max_tokens", "MAX_TOKENS"),
        (b"/v1/chat/completions", {"max_tokens": 10**9}, "max_tokens", "MAX_TOKENS"),
    ],
)
def test_over_a_size_cap_is_400_naming_the_cap_and_never_reaches_vllm(
    fronts, route, doc, cap, variable
):
    upstream, ports = fronts
    upstream.release.set()
    before = len(upstream.bodies)
    r = post(ports["open"], {"model": "tiny", "prompt": "hi", **doc}, route=route)
    assert status_of(r) == 400, r[:300]
    err = error_of(r)
    assert err["cap"] == cap and err["variable"] == variable and variable in err["error"]
    assert err["limit"] == (4 if cap == "max_n" else 64)
    assert len(upstream.bodies) == before


def test_within_the_caps_reaches_vllm_unchanged(fronts):
    upstream, ports = fronts
    upstream.release.set()
    for doc in ({"prompt": "hi", "n": 4, "max_tokens": 64}, {"prompt": "no limit given"}):
        body = json.dumps(doc).encode()
        r = send(ports["open"], "POST", b"/v1/completions", body)
        assert status_of(r) == 200, r[:300]
        assert upstream.bodies[-1] == body


def _hold(upstream: HoldingUpstream, port: int, n: int, *headers: str):
    """Start ``n`` generation requests that the upstream holds; returns their futures once the
    upstream has them all."""
    upstream.release.clear()
    pool = ThreadPoolExecutor(n)
    start = upstream.waiting
    futures = [
        pool.submit(post, port, {"prompt": "x", "max_tokens": 8}, *headers) for _ in range(n)
    ]
    deadline = time.monotonic() + 10
    while upstream.waiting < start + n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream.waiting == start + n
    return pool, futures


def test_over_the_concurrency_cap_per_client_is_429(fronts):
    upstream, ports = fronts
    port = ports["open"]
    # the client is the right-most X-Forwarded-For entry: forged left-hand entries change nothing
    pool, held = _hold(upstream, port, 2, "X-Forwarded-For: forged-1, 10.0.0.1")
    try:
        r = post(port, {"prompt": "x"}, "X-Forwarded-For: forged-2, 10.0.0.1")
        assert status_of(r) == 429, r[:300]
        err = error_of(r)
        assert err["cap"] == "max_concurrent" and err["limit"] == 2
        assert err["variable"] == "MAX_CONCURRENT_REQUESTS"
        assert "MAX_CONCURRENT_REQUESTS" in err["error"] and b"retry-after: 1" in r.lower()
        # another client has a budget of its own
        other = ThreadPoolExecutor(1).submit(
            post, port, {"prompt": "y"}, "X-Forwarded-For: 10.0.0.2"
        )
        deadline = time.monotonic() + 10
        while upstream.waiting < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert upstream.waiting == 3
    finally:
        upstream.release.set()
    assert [status_of(f.result(15)) for f in held] == [200, 200]
    assert status_of(other.result(15)) == 200
    pool.shutdown()
    # the finished requests freed their slots
    assert status_of(post(port, {"prompt": "x"}, "X-Forwarded-For: 10.0.0.1")) == 200


def test_with_a_key_the_budget_is_the_keys(fronts):
    upstream, ports = fronts
    port = ports["keyed"]
    auth = f"Authorization: Bearer {KEY}"
    pool, held = _hold(upstream, port, 2, auth, "X-Forwarded-For: 10.0.0.7")
    try:
        r = post(port, {"prompt": "x"}, auth, "X-Forwarded-For: 10.0.0.8")
        assert status_of(r) == 429 and error_of(r)["cap"] == "max_concurrent"
        # no key: 401 before any cap is counted
        assert status_of(post(port, {"prompt": "x"})) == 401
    finally:
        upstream.release.set()
    assert [status_of(f.result(15)) for f in held] == [200, 200]
    pool.shutdown()


class _Headers(dict):
    def getlist(self, name):
        v = self.get(name)
        return [] if v is None else [v]


@pytest.mark.parametrize(
    "xff, hops, expected",
    [
        (None, 1, "peer"),
        ("a, b, c", 1, "c"),
        ("a, b, c", 2, "b"),
        ("a", 2, "peer"),  # fewer entries than trusted proxies: the header is not trusted
        ("a, b", 0, "peer"),  # FORWARDED_HOPS=0: the header is ignored
    ],
)
def test_client_address(xff, hops, expected):
    headers = _Headers({} if xff is None else {"x-forwarded-for": xff})
    assert client_address(headers, "peer", hops) == expected


def test_defaults_admit_the_trainers_own_traffic():
    from trainer.settings import GRPOSettings

    g = GRPOSettings()
    assert g.max_completion_length <= DEFAULT_MAX_TOKENS
    assert DEFAULT_MAX_N >= 1  # TRL's rollout worker and the held-out games send n=1
    # the episodes in flight plus the held-out games' 64 workers
    assert (g.max_inflight_tasks or g.per_device_train_batch_size) + 64 <= DEFAULT_MAX_CONCURRENT


def test_the_variables_are_read_and_checked():
    env = {"BUCKET": "file:///tmp/b", "MODEL": "m"}
    cfg = RolloutConfig.from_env(env)
    assert cfg.upstream_timeout_s == 600.0 and cfg.limits == GenerationLimits()
    cfg = RolloutConfig.from_env(
        {
            **env,
            "MAX_CONCURRENT_REQUESTS": "8",
            "MAX_N": "2",
            "MAX_TOKENS": "256",
            "UPSTREAM_TIMEOUT_S": "90",
            "FORWARDED_HOPS": "0",
        }
    )
    assert cfg.limits == GenerationLimits(8, 2, 256, 0) and cfg.upstream_timeout_s == 90.0
    for var, bad in (
        ("MAX_N", "0"),
        ("MAX_TOKENS", "-1"),
        ("MAX_CONCURRENT_REQUESTS", "0"),
        ("FORWARDED_HOPS", "-1"),
        ("UPSTREAM_TIMEOUT_S", "0"),
    ):
        with pytest.raises(ConfigError, match=var):
            RolloutConfig.from_env({**env, var: bad})
