"""Every public surface of the Wordle server, from raw clients (websockets, a plain socket).

Covers: absurd reset seeds (huge, float, string, negative, nested, bool) get a clear error and
the session goes on; normal client disconnects log no ERROR; MCP (HTTP and WebSocket) is 404
unless ``WORDLE_ENABLE_MCP=1``; the shared web UI is off by default, and when turned on its
``/ws/ui`` is capped and idle-expired. What the trainer needs (``/ws``, ``/health``) works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.wordle.conftest import ServerProcess, start_server, stop_server
from wordle_env.client import WordleEnv

pytestmark = pytest.mark.slow

UI_CAP = 2
UI_IDLE_S = 2.0


@pytest.fixture(scope="module")
def info_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server with its default settings, logging at INFO (to read what it logs)."""
    server = start_server(
        tmp_path_factory.mktemp("wordle_info") / "server.log",
        WORDLE_LOG_LEVEL="info",
        WORDLE_ENABLE_WEB="",
        ENABLE_WEB_INTERFACE="",
        WORDLE_ENABLE_MCP="",
    )
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def web_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The web UI turned on, with a small ``/ws/ui`` cap and a short idle timeout."""
    server = start_server(
        tmp_path_factory.mktemp("wordle_web") / "server.log",
        WORDLE_ENABLE_WEB="1",
        WORDLE_MAX_UI_CONNECTIONS=str(UI_CAP),
        WORDLE_IDLE_TIMEOUT_S=str(UI_IDLE_S),
    )
    try:
        yield server
    finally:
        stop_server(server)


def _raw_http(url: str, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request over a plain socket (no client-side path handling); (status, body)."""
    parsed = urlparse(url)
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {parsed.hostname}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    data = b"".join(chunks)
    status = int(data.split(b"\r\n", 1)[0].split()[1])
    return status, data.partition(b"\r\n\r\n")[2]


def _send(ws: ClientConnection, frame: str) -> dict[str, Any]:
    ws.send(frame)
    return json.loads(ws.recv(timeout=30))


def _reset_and_play(ws: ClientConnection) -> None:
    """A normal reset + step still works on this session."""
    answer = _send(ws, json.dumps({"type": "reset", "data": {"seed": 7}}))
    assert answer["type"] == "observation", answer
    answer = _send(ws, json.dumps({"type": "step", "data": {"message": "[crane]"}}))
    assert answer["type"] == "observation" and len(answer["data"]["observation"]["guesses"]) == 1


ABSURD_SEEDS = [
    ("5001-digit-int", "1" * 5001, ("INVALID_JSON",), "digits"),
    ("4000-digit-int", "9" * 4000, ("EXECUTION_ERROR",), "seed must be an integer"),
    ("2-pow-64", str(2**64), ("EXECUTION_ERROR",), "seed must be an integer"),
    ("negative", "-1", ("EXECUTION_ERROR",), "seed must be an integer"),
    ("float", "7.5", ("EXECUTION_ERROR",), "seed must be an integer"),
    ("float-integral", "7.0", ("EXECUTION_ERROR",), "seed must be an integer"),
    ("huge-float", "1e308", ("EXECUTION_ERROR",), "seed must be an integer"),
    ("nan", "NaN", ("EXECUTION_ERROR", "INVALID_JSON"), ""),
    ("string", '"7"', ("EXECUTION_ERROR",), "seed must be an integer"),
    ("nested", '{"a": [1, {"b": 2}]}', ("EXECUTION_ERROR",), "seed must be an integer"),
    ("list", "[7]", ("EXECUTION_ERROR",), "seed must be an integer"),
    ("bool", "true", ("EXECUTION_ERROR",), "seed must be an integer"),
]


@pytest.mark.parametrize(
    ("raw_seed", "codes", "says"),
    [c[1:] for c in ABSURD_SEEDS],
    ids=[c[0] for c in ABSURD_SEEDS],
)
def test_absurd_seed_gets_a_clear_error_and_the_session_goes_on(
    info_server: ServerProcess, raw_seed: str, codes: tuple[str, ...], says: str
) -> None:
    with connect(info_server.ws_url, max_size=None) as ws:
        answer = _send(ws, '{"type": "reset", "data": {"seed": ' + raw_seed + "}}")
        assert answer["type"] == "error" and answer["data"]["code"] in codes, answer
        message = answer["data"]["message"]
        assert says in message and len(message) < 1000
        _reset_and_play(ws)


