"""Fixtures of the Wordle tests: the real Space server on 127.0.0.1, and its environment class.

``wordle_server`` starts ``python -m wordle_env.server.app`` (uvicorn) once per test session on a free
loopback port, waits for ``/health`` and stops it at the end through its own ``Popen``
handle. ``start_server`` is reused for the small-cap server of ``test_session_limits.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from trainer.local.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SPACE_DIR = REPO / "spaces" / "wordle-env"
STARTUP_TIMEOUT_S = 90.0


@dataclass
class ServerProcess:
    """A running server: ``url`` is ``http://127.0.0.1:<port>``; ``log_path`` its output."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def ws_url(self) -> str:
        """The session endpoint, ``ws://127.0.0.1:<port>/ws``."""
        return self.url.replace("http://", "ws://") + "/ws"

    def log_tail(self, n_chars: int = 4000) -> str:
        """The end of the server's combined stdout/stderr."""
        return self.log_path.read_text(errors="replace")[-n_chars:]


def start_server(log_path: Path, **env_overrides: str) -> ServerProcess:
    """Start the Space server with ``env_overrides`` on a free port and wait for ``/health``.

    Raises:
        RuntimeError: the process exited or ``/health`` did not answer within 90 s; the
            message holds the server's log.
    """
    port = free_port()
    env = {
        **os.environ,
        "PORT": str(port),
        "WORDLE_HOST": "127.0.0.1",
        "WORDLE_LOG_LEVEL": "warning",
        "GRADIO_ANALYTICS_ENABLED": "False",
        **env_overrides,
    }
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "wordle_env.server.app"],
        cwd=SPACE_DIR,
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    log_file.close()
    server = ServerProcess(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"wordle server exited with code {proc.returncode} during start-up; log:\n"
                f"{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(
        f"wordle server did not answer /health within {STARTUP_TIMEOUT_S:.0f} s; log:\n"
        f"{server.log_tail()}"
    )


def stop_server(server: ServerProcess) -> None:
    """Stop the server by its own process handle: SIGTERM, then SIGKILL after 15 s."""
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=15)


@pytest.fixture(scope="session")
def wordle_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The Space server with its default settings (256 sessions, 64 KiB messages)."""
    server = start_server(tmp_path_factory.mktemp("wordle_server") / "server.log")
    try:
        yield server
    finally:
        stop_server(server)
    # The server must have survived every test: it was still running when we stopped it.
    assert server.proc.returncode in (0, -15), (
        f"wordle server ended with {server.proc.returncode}; log:\n{server.log_tail()}"
    )


@pytest.fixture(scope="session")
def space_server() -> ModuleType:
    """The Space's ``server`` package, ``wordle_env.server`` (import its submodules by name)."""
    return importlib.import_module("wordle_env.server")


@pytest.fixture()
def environment_module(space_server: ModuleType) -> ModuleType:
    """``spaces/wordle-env/server/wordle_environment.py``, imported in-process."""
    return importlib.import_module(f"{space_server.__name__}.wordle_environment")


@pytest.fixture()
def server_factory(tmp_path: Path) -> Iterator[object]:
    """A function ``(**env_overrides) -> ServerProcess`` for servers with other settings;
    every server it started is stopped when the test ends."""
    started: list[ServerProcess] = []

    def factory(**env_overrides: str) -> ServerProcess:
        server = start_server(tmp_path / f"server{len(started)}.log", **env_overrides)
        started.append(server)
        return server

    try:
        yield factory
    finally:
        for server in started:
            stop_server(server)
