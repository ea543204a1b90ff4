"""The front of one local Space: what ``https://<owner>-<name>.hf.space`` is on the Hub.

The local Hub runs a Space as ``python -m tools.local_hub.space_front`` (this module), which
starts the Space's own command as its child and listens on the Space's public port (the one the
runtime's ``domains`` report): every HTTP request and WebSocket handshake to a private Space is
checked there, as the Hub's proxy checks the visitor's token, then passed to the app's port. The
token is read from ``X-HF-Authorization: Bearer <token>`` when sent (what gradio_client sends,
and what leaves ``Authorization`` to the app's own key), else from ``Authorization: Bearer
<token>``. As the Hub's proxy does (huggingface/hf-mcp-server#249), ``X-HF-Authorization`` is
removed before the app, ``Authorization`` is passed on unchanged. A public Space is open.

For a private Space (the answers the local Hub's API gives for the same token, ``spaces.py``):

- no token, an unknown or a revoked one: 401 (``X-Error-Message: Invalid credentials in
  Authorization header`` for a token it does not know);
- a token of the owner without read access to the Space (a fine-grained token scoped to other
  resources): 403;
- another user's token: 404, as the Hub hides another user's private repository.

Tokens are read from the Hub's ``tokens.json`` (re-read when it changes: a revoked token is
refused at once). The app's answers are passed back byte for byte; each proxied HTTP request
gets a connection of its own to the app (``Connection: close`` there), so every request is
checked; a WebSocket is passed through both ways once its handshake was allowed.

It runs in the Space's process group (the Hub stops both with one signal), outlives the Hub
process like the Space itself (a Hub crash does not take Spaces down), and exits with the app's
exit status when the app exits. The spec comes on stdin as JSON (it holds the Space's secrets,
so never on a command line): ``{argv, cwd, env, port, app_port, repo_id, private, tokens}``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

MAX_HEAD = 64 * 1024  # the largest request head accepted
CHUNK = 64 * 1024
APP_STOP_S = 9.0  # how long a stopping front waits for the app (the runner SIGKILLs after 10 s)


class TokenFile:
    """The Hub's tokens (``tokens.json``, as ``accounts.Accounts`` writes it), re-read when the
    file changes."""

    def __init__(self, path: Path | None):
        self.path = None if path is None else Path(path)
        self._seen: tuple | None = None
        self._tokens: dict[str, dict] = {}

    def get(self, value: str) -> dict | None:
        """The token whose value is ``value`` (None when unknown)."""
        if self.path is None:
            return None
        try:
            st = self.path.stat()
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen != self._seen:
                self._tokens = {t["value"]: t for t in json.loads(self.path.read_text())}
                self._seen = seen
        except (OSError, ValueError):
            pass  # the last good copy (the Hub replaces the file atomically)
        return self._tokens.get(value)


def check(tokens: TokenFile, repo_id: str, private: bool, authorization: str | None):
    """None when the request may reach the Space, else ``(status, message, headers)``."""
    if not private:
        return None
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return 401, "Unauthorized: this Space is private; send 'Authorization: Bearer <token>'", {}
    token = tokens.get(value.strip())
    if token is None or token.get("revoked"):
        msg = "Invalid credentials in Authorization header"
        return 401, msg, {"X-Error-Message": msg}
    from .accounts import Token

    owner = repo_id.split("/")[0]
    t = Token(**token)
    if t.user != owner and t.role != "admin":
        msg = "Repository not found"
        return 404, msg, {"X-Error-Code": "RepoNotFound", "X-Error-Message": msg}
    if not t.allows(False, f"space:{repo_id}"):
        msg = f"This token ({t.role}) has no read access to space:{repo_id}"
        return 403, msg, {"X-Error-Message": msg}
    return None


def response(status: int, message: str, headers: dict | None = None) -> bytes:
    """A complete HTTP/1.1 answer with a JSON ``{"error": message}`` body; the connection
    closes after it."""
    reason = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 400: "Bad Request"}.get(
        status, "Service Unavailable" if status == 503 else "Error"
    )
    body = json.dumps({"error": message}).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if status == 401:
        lines.append('WWW-Authenticate: Bearer realm="local Hub Space"')
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    """(request line, headers) of a request head ending in an empty line.

    Raises:
        ValueError: not an HTTP/1.x request head.
    """
    lines = head.decode("latin-1").split("\r\n")
    request_line, headers = lines[0], []
    if len(request_line.split(" ")) != 3 or not request_line.split(" ")[2].startswith("HTTP/1."):
        raise ValueError(f"expected an HTTP/1.x request line, found {request_line[:80]!r}")
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip() or name != name.strip():
            raise ValueError("expected 'Name: value' header lines")
        headers.append((name, value.strip()))
    return request_line, headers


def rewrite_for_app(request_line: str, headers: list[tuple[str, str]], upgrade: bool) -> bytes:
    """The head sent to the app: without ``X-HF-Authorization``, and but for a WebSocket
    handshake with ``Connection: close`` (one request per connection, each checked here)."""
    headers = [(k, v) for k, v in headers if k.lower() != "x-hf-authorization"]
    if not upgrade:
        hop = {"connection", "keep-alive", "proxy-connection"}
        headers = [(k, v) for k, v in headers if k.lower() not in hop] + [("Connection", "close")]
    lines = [request_line, *(f"{k}: {v}" for k, v in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass


def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (ConnectionError, OSError, RuntimeError):
        pass


class Front:
    """The front's listener (see the module docstring)."""

    def __init__(self, repo_id: str, private: bool, tokens: TokenFile, app_port: int):
        self.repo_id, self.private, self.tokens, self.app_port = repo_id, private, tokens, app_port

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        app_writer = None
        try:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, headers = parse_head(head)
            except asyncio.IncompleteReadError:
                return  # closed before a request
            except (asyncio.LimitOverrunError, ValueError) as e:
                writer.write(response(400, f"malformed request head: {e}"))
                await writer.drain()
                return
            found = {k.lower(): v for k, v in headers}
            token = found.get("x-hf-authorization") or found.get("authorization")
            refused = check(self.tokens, self.repo_id, self.private, token)
            if refused is not None:
                status, message, extra = refused
                method, target = request_line.split(" ")[:2]
                print(
                    f"[local hub front] {status} {method} {target.split('?')[0]}: {message}",
                    file=sys.stderr,
                    flush=True,
                )  # never the token
                writer.write(response(status, message, extra))
                await writer.drain()
                return
            upgrade = "websocket" in found.get("upgrade", "").lower()
            try:
                app_reader, app_writer = await asyncio.open_connection("127.0.0.1", self.app_port)
            except OSError:
                writer.write(response(503, f"Space {self.repo_id} is not answering (starting?)"))
                await writer.drain()
                return
            app_writer.write(rewrite_for_app(request_line, headers, upgrade))
            pumps = [
                asyncio.ensure_future(_pump(reader, app_writer)),
                asyncio.ensure_future(_pump(app_reader, writer)),
            ]
            done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            if pumps[0] in done and not upgrade:
                # the client finished sending (half-close): the answer may still come
                done, pending = await asyncio.wait(pending)
            for p in pending:
                p.cancel()
        except (ConnectionError, OSError):
            pass
        finally:
            if app_writer is not None:
                _close(app_writer)
            _close(writer)


