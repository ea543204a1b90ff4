"""Docker Spaces of the local Hub run as local processes, the way the Hub would build and run them.

When a Space has an uploaded folder (and again after a commit, a variable or secret change, a
hardware change or a restart, as the Hub rebuilds), :class:`SpaceRunner` parses the folder's
``Dockerfile`` (``tools/local_hub/docker_image.py``), lays out the image's file tree from the
folder as its COPY lines say, and runs its CMD with this venv's interpreter (``sys.executable``) in
the image's WORKDIR, in its own process group, with this environment:

- the image's ENV, image paths mapped under the laid-out tree;
- ``PYTHONPATH`` entries standing in for the Dockerfile's ``pip install`` of the copied packages
  (this checkout's editable ``shared/`` and ``spaces/`` are hidden from ``sys.path``);
- the Space's variables and secrets;
- ``PORT`` (a free port on 127.0.0.1: the app's own, reached only through the front),
  ``SPACE_ID``, ``SPACE_AUTHOR_NAME``, ``SPACE_REPO_NAME``, ``SPACE_HOST`` (``127.0.0.1:<public
  port>``, the front's) and ``HF_ENDPOINT`` (the local Hub's URL);
- last, ``space_env``: what the local Hub's operator gives to stand in for hardware this machine
  lacks (e.g. vLLM's CPU settings: ``VLLM_EXTRA_ARGS``, ``VLLM_ENABLE_V1_MULTIPROCESSING``,
  ``OMP_NUM_THREADS``, ``HOST=127.0.0.1``, ``MAX_MODEL_LEN``; see
  ``trainer/local/children.py:start_replica``). ``{PUBLIC_PORT}`` in a value becomes the Space's
  public port (e.g. ``ROLLOUT_PUBLIC_URL=http://127.0.0.1:{PUBLIC_PORT}``), ``{PORT}`` the app's
  own port, ``{FREE_PORT}`` another free one.

Every Space is reached through its front (``space_front.py``, the process the runner starts, which
starts the CMD as its child): the public port, where a private Space's visitors must send
``Authorization: Bearer <token>`` with read access to it, as the Hub's proxy checks at
``https://<owner>-<name>.hf.space``; the runtime's ``domains`` name the public port.

Stages (:meth:`SpaceRunner.stage`): BUILDING from the (re)build request until the app's port
answers HTTP (any status; polled), RUNNING after, RUNTIME_ERROR with the log's tail when the
process exits, BUILD_ERROR when the Dockerfile cannot be stood in for, NO_APP_FILE without a
Dockerfile. Stopping (pause, rebuild, :meth:`SpaceRunner.stop_all`) sends SIGTERM to the process
group, then SIGKILL. Each Space's output goes to ``<space dir>/logs/run.log``.

What this does not check: the image build itself. No Docker and no base image (the base image's
system packages, Python version and libraries are this machine's and this venv's: a package the
image would lack but this venv has imports here), no ``RUN`` line runs (``pip install`` is replaced
by ``PYTHONPATH`` entries, so a dependency missing from the Space's pyproject goes unnoticed), no
``USER``/uid 1000 or read-only home, no ``.dockerignore`` beyond the usual caches, no GPU (the
operator's ``space_env`` stands in), no HEALTHCHECK, no sleep after inactivity, no TLS (the
front is plain HTTP on 127.0.0.1), and none of the Hub's proxy's other ways in (``?__sign=``
links, cookies).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from trainer.local.ports import free_port

from .docker_image import DockerImageError, build_image, parse_dockerfile

log = logging.getLogger("tools.local_hub.space_runner")

REPO = Path(__file__).resolve().parents[2]
# This checkout's editable install (deltasync, the Spaces' packages): hidden from Space processes.
CHECKOUT_PATHS = [str(REPO / "shared"), str(REPO / "spaces")]
STOP_TIMEOUT_S = 10.0
POLL_S = 0.25
ERROR_TAIL_LINES = 30


@dataclasses.dataclass
class _Run:
    """One Space's process state (guarded by ``lock`` for process operations)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    requested: int = 0  # generation of the latest (re)build request
    started: int = 0  # generation the current state belongs to
    proc: subprocess.Popen | None = None  # the front (space_front.py), the app its child
    port: int | None = None  # the public port (the front's)
    app_port: int | None = None  # the app's own port
    answered: bool = False
    stopping: bool = False
    error_stage: str | None = None  # BUILD_ERROR / NO_APP_FILE
    error: str | None = None


