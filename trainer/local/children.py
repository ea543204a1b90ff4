"""The local default's child processes: the task's environment server, a vLLM rollout replica and
the dashboard, each started from its Space folder's own entry point on 127.0.0.1, health-checked
and stopped at the end (``Child``; ``kill_started_children`` when a stop cannot wait).

The trainer never imports Space code: it runs the task's server command (``trainer.task.EnvServer``,
e.g. ``python -m wordle_env.server.app`` in spaces/wordle-env) and ``python -m rollout.launch``
(spaces/vllm-rollout) as subprocesses, configured by the same environment variables a Hugging Face
Space would set.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from trainer.local.ports import free_port
from trainer.local.threads import OMP_WAIT, cpu_threads, omp_waits_passive

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLLOUT_DIR = os.path.join(REPO, "spaces", "vllm-rollout")
log = logging.getLogger(__name__)


class ChildFailedError(RuntimeError):
    """A child server exited or did not become healthy in time."""


_http: httpx.Client | None = None


def health_client() -> httpx.Client:
    """One shared, thread-safe HTTP client for health polls. ``httpx.get`` builds a new client,
    and with it a TLS context, on every call: at 4 polls per second that was 74% of the trainer
    process's CPU in a py-spy profile, and it held the GIL the training step needs."""
    global _http
    if _http is None:
        _http = httpx.Client(timeout=5)
    return _http


@dataclass
class Child:
    """A server we started: its name, process, base URL and log file."""

    name: str
    proc: subprocess.Popen
    url: str
    log_path: str
    health_path: str = "/health"

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait for ``GET {url}{health_path}`` to answer 200.

        Raises:
            ChildFailedError: the process exited or ``timeout_s`` passed (with its log's tail).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ChildFailedError(
                    f"{self.name} exited with code {self.proc.returncode}; log tail:\n{self.tail()}"
                )
            try:
                if (
                    health_client().get(f"{self.url}{self.health_path}", timeout=2).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ChildFailedError(f"{self.name} not healthy after {timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 20) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the child's process group (the child and what it started, e.g. vLLM's
        engine processes), then SIGKILL after ``timeout_s``."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return  # the group is gone already
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # grandchildren may outlive the child briefly
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.killpg(self.proc.pid, signal.SIGKILL)


# util-linux's setpriv: sets the child's parent-death signal, then execs it (no code of ours runs
# between fork and exec, which subprocess's preexec_fn would, unsafely beside threads)
SETPRIV = shutil.which("setpriv")


def dies_with_parent() -> list[str]:
    """The command prefix that makes a child get SIGTERM when this process dies however it dies
    (SIGKILL, the OOM killer: seen, a trainer killed at 9 GB left its replica, vLLM, the
    dashboard and the environment server running): ``setpriv --pdeathsig TERM`` (Linux). Empty
    where setpriv is missing, and off the main thread: Linux sends the signal when the *thread*
    that started the child ends, and only the main thread lasts as long as the process."""
    if SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return []
    return [SETPRIV, "--pdeathsig", "TERM", "--"]


def _spawn(name: str, args: list[str], cwd: str, env: dict, log_dir: str, port: int) -> Child:
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{name}.log")
    env = {**os.environ, **env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [*dies_with_parent(), sys.executable, *args],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() also reaches grandchildren
        )
    log.info("started %s (pid %d, log %s)", name, proc.pid, log_path)
    _started_groups.add(proc.pid)
    return Child(name, proc, f"http://127.0.0.1:{port}", log_path)


# The process groups of every child this process started (each child leads its own group).
_started_groups: set[int] = set()


def kill_started_children() -> int:
    """SIGKILL the process group of every child this process started (a stop that cannot
    wait: ``trainer.shutdown``); returns how many groups were still there."""
    alive = 0
    for pgid in list(_started_groups):
        try:
            os.killpg(pgid, signal.SIGKILL)
            alive += 1
        except ProcessLookupError:
            pass
        _started_groups.discard(pgid)
    return alive


def start_env_server(server, log_dir: str) -> Child:
    """A task's environment server (``trainer.task.EnvServer``) on a free loopback port, its
    ``PORT`` set (not waited for: ``Child.wait_healthy``)."""
    port = free_port()
    env = {**dict(server.env), "PORT": str(port)}
    return _spawn(server.name, list(server.args), server.cwd, env, log_dir, port)


# The local replica's context: a whole Wordle episode of a BPE model (SmolLM2's: up to 2,176
# tokens, the context check's bound) fits; 4096 is the Space's default too (rollout/config.py).
LOCAL_MAX_MODEL_LEN = 4096


def local_max_model_len(model: str) -> int:
    """``LOCAL_MAX_MODEL_LEN``, or the model's own ``max_position_embeddings`` when a local folder's
    config says less (vLLM refuses a longer context: the local model's is 2,048)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return LOCAL_MAX_MODEL_LEN  # a hub id: the Space's default
    with open(path) as f:
        limit = json.load(f).get("max_position_embeddings")
    return min(LOCAL_MAX_MODEL_LEN, int(limit)) if limit else LOCAL_MAX_MODEL_LEN


def start_replica(
    bucket: str, model: str, log_dir: str, replica_id: str = "local-0", extra_env=None
) -> Child:
    """A vLLM rollout replica following the run root ``bucket`` (a URI; not waited for); ``extra_env`` adds or
    overrides its environment variables (see spaces/vllm-rollout/rollout/config.py). A local
    model folder is passed as an absolute path: the replica runs in its own folder, where a
    relative one would be read as a hub id."""
    if os.path.isdir(model):
        model = os.path.abspath(model)
    port = free_port()
    env = {
        "BUCKET": bucket,
        "MODEL": model,
        "PORT": str(port),
        "HOST": "127.0.0.1",
        "VLLM_PORT": str(free_port()),
        "REPLICA_ID": replica_id,
        "POLL_INTERVAL_S": "0.5",
        "MAX_MODEL_LEN": str(local_max_model_len(model)),
        "HF_HUB_OFFLINE": "1",
        "HEARTBEAT_INTERVAL_S": "2",
        # --enforce-eager skips a ~50 s compile step on the CPU build. One process for the engine
        # and its worker: with the default multiprocess executor the idle worker spins on its
        # message queue for 1 s after every step (shm_broadcast busy_loop_s), which took most of a
        # core on a 2-core machine (py-spy: 87% of the worker's samples in the wait loop); 128
        # held-out games took 8.7 s with it and 6.7 s without (docs/BENCHMARKS.md section 6 (the main job)).
        "VLLM_EXTRA_ARGS": "--enforce-eager --distributed-executor-backend uni",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # the uni executor binds no OpenMP threads: without this the replica takes every core
        "OMP_NUM_THREADS": str(cpu_threads()[1]),
        **(OMP_WAIT if omp_waits_passive() else {}),
        "ROLLOUT_PUBLIC_URL": f"http://127.0.0.1:{port}",  # announced: the trainer's fleet joins it
        **(extra_env or {}),
    }
    return _spawn(
        f"replica-{replica_id}", ["-m", "rollout.launch"], ROLLOUT_DIR, env, log_dir, port
    )


def start_dashboard(bucket: str, port: int, log_dir: str) -> Child:
    """The sync-lag dashboard (``python -m dashboard``) on ``port`` (not waited for)."""
    args = ["-m", "dashboard", "--bucket", bucket, "--port", str(port)]
    child = _spawn("dashboard", args, REPO, {}, log_dir, port)
    child.health_path = "/"
    return child
