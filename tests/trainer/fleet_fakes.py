"""A fake rollout replica for the fleet tests and bench: a real HTTP server on 127.0.0.1 that
answers like the replica's front (``/health`` with ``held_version``, ``/v1/completions`` with the
``X-Deltasync-Version`` header), with a switchable failure mode."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from trainer.local.ports import free_port


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the listen backlog (the default 5 drops bursts of connects)
    daemon_threads = True


class FakeReplica:
    """``mode``: ``ok``; ``503`` (every /v1 request, health stays 200); ``500`` (likewise);
    ``hang`` (/v1 answers after ``hang_s``). ``delay_s`` per /v1 request (or ``per_token_s``
    times the request's ``max_tokens``). ``start()``/``stop()`` can be repeated on one port."""

    def __init__(
        self,
        version: int = 1,
        port: int | None = None,
        delay_s: float = 0.0,
        per_token_s: float = 0.0,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = version
        self.mode = "ok"
        self.delay_s = delay_s
        self.per_token_s = per_token_s
        self.hang_s = 30.0
        self.health_delay_s = 0.0  # each /health answers after this long (a busy engine)
        self.requests = 0  # /v1 requests received
        self.auth: list[str | None] = []
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> FakeReplica:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body leave as they are written

            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    time.sleep(fake.health_delay_s)
                    self._send(200, {"status": "ok", "held_version": fake.version, "ready": True})
                else:
                    self._v1({})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                self._v1(json.loads(self.rfile.read(n) or b"{}"))

            def _v1(self, body: dict) -> None:
                fake.requests += 1
                fake.auth.append(self.headers.get("Authorization"))
                if fake.mode == "hang":
                    time.sleep(fake.hang_s)
                if fake.mode in ("503", "500"):
                    self._send(int(fake.mode), {"error": "fake failure"})
                    return
                time.sleep(fake.delay_s + fake.per_token_s * int(body.get("max_tokens") or 0))
                # token ids of the completion, as vLLM returns them for return_token_ids: a
                # different sequence for every request, like sampled completions
                ids = [
                    (fake.port * 131 + fake.requests * 7919 + 31 * i) % 50_000 for i in range(20)
                ]
                self._send(
                    200,
                    {"choices": [{"text": "ok", "token_ids": ids}], "echo": body},
                    {"X-Deltasync-Version": str(fake.version)},
                )

        self._server = _Server(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the listening socket: new connections are refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
