"""CPU threads on a machine without a GPU: how the cores are shared between the trainer and its
local vLLM replicas (``cpu_threads``), and whether OpenMP threads wait passively
(``omp_waits_passive``, ``OMP_WAIT``)."""

from __future__ import annotations

import os

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
