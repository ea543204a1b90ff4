"""Headless Chromium driven through its own DevTools protocol (Debian's ``chromium`` package;
nothing is downloaded) and a ``python -m dashboard`` process on a bucket: what the browser tests
(``test_browser.py``) share."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tools.browser import Cdp, run_process, wait_for
from tools.browser import chromium as browser_chromium

REPO = Path(__file__).resolve().parents[2]


def _wait(cond: Callable, timeout_s: float, what: str, detail: Callable[[], object] = str):
    """``tools.browser.wait_for``, failing the test on a timeout."""
    try:
        return wait_for(cond, timeout_s, what, detail)
    except TimeoutError as e:
        pytest.fail(str(e))


@contextmanager
def chromium(tmp_path: Path) -> Iterator[Cdp]:
    """Headless Chromium with a fresh profile under ``tmp_path`` (``tools.browser.chromium``)."""
    with browser_chromium(tmp_path) as page:
        yield page


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
    with run_process([sys.executable, "-m", "dashboard", *flags], log_path, 15, cwd=REPO) as proc:
        _wait(
            lambda: proc.poll() is not None or _http_ok(url),
            90,
            "dashboard start",
            lambda: log_path.read_text(errors="replace")[-3000:],
        )
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        yield url


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
