"""Headless Chromium driven through its own DevTools protocol (Debian's ``chromium`` package;
nothing is downloaded): what the dashboard's browser tests use, and a screenshot of a running
dashboard for the docs.

    python -m tools.browser --url http://127.0.0.1:7861/ --out docs/dashboard.png

waits until the page has drawn its plots (``--wait-s``), then saves a PNG of the whole window.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from base64 import b64decode
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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
        """Send one command and return its result (events in between are dropped).

        Raises:
            RuntimeError: the browser answered the command with an error.
        """
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
        """The JSON value of a JavaScript expression in the page.

        Raises:
            RuntimeError: the script threw."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """Save the page as a PNG at ``path``; returns it."""
        shot = self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b64decode(shot["data"]))
        return path


@contextmanager
def run_process(
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


def wait_for(cond: Callable, timeout_s: float, what: str, detail: Callable[[], object] = str):
    """Poll ``cond`` every 0.25 s until it returns something truthy, and return that.

    Raises:
        TimeoutError: not within ``timeout_s``; says what was awaited and ``detail()``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}; last: {detail()}")


@contextmanager
def chromium(work_dir: Path) -> Iterator[Cdp]:
    """Headless Chromium with a fresh profile under ``work_dir``; yields a CDP client on its first
    page.

    Raises:
        FileNotFoundError: no ``chromium`` on PATH (``apt-get install chromium``).
    """
    if CHROMIUM is None:
        raise FileNotFoundError("expected a chromium executable on PATH, found none")
    profile = work_dir / "chromium-profile"
    log_path = work_dir / "chromium.log"
    args = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"]
    with run_process(args, log_path, 10):
        port_file = profile / "DevToolsActivePort"
        wait_for(
            lambda: port_file.exists() and port_file.read_text().strip(),
            30,
            "chromium start",
            lambda: log_path.read_text(errors="replace")[-2000:],
        )
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        url = pages[0]["webSocketDebuggerUrl"]
        from websockets.sync import client as ws_client

        with ws_client.connect(url, max_size=2**26, open_timeout=20) as ws:
            yield Cdp(ws)


def main(argv: list[str] | None = None) -> None:
    """Screenshot a running dashboard (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m tools.browser", description=main.__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--wait-s", type=float, default=20.0, help="seconds for the plots to draw")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, chromium(Path(tmp)) as page:
        page.call("Page.enable")
        page.call("Page.navigate", url=args.url)
        count = "document.querySelectorAll('.vega-embed canvas, .vega-embed svg').length"
        wait_for(lambda: page.evaluate(count), 60, "the dashboard's plots")
        time.sleep(args.wait_s)  # the plots' first data, then a refresh
        print(page.screenshot(args.out))


if __name__ == "__main__":
    main()
