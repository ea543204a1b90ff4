"""The local Hub's Space front (tools/local_hub/space_front.py): a private Space answers raw HTTP
requests and a raw WebSocket handshake only with a token that may read it, as the Hub's proxy at
``https://<owner>-<name>.hf.space`` does; a public Space is open; the app's answers and frames
pass unchanged; ``X-HF-Authorization`` is taken off before the app, ``Authorization`` is not.

The front runs as the local Hub runs it (``python -m tools.local_hub.space_front``, the spec on
stdin) in front of a small ASGI app that echoes the headers it received.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tools.local_hub.accounts import Accounts
from tools.local_hub.process import REPO, free_port

pytest.importorskip("uvicorn")
websockets_sync = pytest.importorskip("websockets.sync.client")

APP = r"""
import json, os, uvicorn

async def app(scope, receive, send):
    headers = {k.decode(): v.decode() for k, v in scope.get("headers", [])}
    if scope["type"] == "http":
        body = json.dumps({"path": scope["path"], "headers": headers}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    elif scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": json.dumps(headers)})
        msg = await receive()
        await send({"type": "websocket.send", "text": "echo:" + (msg.get("text") or "")})
        await send({"type": "websocket.close"})

uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]), log_level="warning",
            lifespan="off")
"""


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """The Hub's accounts: alice (write, read, a bucket-only and a Space-scoped fine-grained
    token), bob (write)."""
    root = tmp_path_factory.mktemp("hub")
    accounts = Accounts(root, "alice")
    accounts.add("alice", "fine-grained", {"bucket:alice/run": "read"}, name="bucket-only")
    accounts.add("alice", "fine-grained", {"space:alice/app": "read"}, name="space-read")
    accounts.add("bob", "write", name="bob-write")
    return accounts


def start_front(tmp_path, accounts, private: bool):
    """(front process, public port) for Space alice/app."""
    app = tmp_path / "app.py"
    app.write_text(APP)
    port, app_port = free_port(), free_port()
    spec = {
        "argv": [sys.executable, str(app)],
        "cwd": str(tmp_path),
        "env": {**os.environ, "PORT": str(app_port)},
        "port": port,
        "app_port": app_port,
        "repo_id": "alice/app",
        "private": private,
        "tokens": str(accounts.root / "tokens.json"),
    }
    log = open(tmp_path / "front.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.local_hub.space_front"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    deadline = time.monotonic() + 30
    while True:  # up when the app answers through the front (any status)
        assert proc.poll() is None, (tmp_path / "front.log").read_text()
        try:
            status, _, _ = raw_get(port, "/health", {"Authorization": f"Bearer {tok(accounts)}"})
            if status != 503:
                return proc, port
        except OSError:
            pass
        assert time.monotonic() < deadline, (tmp_path / "front.log").read_text()
        time.sleep(0.2)


def tok(accounts: Accounts, name: str = "alice-read") -> str:
    return accounts.by_name(name).value


def raw(port: int, request: bytes) -> bytes:
    """Send ``request`` on a new connection; everything the front answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def raw_get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """A raw ``GET`` (keep-alive asked, as clients do): (status, headers, body)."""
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: keep-alive"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    answer = raw(port, ("\r\n".join(lines) + "\r\n\r\n").encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *hl = head.decode("latin-1").split("\r\n")
    got = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in hl)}
    return int(status_line.split(" ")[1]), got, body


