"""A clean stop: SIGTERM ends the trainer within seconds at any phase, with its children and
without tracebacks, even while the main thread waits on work that never looks at signals (an
evaluation's thread pool waiting for its games: what took ~90 s and printed tracebacks on a busy
2-core machine). A real process, a real child process group, a real signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from concurrent.futures import ThreadPoolExecutor
    sys.path.insert(0, {repo!r})
    from trainer import shutdown
    from trainer.local import children

    shutdown.install(grace_s={grace})
    child = children._spawn(
        "sleeper", ["-c", "import time; time.sleep(600)"], {repo!r}, {{}}, {logs!r}, 0
    )
    # a library's own spawned process, as TRL's rollout worker: in this process's group
    spawned = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    spawned.start()
    pids = f"{{child.proc.pid}} {{spawned.pid}}"
    if {early}:  # the stop unwinds at once: nothing stopped the child in order
        print(pids, flush=True)
        time.sleep(600)
    with ThreadPoolExecutor(2) as pool:  # the with waits for its games, deaf to signals
        games = [pool.submit(time.sleep, 600) for _ in range(2)]
        if not {early}:
            print(pids, flush=True)  # the stop comes while the games run
        [g.result() for g in games]
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its dead parent's init yet) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("phase", ["games", "start"])
def test_sigterm_ends_the_trainer_and_its_children_within_the_grace(tmp_path, phase):
    """``games``: the stop comes while an evaluation's pool runs (the watchdog ends it);
    ``start``: where the main thread unwinds at once, with nothing that stops the child in order
    (the children left are killed at exit)."""
    grace = 2.0
    script = SCRIPT.format(
        repo=REPO, grace=grace, logs=str(tmp_path / "logs"), early=phase == "start"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    children = [int(pid) for pid in proc.stdout.readline().split()]
    assert all(alive(pid) for pid in children)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM
    assert took < grace + 10, took  # the watchdog, not the games' 600 s
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel reaps the killed group
    assert not any(alive(pid) for pid in children)  # our child's group and the library's
    assert "Traceback" not in err, err
    assert "SIGTERM: stopping" in err