async def serve(spec: dict, app: subprocess.Popen) -> int:
    """Serve the front until the app exits (its status) or a SIGTERM/SIGINT (the app is stopped
    too; 128 + the signal, or the app's status)."""
    loop = asyncio.get_running_loop()
    front = Front(
        spec["repo_id"],
        bool(spec.get("private")),
        TokenFile(spec.get("tokens")),
        int(spec["app_port"]),
    )
    server = await asyncio.start_server(
        front.handle, "127.0.0.1", int(spec["port"]), limit=MAX_HEAD, reuse_address=True
    )
    stop = asyncio.Event()
    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (got.append(s), stop.set()))
    exited = loop.run_in_executor(None, app.wait)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([exited, stopping], return_when=asyncio.FIRST_COMPLETED)
    server.close()
    if app.poll() is None:
        try:
            app.send_signal(got[0] if got else signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(asyncio.shield(exited), APP_STOP_S)
        except asyncio.TimeoutError:
            app.kill()
            await exited
    stopping.cancel()
    code = app.returncode
    return 128 + (-code) if code is not None and code < 0 else int(code or 0)


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    app = subprocess.Popen(
        spec["argv"], cwd=spec["cwd"], env=spec["env"], stdin=subprocess.DEVNULL
    )  # stdout and stderr: the Space's log, as this process's
    try:
        return asyncio.run(serve(spec, app))
    finally:
        if app.poll() is None:
            app.kill()


if __name__ == "__main__":
    sys.exit(main())
