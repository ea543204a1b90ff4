"""A local Hub as a child process, and its admin routes, for scripts and tests.

``HubProcess(root).start()`` runs ``python -m tools.local_hub`` on free ports (its output to
``<root>/hub.log``), waits until it answers, and gives the tokens and admin calls the journey and
the tests use; ``stop()`` (SIGTERM, then SIGKILL) and ``start()`` again keep the state folder, as
a restarted Hub keeps its buckets and Spaces.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HubProcess:
    """One local Hub child process.

    Args:
        root: its state folder.
        space_env: ``KEY=VALUE`` environment added to every Space it runs.
        port, cas_port: fixed ports (default: free ones, kept across restarts).
    """

    def __init__(
        self,
        root: Path,
        space_env: dict | None = None,
        port: int | None = None,
        cas_port: int | None = None,
    ):
        self.root = Path(root).resolve()
        self.space_env = dict(space_env or {})
        self.port = port or free_port()
        self.cas_port = cas_port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> HubProcess:
        """Start it and wait until ``/admin/requests`` answers.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s`` (its log's tail).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "tools.local_hub",
            "--root",
            str(self.root),
            "--port",
            str(self.port),
            "--cas-port",
            str(self.cas_port),
        ]
        for k, v in self.space_env.items():
            argv += ["--space-env", f"{k}={v}"]
        log = open(self.root / "hub.log", "ab")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the local Hub exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                self.admin("GET", "/admin/requests?since=1e12")
                return self
            except (OSError, KeyError):
                time.sleep(0.2)
        raise RuntimeError(f"the local Hub did not answer in {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, kill: bool = False) -> None:
        """Stop it: with ``kill``, SIGKILL at once, as a crash (its Spaces, other processes,
        keep running and a restarted Hub takes them over); else SIGTERM (it stops its Spaces),
        SIGKILL after 60 s, and any Space process still alive then is stopped here."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if not kill:
            for known in (self.root / "spaces").glob("*/*/process.json"):
                try:
                    os.killpg(json.loads(known.read_text())["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError, ValueError, KeyError):
                    pass

    def log_tail(self, n: int = 3000) -> str:
        path = self.root / "hub.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    @property
    def tokens(self) -> dict[str, str]:
        """``{name: value}`` of its tokens (``me-write``, ``me-read``, ``me-admin``, ...)."""
        return {t["name"]: t["value"] for t in json.loads((self.root / "tokens.json").read_text())}

    def admin(self, method: str, path: str, body: dict | None = None):
        """Call an admin route with the admin token; the JSON answer.

        Raises:
            urllib.error.HTTPError: the Hub refused it.
        """
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.tokens['me-admin']}",
                "Content-Type": "application/json",
            },
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def new_token(self, role: str, scopes: dict | None = None, name: str | None = None) -> str:
        """A new token's value (``role``: write, read or fine-grained with ``scopes``)."""
        return self.admin("POST", "/admin/tokens", {"role": role, "scopes": scopes, "name": name})[
            "value"
        ]

    def requests(self, since: float = 0.0) -> dict:
        """Requests since ``since`` (unix seconds) by token and class, counted by the Hub."""
        return self.admin("GET", f"/admin/requests?since={since}")
