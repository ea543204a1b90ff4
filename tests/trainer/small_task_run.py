"""A task's small local run, as the tests of a task other than Wordle run it: 2 GRPO steps of 4
episodes through ``trainer.run.run`` on the local default (its environment server, a replica, the
bucket folder), evaluated before and after on 16 held-out episodes. It checks what every such run
must show, and hands back what the test checks of its own task."""

from __future__ import annotations

import json
from pathlib import Path

import httpx


def small_task_run(runs_root: Path, task: str, run_id: str, **flags) -> tuple[dict, dict, list]:
    """Train ``task`` 2 steps (``flags``: more of ``TrainConfig.from_flags``, e.g. ``model=``).

    Checked here: the 2 steps were trained and published as versions 0, 1 and 2, the replica
    holds the final weights bit for bit, the summary names the task, and both evaluations played
    the same 16 episodes (paired); the step log has one line per step.

    Returns:
        ``(summary, served, steps)``: ``summary.json``'s dict; the environment server's
        ``GET /stats``, read before the server stops; each step's line of ``steps.jsonl``.
    """
    from trainer.config import TrainConfig
    from trainer.run import run

    cfg = TrainConfig.from_flags(
        task=task,
        run_id=run_id,
        runs_root=str(runs_root),
        max_steps=2,
        num_generations=4,
        per_device_train_batch_size=16,
        token_budget=4096,
        eval_episodes=16,
        eval_every=0,
        dashboard=False,
        **flags,
    )
    served = {}

    def before_stop(stack, summary):  # while the environment's server still runs
        served.update(httpx.get(f"{stack.env_url}/stats", timeout=10).json())

    summary = run(cfg, before_stop=before_stop)
    assert summary["steps"] == 2 and summary["versions_published"] == [0, 1, 2]
    assert summary["replica_bit_exact"] is True
    assert summary["settings"]["run"]["task"] == task
    assert summary["eval_before"]["episodes"] == summary["eval_after"]["episodes"] == 16
    assert summary["eval_paired"]["games"] == 16
    log = runs_root / run_id / "logs" / "steps.jsonl"
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    # the trainer's memory, each step (a run that grows shows it): resident now, and the peak
    assert all(0 < s["mem/rss_gb"] <= s["mem/peak_rss_gb"] for s in steps), steps[-1]
    return summary, served, steps
