"""Benchmark of the Wordle Space: env steps/s and step latency at 1, 64 and 256 sessions.

Starts the real server (``python -m wordle_env.server.app`` in ``spaces/wordle-env``) on a free
loopback port, then drives N concurrent WebSocket sessions from one asyncio client process.
Each session plays seeded games back to back (reset, up to six valid guesses, repeat).

Two load shapes per session count:

- ``closed``: every session sends its next step as soon as the answer arrives (saturation:
  measures throughput; latency is then mostly queueing, about N / throughput).
- ``paced``: every session waits about ``--think-ms`` between steps, like an RL rollout
  waiting for the model to write its next guess (latency below saturation; 256 sessions at
  1 s per turn offer ~256 steps/s).

A step's latency is the time from sending the step frame to receiving its observation,
measured in the client (so it includes client-side scheduling on the same 2 cores).
Prints a table and writes ``bench/results/wordle.json``.

Run: ``.venv/bin/python bench/bench_wordle.py`` (``make bench`` runs it too; ``--smoke``: 1 and 4
sessions, 1 s a row, results in ``bench/results/smoke/wordle.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from report import parse_with_smoke, smoke_path
from websockets.asyncio.client import ClientConnection, connect

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the trainer package (run from anywhere)

from trainer.local.ports import free_port  # noqa: E402

SPACE_DIR = REPO / "spaces" / "wordle-env"
RESULTS = REPO / "bench" / "results" / "wordle.json"
GUESSES = ["crane", "slate", "moist", "pouch", "lying", "fjord"]
P99_TARGET_MS = 50.0


@dataclass
class Row:
    """One measured configuration."""

    sessions: int
    mode: str
    think_ms: float
    duration_s: float
    steps: int
    resets: int
    steps_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    errors: int
    server_cpu_us_per_msg: float | None


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` in seconds (Linux ``/proc``), else None."""
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return None
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(max_sessions: int) -> tuple[subprocess.Popen[bytes], str]:
    """Start the Space server; return its process and ``http://127.0.0.1:<port>``."""
    port = free_port()
    env = {
        **os.environ,
        "PORT": str(port),
        "WORDLE_HOST": "127.0.0.1",
        "WORDLE_LOG_LEVEL": "warning",
        "WORDLE_MAX_SESSIONS": str(max_sessions),
        # every session is this process's; twice the row's sessions, since a closed session's
        # slot is freed when the server's handler ends, which can be after the next row opens
        "WORDLE_MAX_SESSIONS_PER_CLIENT": str(2 * max_sessions),
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    proc = subprocess.Popen([sys.executable, "-m", "wordle_env.server.app"], cwd=SPACE_DIR, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError("server did not answer /health within 90 s")


async def _ask(ws: ClientConnection, kind: str, data: dict[str, object]) -> dict[str, object]:
    await ws.send(json.dumps({"type": kind, "data": data}))
    answer = json.loads(await ws.recv())
    if answer.get("type") != "observation":
        raise RuntimeError(f"expected an observation, found {answer}")
    return answer["data"]  # type: ignore[return-value]


async def _session(
    url: str, stop_at: float, record_from: float, think_s: float, rng: random.Random
) -> tuple[list[float], int, int, int]:
    """Play games until ``stop_at``.

    Returns:
        (step latencies in s recorded after ``record_from``, resets recorded, step answers
        with an error code, all messages sent including the warm-up).
    """
    latencies: list[float] = []
    resets = errors = messages = 0
    async with connect(url.replace("http://", "ws://") + "/ws", max_size=None) as ws:
        while time.perf_counter() < stop_at:
            await _ask(ws, "reset", {"seed": rng.randrange(1 << 30)})
            messages += 1
            resets += time.perf_counter() >= record_from
            for guess in GUESSES:
                if think_s:
                    await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))
                if time.perf_counter() >= stop_at:
                    break
                sent = time.perf_counter()
                data = await _ask(ws, "step", {"message": f"[{guess}]"})
                now = time.perf_counter()
                messages += 1
                if sent >= record_from:
                    latencies.append(now - sent)
                if data["observation"].get("error_code"):  # type: ignore[union-attr]
                    errors += 1
                if data["done"]:
                    break
    return latencies, resets, errors, messages