class SpaceRunner:
    """Runs the local Hub's Docker Spaces as processes.

    Args:
        root: folder of the Spaces' build trees and logs (``<root>/<owner>/<name>/``).
        hub_url: the local Hub's URL, given to every Space as ``HF_ENDPOINT``.
        space_env: extra environment for every Space, applied last (``{PORT}`` and
            ``{FREE_PORT}`` are replaced).
        hidden_paths: folders taken off the Space processes' ``sys.path`` (default: this
            checkout's ``shared/`` and ``spaces/``).
        tokens_path: the Hub's ``tokens.json``, which the fronts of private Spaces check
            visitors' tokens against (None: no token is known, so a private Space admits
            nobody).
    """

    def __init__(
        self,
        root: Path,
        hub_url: str,
        space_env: dict[str, str] | None = None,
        hidden_paths: list[str] | None = None,
        tokens_path: Path | None = None,
    ):
        self.root = Path(root)
        self.hub_url = hub_url.rstrip("/")
        self.space_env = dict(space_env or {})
        self.hidden_paths = CHECKOUT_PATHS if hidden_paths is None else hidden_paths
        self.tokens_path = None if tokens_path is None else Path(tokens_path)
        self._runs: dict[str, _Run] = {}
        self._mu = threading.Lock()

    # ------------------------------------------------------------------------------ paths
    def space_dir(self, repo_id: str) -> Path:
        """The folder of Space ``repo_id``'s build tree and logs."""
        return self.root / repo_id

    def log_path(self, repo_id: str) -> Path:
        """The Space's process log (appended to across restarts)."""
        return self.space_dir(repo_id) / "logs" / "run.log"

    def _run(self, repo_id: str) -> _Run:
        with self._mu:
            return self._runs.setdefault(repo_id, _Run())

    # ------------------------------------------------------------------------------ control
    def start(
        self,
        repo_id: str,
        files_dir: Path,
        env: dict[str, str],
        port: int | None = None,
        private: bool = False,
    ) -> None:
        """(Re)build and start Space ``repo_id`` from its uploaded folder ``files_dir`` with the
        Space's variables and secrets ``env``, in the background: the Space is BUILDING from now
        on. A running process is stopped first. ``port``: the public port to reuse when it is
        free (the Space keeps its URL across restarts); ``private``: its front admits only
        tokens that may read it. Requests in quick succession coalesce."""
        run = self._run(repo_id)
        with self._mu:
            run.requested += 1
            gen = run.requested
        threading.Thread(
            target=self._rebuild,
            args=(repo_id, run, gen, Path(files_dir), dict(env), port, private),
            name=f"space-build-{repo_id}",
            daemon=True,
        ).start()

    def stop(self, repo_id: str) -> None:
        """Stop Space ``repo_id``'s process (SIGTERM to its group, SIGKILL after
        ``STOP_TIMEOUT_S``) and cancel a pending rebuild. Returns when it is gone."""
        run = self._run(repo_id)
        with self._mu:
            run.requested += 1
            gen = run.requested
        with run.lock:
            self._stop_proc(run)
            with self._mu:
                if run.requested == gen:
                    run.started = gen
                    run.error_stage = run.error = None

    def stop_all(self) -> None:
        """Stop every Space process (the local Hub's shutdown), all at once."""
        with self._mu:
            ids = list(self._runs)
        stops = [threading.Thread(target=self.stop, args=(r,)) for r in ids]
        for t in stops:
            t.start()
        for t in stops:
            t.join()

    # ------------------------------------------------------------------------------ state
    def stage(self, repo_id: str) -> tuple[str | None, str | None, int | None]:
        """``(stage, errorMessage, port)`` of Space ``repo_id``; stage None when it was never
        started or was stopped (the caller knows whether it is paused or has no files)."""
        run = self._run(repo_id)
        with self._mu:
            if run.requested > run.started:
                return "BUILDING", None, run.port
            if run.error_stage:
                return run.error_stage, run.error, None
            proc = run.proc
            if proc is None:
                return None, None, None
            if proc.poll() is not None and not run.stopping:
                return "RUNTIME_ERROR", self._exit_message(repo_id, proc.returncode), run.port
            return ("RUNNING" if run.answered else "BUILDING"), None, run.port

    def _exit_message(self, repo_id: str, code: int) -> str:
        return f"the app exited with code {code}; last lines of its log:\n" + self.tail(repo_id)

    def tail(self, repo_id: str, lines: int = ERROR_TAIL_LINES) -> str:
        """The last ``lines`` lines of the Space's log ('' without one)."""
        try:
            with open(self.log_path(repo_id), encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------------------ workers
    def _rebuild(
        self,
        repo_id: str,
        run: _Run,
        gen: int,
        files_dir: Path,
        env: dict[str, str],
        port: int | None,
        private: bool = False,
    ) -> None:
        with run.lock:
            if run.requested != gen:
                return  # a later request (or a stop) supersedes this one
            self._stop_proc(run)
            error_stage, error, proc, app_port = None, None, None, None
            try:
                proc, port, app_port = self._launch(repo_id, files_dir, env, port, private)
            except FileNotFoundError as e:
                error_stage, error = "NO_APP_FILE", str(e)
            except (DockerImageError, OSError, KeyError, ValueError) as e:
                error_stage, error = "BUILD_ERROR", f"{type(e).__name__}: {e}"
            with self._mu:
                superseded = run.requested != gen
                run.proc, run.port, run.answered, run.stopping = proc, port, False, False
                run.app_port = app_port
                run.error_stage, run.error = error_stage, error
                run.started = gen
            if error:
                self._log(repo_id, f"build failed ({error_stage}): {error}")
            if superseded and proc is not None:
                self._stop_proc(run)
        if proc is not None:
            self._watch(run, proc, app_port, port)

    def _launch(
        self,
        repo_id: str,
        files_dir: Path,
        env: dict[str, str],
        port: int | None,
        private: bool = False,
    ) -> tuple[subprocess.Popen, int, int]:
        """Start the Space's front (which starts the app): (front process, public port, the
        app's port)."""
        dockerfile = files_dir / "Dockerfile"
        if not dockerfile.is_file():
            raise FileNotFoundError("the Space has no Dockerfile at its root")
        build = self.space_dir(repo_id) / "build"
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir(parents=True)
        df = parse_dockerfile(str(dockerfile))
        img = build_image(df, str(build / "image"), str(files_dir), self.hidden_paths)
        argv = img.start_command()
        port = port if port and _port_free(port) else free_port()
        app_port = free_port()
        while app_port == port:
            app_port = free_port()
        owner, name = repo_id.split("/")
        space = {
            **env,
            "PORT": str(app_port),
            "SPACE_ID": repo_id,
            "SPACE_AUTHOR_NAME": owner,
            "SPACE_REPO_NAME": name,
            "SPACE_HOST": f"127.0.0.1:{port}",
            "HF_ENDPOINT": self.hub_url,
        }
        for k, v in self.space_env.items():
            v = v.replace("{PUBLIC_PORT}", str(port)).replace("{PORT}", str(app_port))
            space[k] = v.replace("{FREE_PORT}", str(free_port()))
        full_env = img.env(**space)
        log_path = self.log_path(repo_id)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log(
            repo_id,
            f"starting {argv[1:]} in {img.cwd} on port {app_port}, reached through its "
            f"{'private' if private else 'public'} front on port {port} (variables and "
            f"secrets: {sorted(env)})",
        )
        spec = {
            "argv": argv,
            "cwd": str(img.cwd),
            "env": full_env,
            "port": port,
            "app_port": app_port,
            "repo_id": repo_id,
            "private": private,
            "tokens": None if self.tokens_path is None else str(self.tokens_path),
        }
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tools.local_hub.space_front"],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
                start_new_session=True,  # its own process group: stop() reaches its children
            )
        try:  # the spec holds the Space's secrets: on a pipe, never on a command line
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
        except OSError:
            pass  # it exited already: the watcher reports RUNTIME_ERROR with the log's tail
        log.info("Space %s: pid %d on port %d (log %s)", repo_id, proc.pid, port, log_path)
        (self.space_dir(repo_id) / "process.json").write_text(
            json.dumps({"pid": proc.pid, "port": port, "app_port": app_port})
        )
        return proc, port, app_port

    def adopt(self, repo_id: str) -> bool:
        """Take over Space ``repo_id``'s process left running by a Hub that was killed (a Hub
        outage does not restart Spaces): True when the process of its ``process.json`` is alive
        and its port answers, then RUNNING as before; False otherwise (the caller starts it)."""
        path = self.space_dir(repo_id) / "process.json"
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        proc = _Adopted(int(known["pid"]))
        app_port = int(known.get("app_port") or known["port"])
        if proc.poll() is not None or not _answers(f"http://127.0.0.1:{app_port}/"):
            return False
        run = self._run(repo_id)
        with self._mu:
            run.proc, run.port, run.answered, run.stopping = proc, int(known["port"]), True, False
            run.app_port = app_port
            run.started = run.requested
        self._log(repo_id, f"adopted pid {proc.pid} on port {run.port} after a Hub restart")
        return True

    def _log(self, repo_id: str, line: str) -> None:
        """A line of the local Hub's own in the Space's log (never a variable's or secret's
        value)."""
        path = self.log_path(repo_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"[local hub {time.strftime('%H:%M:%S')}] {line}\n")

    def _watch(self, run: _Run, proc: subprocess.Popen, port: int, front_port: int) -> None:
        """Poll the app's own ``port`` until it answers HTTP and its front (``front_port``)
        accepts connections (RUNNING), or the process exits."""
        url = f"http://127.0.0.1:{port}/"
        while proc.poll() is None:
            with self._mu:
                if run.proc is not proc:
                    return
            if _answers(url) and _accepts(front_port):
                with self._mu:
                    if run.proc is proc:
                        run.answered = True
                return
            time.sleep(POLL_S)

    def _stop_proc(self, run: _Run) -> None:
        """Stop ``run``'s process group (caller holds ``run.lock``)."""
        with self._mu:
            proc = run.proc
            run.stopping = True
        if proc is None:
            return
        _kill_group(proc)
        with self._mu:
            if run.proc is proc:
                run.proc, run.answered = None, False


class _Adopted:
    """A Space process this Hub did not start (see :meth:`SpaceRunner.adopt`), with the part of
    ``subprocess.Popen`` the runner uses: ``pid``, ``poll``, ``wait``, ``returncode``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                zombie = True
            if zombie:
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of ``proc`` (a session leader), then SIGKILL after
    ``STOP_TIMEOUT_S``; also SIGKILLs children that outlive the leader."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.poll()
        return
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _answers(url: str) -> bool:
    """Whether ``url`` answers HTTP at all (any status)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _accepts(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port`` (the front: an HTTP
    request without a token would be refused there, and logged)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def _port_free(port: int) -> bool:
    """Whether a server can bind ``port`` on 127.0.0.1 now (as uvicorn does, with
    ``SO_REUSEADDR``: a port whose last connections are in TIME_WAIT counts as free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
