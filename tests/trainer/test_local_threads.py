"""``cpu_threads``: how the cores are shared between the trainer and its local replicas, by
default and with passive OpenMP waits (read in a fresh Python: the environment it started with)."""

from __future__ import annotations

import os
import subprocess
import sys


def _in_fresh_python(code: str, **env: str) -> list[str]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "LOCAL_WORLD_SIZE")
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


PROBE = "from trainer.local.threads import cpu_threads; print(*cpu_threads())"


def test_by_default_the_trainer_and_the_replica_split_the_cores():
    n = len(os.sched_getaffinity(0))
    assert _in_fresh_python(PROBE) == [str(max(1, n - n // 2)), str(max(1, n // 2))]


def test_with_passive_waits_the_trainer_takes_every_core():
    n = len(os.sched_getaffinity(0))
    assert _in_fresh_python(PROBE, OMP_WAIT_POLICY="PASSIVE") == [str(n), str(max(1, n // 2))]
    # two trainer processes on this machine (torchrun) share the cores
    two = _in_fresh_python(PROBE, OMP_WAIT_POLICY="passive", LOCAL_WORLD_SIZE="2")
    assert two[0] == str(max(1, n // 2))
