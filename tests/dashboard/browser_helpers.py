"""Headless Chromium driven through its own DevTools protocol (Debian's ``chromium`` package;
nothing is downloaded) and a ``python -m dashboard`` process on a bucket: what the browser tests
(``test_browser.py``) share."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1500,2300",
    "--remote-debugging-port=0",
]


class Cdp:
    """A minimal Chrome DevTools Protocol client on one page target (JSON over a websocket)."""

    def __init__(self, ws):
        self.ws = ws
        self._id = 0

    def call(self, method: str, timeout_s: float = 30.0, **params) -> dict:
        """Send one command and return its result (events in between are dropped)."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method} failed: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression in the page."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")


@contextmanager
def chromium(tmp_path: Path) -> Iterator[Cdp]:
    """Headless Chromium with a fresh profile; yields a CDP client on its first page."""
    profile = tmp_path / "chromium-profile"
    log_path = tmp_path / "chromium.log"
    args = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"]
    with _process(args, log_path, 10):
        port_file = profile / "DevToolsActivePort"
        _wait(
            lambda: port_file.exists() and port_file.read_text().strip(),
            30,
            "chromium start",
            lambda: log_path.read_text(errors="replace")[-2000:],
        )
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        url = pages[0]["webSocketDebuggerUrl"]
        from websockets.sync import client as ws_client  # test_browser.py skips without it

        with ws_client.connect(url, max_size=2**26, open_timeout=20) as ws:
            yield Cdp(ws)


@contextmanager
def dashboard(bucket: str, tmp_path: Path) -> Iterator[str]:
    """``python -m dashboard`` on a free port; yields its URL."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "dashboard.log"
    flags = ["--bucket", bucket, "--port", str(port), "--refresh-s", "1"]
    url = f"http://127.0.0.1:{port}/"
    with _process([sys.executable, "-m", "dashboard", *flags], log_path, 15, cwd=REPO) as proc:
        _wait(
            lambda: proc.poll() is not None or _http_ok(url),
            90,
            "dashboard start",
            lambda: log_path.read_text(errors="replace")[-3000:],
        )
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        yield url


@contextmanager
def _process(
    args: list[str], log_path: Path, stop_timeout_s: float, **popen
) -> Iterator[subprocess.Popen]:
    """Run ``args`` (``popen``: more ``subprocess.Popen`` arguments) with stdout and stderr
    written to ``log_path``; on exit terminate it, and kill it after ``stop_timeout_s``."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, **popen)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _wait(cond: Callable, timeout_s: float, what: str, detail: Callable[[], object] = str):
    """Poll ``cond`` every 0.25 s until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last: {detail()}")