def ws_handshake(port: int, headers: dict | None = None) -> bytes:
    """A raw WebSocket handshake to ``/ws``: the status line and headers of the answer."""
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [
        "GET /ws HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := s.recv(4096)):
            answer += chunk
    return answer


@pytest.fixture(scope="module")
def private_front(tmp_path_factory, tokens):
    proc, port = start_front(tmp_path_factory.mktemp("private"), tokens, private=True)
    yield port
    os.killpg(proc.pid, 15)
    proc.wait(20)


def test_a_private_space_answers_401_without_a_token_that_may_read_it(private_front, tokens):
    port = private_front
    status, headers, body = raw_get(port, "/health")
    assert status == 401 and "private" in json.loads(body)["error"]
    assert headers["connection"] == "close"
    status, headers, _ = raw_get(port, "/health", {"Authorization": "Bearer hf_not_a_token"})
    assert status == 401 and headers["x-error-message"].startswith("Invalid credentials")
    status, _, _ = raw_get(port, "/health", {"Authorization": "Basic YTpi"})
    assert status == 401
    # another user's token: the Hub hides another user's private Space
    status, headers, _ = raw_get(
        port, "/health", {"Authorization": f"Bearer {tok(tokens, 'bob-write')}"}
    )
    assert status == 404 and headers["x-error-code"] == "RepoNotFound"
    # the owner's fine-grained token scoped to a bucket only
    status, _, _ = raw_get(port, "/", {"Authorization": f"Bearer {tok(tokens, 'bucket-only')}"})
    assert status == 403


def test_the_owners_token_passes_and_reaches_the_app(private_front, tokens):
    port = private_front
    for name in ("alice-read", "alice-write", "space-read"):
        auth = f"Bearer {tok(tokens, name)}"
        status, _, body = raw_get(port, "/v1/models?x=1", {"Authorization": auth})
        assert status == 200, (name, body)
        seen = json.loads(body)
        assert seen["path"] == "/v1/models" and seen["headers"]["authorization"] == auth
    # X-HF-Authorization (gradio_client's header) is the Hub's: taken off before the app, which
    # gets its own Authorization (e.g. the Space's API key) unchanged
    status, _, body = raw_get(
        port,
        "/x",
        {"X-HF-Authorization": f"Bearer {tok(tokens)}", "Authorization": "Bearer app-key"},
    )
    seen = json.loads(body)["headers"]
    assert status == 200 and "x-hf-authorization" not in seen
    assert seen["authorization"] == "Bearer app-key"


def test_a_revoked_token_is_refused_at_once(private_front, tokens):
    tokens.add("alice", "read", name="soon-revoked")
    auth = {"Authorization": f"Bearer {tok(tokens, 'soon-revoked')}"}
    assert raw_get(private_front, "/", auth)[0] == 200
    tokens.set_revoked("soon-revoked", True)
    assert raw_get(private_front, "/", auth)[0] == 401


def test_a_websocket_handshake_needs_the_token_too(private_front, tokens):
    port = private_front
    assert ws_handshake(port).startswith(b"HTTP/1.1 401 ")
    bob = {"Authorization": f"Bearer {tok(tokens, 'bob-write')}"}
    assert ws_handshake(port, bob).startswith(b"HTTP/1.1 404 ")
    assert ws_handshake(port, {"Authorization": f"Bearer {tok(tokens)}"}).startswith(
        b"HTTP/1.1 101 "
    )
    # a whole session through the front, with the owner's token on the handshake
    url = f"ws://127.0.0.1:{port}/ws"
    with websockets_sync.connect(
        url, additional_headers={"X-HF-Authorization": f"Bearer {tok(tokens)}"}
    ) as ws:
        assert "x-hf-authorization" not in json.loads(ws.recv())
        ws.send("hello")
        assert ws.recv() == "echo:hello"
    with pytest.raises(Exception, match="401"):
        websockets_sync.connect(url).close()


def test_a_public_space_is_open_and_the_front_exits_with_its_app(tmp_path, tokens):
    proc, port = start_front(tmp_path, tokens, private=False)
    try:
        status, _, body = raw_get(port, "/open")
        assert status == 200 and json.loads(body)["path"] == "/open"
        assert ws_handshake(port).startswith(b"HTTP/1.1 101 ")
        app_pid = next(
            int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid
        )
        os.kill(app_pid, 9)  # the app dies: the front exits too (RUNTIME_ERROR at the Hub)
        assert proc.wait(20) == 128 + 9
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