async def measure(
    url: str, sessions: int, seconds: float, warmup_s: float, think_ms: float, server_pid: int
) -> Row:
    """Run ``sessions`` sessions for ``warmup_s + seconds`` and summarize the recorded window."""
    cpu_before = _cpu_seconds(server_pid)
    start = time.perf_counter()
    record_from, stop_at = start + warmup_s, start + warmup_s + seconds
    rngs = [random.Random(1000 + i) for i in range(sessions)]
    results = await asyncio.gather(
        *(_session(url, stop_at, record_from, think_ms / 1000, rng) for rng in rngs)
    )
    cpu_after = _cpu_seconds(server_pid)
    messages = sum(r[3] for r in results)
    cpu_us_per_msg = (
        None
        if cpu_before is None or cpu_after is None
        else 1e6 * (cpu_after - cpu_before) / messages
    )
    latencies_ms = sorted(ms * 1000 for r in results for ms in r[0])
    if not latencies_ms:
        raise RuntimeError(f"no step completed with {sessions} sessions in {seconds} s")
    p99_index = min(len(latencies_ms) - 1, int(0.99 * len(latencies_ms)))
    return Row(
        sessions=sessions,
        mode="paced" if think_ms else "closed",
        think_ms=think_ms,
        duration_s=seconds,
        steps=len(latencies_ms),
        resets=sum(r[1] for r in results),
        steps_per_s=len(latencies_ms) / seconds,
        p50_ms=statistics.median(latencies_ms),
        p99_ms=latencies_ms[p99_index],
        max_ms=latencies_ms[-1],
        errors=sum(r[2] for r in results),
        server_cpu_us_per_msg=cpu_us_per_msg,
    )


def _print_table(rows: list[Row]) -> None:
    print(
        f"{'sessions':>8} {'mode':>7} {'think_ms':>8} {'steps/s':>9} {'p50_ms':>8} "
        f"{'p99_ms':>8} {'max_ms':>8} {'steps':>7} {'srv_cpu_us/msg':>14}"
    )
    for r in rows:
        cpu = "n/a" if r.server_cpu_us_per_msg is None else f"{r.server_cpu_us_per_msg:.0f}"
        print(
            f"{r.sessions:>8} {r.mode:>7} {r.think_ms:>8.0f} {r.steps_per_s:>9.0f} "
            f"{r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.max_ms:>8.2f} {r.steps:>7} {cpu:>14}"
        )


def main() -> None:
    """Parse arguments, run every configuration, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window per row")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="unrecorded start per row")
    parser.add_argument(
        "--think-ms",
        type=float,
        nargs="+",
        default=[250.0, 1000.0],
        help="mean pauses between steps for the paced rows (an LLM turn takes ~0.5-3 s)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    smoke = dict(sessions=[1, 4], seconds=1.0, warmup_s=0.2, think_ms=[50.0])
    args = parse_with_smoke(parser, {**smoke, "out": Path(smoke_path(RESULTS))})

    proc, url = start_server(max_sessions=max(args.sessions))
    try:
        rows: list[Row] = []
        for mode_think in (0.0, *args.think_ms):
            for n in args.sessions:
                if mode_think and n == 1:
                    continue  # one paced session only measures the think time
                row = measure(url, n, args.seconds, args.warmup_s, mode_think, proc.pid)
                rows.append(asyncio.run(row))
                print(
                    f"measured {rows[-1].mode} x{n}: {rows[-1].steps_per_s:.0f} steps/s", flush=True
                )
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    _print_table(rows)
    at_max = [r for r in rows if r.sessions == max(args.sessions)]
    for r in at_max:
        verdict = "met" if r.p99_ms < P99_TARGET_MS else "NOT met"
        print(
            f"target p99 < {P99_TARGET_MS:.0f} ms at {r.sessions} sessions ({r.mode}): "
            f"{verdict} ({r.p99_ms:.1f} ms)"
        )
    report = {
        "benchmark": "wordle-env",
        "unix_time": int(time.time()),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1_5_15_min_at_end": list(os.getloadavg()),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "openenv": metadata.version("openenv"),
            "uvicorn": metadata.version("uvicorn"),
        },
        "method": (
            "server and one asyncio client process on the same machine, loopback; latency "
            "= client send-to-receive of a step frame; closed = no pause between steps, "
            "paced = uniform(0.5, 1.5) x think_ms pause before each step; "
            "server_cpu_us_per_msg = server process CPU time / all messages of the row "
            "(resets and steps, warm-up included), less sensitive to other load on the "
            "machine than throughput"
        ),
        "p99_target_ms": P99_TARGET_MS,
        "rows": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