def test_absurd_seed_over_http_is_a_client_error(info_server: ServerProcess) -> None:
    for raw_seed in ("1" * 5001, "-5", "1.5", '"x"'):
        status, body = _raw_http(
            info_server.url, "POST", "/reset", b'{"seed": ' + raw_seed.encode() + b"}"
        )
        assert 400 <= status < 500, (raw_seed[:20], status, body[:300])
    assert _raw_http(info_server.url, "GET", "/health")[0] == 200


def test_normal_disconnects_log_no_error(info_server: ServerProcess) -> None:
    async def clients() -> None:
        for seed in range(3):  # the deltasync client: sends "close", then hangs up
            async with WordleEnv(base_url=info_server.url) as env:
                await env.reset(seed=seed)
                await env.step("[crane]")

    asyncio.run(asyncio.wait_for(clients(), timeout=60))
    for _ in range(3):  # a close frame right after a "close" message, and a bare close
        with connect(info_server.ws_url) as ws:
            ws.send(json.dumps({"type": "close"}))
        with connect(info_server.ws_url) as ws:
            _reset_and_play(ws)
    with connect(info_server.ws_url) as ws:  # a client that drops the TCP connection
        _reset_and_play(ws)
        ws.socket.shutdown(socket.SHUT_RDWR)
    time.sleep(1.0)
    assert _raw_http(info_server.url, "GET", "/health")[0] == 200
    log = info_server.log_tail(200_000)
    assert "ERROR" not in log and "Traceback" not in log, log[-4000:]
    left = [ln for ln in log.splitlines() if "left before the server closed" in ln]
    assert len(left) <= 7  # at most one INFO line per disconnect


@pytest.mark.parametrize("method", ["POST", "GET"])
@pytest.mark.parametrize("path", ["/mcp", "/mcp/", "//mcp", "/mcp/tools"])
def test_mcp_over_http_is_404(info_server: ServerProcess, method: str, path: str) -> None:
    body = json.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create", "params": {}}
    ).encode()
    status, answer = _raw_http(info_server.url, method, path, body)
    assert status == 404, (status, answer[:300])
    if path == "/mcp":
        assert b"WORDLE_ENABLE_MCP" in answer


def test_mcp_websocket_is_refused(info_server: ServerProcess) -> None:
    url = info_server.url.replace("http://", "ws://") + "/mcp"
    with pytest.raises(InvalidStatus) as info:
        with connect(url):
            pass
    assert info.value.response.status_code == 404
    with connect(info_server.ws_url) as ws:  # the trainer's endpoint is unaffected
        _reset_and_play(ws)


def test_web_ui_is_off_by_default(info_server: ServerProcess) -> None:
    assert _raw_http(info_server.url, "GET", "/web/")[0] == 404
    assert _raw_http(info_server.url, "GET", "/web")[0] == 404
    status, body = _raw_http(info_server.url, "GET", "/")
    assert status == 200 and json.loads(body)["sessions"].startswith("WebSocket /ws")
    url = info_server.url.replace("http://", "ws://") + "/ws/ui"
    with pytest.raises((InvalidStatus, ConnectionClosed)):
        with connect(url) as ws:
            ws.recv(timeout=5)


def test_web_ui_websocket_is_capped_and_idle_expired(web_server: ServerProcess) -> None:
    status, page = _raw_http(web_server.url, "GET", "/web/")
    assert status == 200 and b"<html" in page.lower()
    url = web_server.url.replace("http://", "ws://") + "/ws/ui"
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(connect(url)) for _ in range(UI_CAP)]
        with pytest.raises(InvalidStatus) as info:
            with connect(url):
                pass
        assert info.value.response.status_code == 403
        assert b"WORDLE_MAX_UI_CONNECTIONS" in info.value.response.body
        # Silent clients are closed after the idle timeout, which frees their slots.
        started = time.monotonic()
        for ws in held:
            with pytest.raises(ConnectionClosed):
                while True:
                    ws.recv(timeout=UI_IDLE_S * 5)
        assert time.monotonic() - started < UI_IDLE_S * 5
    with connect(url) as ws:  # a slot is free again
        ws.send("ping")
    with connect(web_server.ws_url) as ws:
        _reset_and_play(ws)
