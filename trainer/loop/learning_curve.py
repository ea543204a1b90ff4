"""The learning curve of a run: held-out evaluations through the replica while GRPO trains, and the
paired comparison of the first and the last.

:class:`EvalEvery` is a ``transformers.TrainerCallback`` that, every ``every`` optimizer steps,
waits until the replica serves the newest published version and plays the held-out episodes
through it (``Task.run_evaluation``). Training waits meanwhile (the rollout worker keeps its bounded queue),
so the evaluation does not share the CPU with a training step. :func:`paired_difference` compares
two evaluations of the same seeds game by game: the same word is played before and after, so the
per-seed difference removes the words' own difficulty from the standard error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable

from transformers import TrainerCallback

from trainer.loop.rollouts import Rollouts, wait_for_version
from trainer.settings import EvalSettings
from trainer.task.base import EvalRequest, Task

log = logging.getLogger("trainer")

# the summary's per-evaluation figures, around the task's own (``HeldOutEvals.curve_fields``)
CURVE_FIELDS = ("reward_mean", "reward_se")


class HeldOutEvals:
    """The run's held-out evaluations, all through the replica fleet: ``before`` (once the
    replica serves the first version), a learning-curve point every ``settings.every`` steps, and
    ``after`` (once it serves the final version). Each block is kept in :attr:`blocks` (label ->
    the task's evaluation block with ``per_seed``) and recorded in the bucket metrics
    (``record(label, step, version, block)``).

    Args:
        settings: the run's :class:`~trainer.config.EvalSettings`.
        task: the environment (its held-out seeds, its evaluation and ``check_context``).
        target: what the evaluations play through (``trainer.task.base.EvalRequest``).
        rollouts: the run's ``trainer.loop.rollouts.Rollouts``: its publisher's newest version
            (None before the first; the evaluation then waits for no version) and the oldest
            version the serving replicas hold.
        record: ``f(label, step, version, block)`` (the metrics callback's ``add_eval``).
    """

    def __init__(
        self,
        settings: EvalSettings,
        task: Task,
        target: EvalRequest,
        rollouts: Rollouts,
        record: Callable[[str, int, int | None, dict], None],
    ):
        self.settings, self.task, self.target = settings, task, target
        self.rollouts, self.record = rollouts, record
        self.blocks: dict[str, dict] = {}

    def play(self, label: str, step: int, version: int | None, games: int, draws: int = 1) -> None:
        """Play ``games`` held-out games (the first ``games`` evaluation seeds), each ``draws``
        times with its own sampling seeds (``EvalRequest.draw``; :func:`pool_draws`), and record
        them."""
        if games <= 0:
            return
        t0 = time.time()
        seeds = self.task.eval_seeds(games)
        serving = max(1, self.rollouts.serving_count())
        workers = min(games, serving * self.settings.per_replica)
        log.info(
            "eval %s: %d games, %d at a time (%d serving replica(s) x %d, --eval-per-replica)",
            label,
            games,
            workers,
            serving,
            self.settings.per_replica,
        )
        block = pool_draws(
            [
                self.task.run_evaluation(
                    dataclasses.replace(self.target, draw=d, workers=workers),
                    seeds,
                    self.settings.temperature,
                    per_seed=True,
                )
                for d in range(draws)
            ]
        )
        self.blocks[label] = block
        self.record(label, step, version, block)
        log.info("eval %s (v%s, %.0fs): %s", label, version, time.time() - t0, fmt_eval(block))

    def before(self, version: int) -> None:
        """Once a replica serves the first version: the context check, then the evaluation."""
        t = self.target
        if self.task.check_context is not None:
            worst = self.task.check_context(
                t.replica_url, t.model_path, t.max_tokens, headers=t.headers
            )
            log.info("a full episode fits the replica's context (at most %d tokens)", worst)
        self.play("before", 0, version, self.settings.episodes, self.settings.draws)

    def curve_point(self, step: int) -> None:
        """A learning-curve point: the held-out games on the newest published version."""
        self._play_newest(f"step-{step}", step, self.settings.curve_episodes)

    def after(self, step: int) -> None:
        """The final evaluation, on the final version, paired with ``before``."""
        self._play_newest("after", step, self.settings.episodes, self.settings.draws)

    def _play_newest(self, label: str, step: int, games: int, draws: int = 1) -> None:
        version = self.rollouts.publisher.newest_published
        if version is not None:
            wait_for_version(self.rollouts.served_version, version, timeout_s=300)
        self.play(label, step, version, games, draws)

    def curve_fields(self) -> tuple[str, ...]:
        """The learning curve's figures: the reward and its SE, the task's declared evaluation
        figures in declared order (``Task.figures``, named counts left out), the episodes."""
        declared = getattr(self.task, "figures", ())
        own = tuple(f.name for f in declared if f.evals and not f.counts)
        return (*CURVE_FIELDS, *own, "episodes")

    def curve(self) -> list[dict]:
        """One row per evaluation, in order, each with its paired difference from the first
        evaluation on the seeds they share (a curve point plays the first
        ``curve_episodes``)."""
        before = self.blocks.get("before")
        fields = self.curve_fields()
        rows = []
        for label, block in self.blocks.items():
            row = {"label": label, **{m: block[m] for m in fields if m in block}}
            if before is not None and label != "before" and len(block["per_seed"]) > 1:
                n = len(block["per_seed"])
                row["vs_before"] = paired_difference(before["per_seed"][:n], block["per_seed"])
            rows.append(row)
        return rows

    def paired(self) -> dict | None:
        """The paired comparison of the first and the last evaluation (same seeds)."""
        before, after = self.blocks.get("before"), self.blocks.get("after")
        if not before or not after:
            return None
        return paired_difference(before["per_seed"], after["per_seed"])

    def summary(self) -> dict:
        """The evaluations' part of the run's summary: before, after, their paired difference
        and the learning curve."""
        return {
            "eval_before": self.summary_block("before"),
            "eval_after": self.summary_block("after"),
            "eval_paired": self.paired(),
            "eval_curve": self.curve(),
        }

    def summary_block(self, label: str) -> dict | None:
        """The ``label`` evaluation without its per-seed rewards (for the summary)."""
        block = self.blocks.get(label)
        return None if block is None else {k: v for k, v in block.items() if k != "per_seed"}


def fmt_eval(b: dict) -> str:
    """One log line's worth of an evaluation block: the reward and its standard error, then the
    task's other figures (rates to 2 digits, counts by name)."""
    parts = [f"reward {b['reward_mean']:.3f}+-{b['reward_se']:.3f}"]
    for k, v in b.items():
        if k in ("reward_mean", "reward_se", "episodes", "per_seed"):
            continue
        if isinstance(v, float):
            parts.append(f"{k.removesuffix('_rate')} {v:.2f}")
        elif isinstance(v, dict):
            parts.append(f"{k} " + (",".join(f"{n}={c}" for n, c in v.items()) or "0"))
    return " ".join(parts)


class EvalEvery(TrainerCallback):
    """Call ``evaluate_at(step)`` after every ``every``-th optimizer step but the last (the run's
    final evaluation comes after training, on more games).

    Args:
        every: optimizer steps between evaluations (0: none).
        max_steps: the run's last step (no curve point there).
        evaluate_at: ``f(step)``; it waits for the replica and records the evaluation.
    """

    def __init__(self, every: int, max_steps: int, evaluate_at: Callable[[int], None]):
        self.every, self.max_steps, self.evaluate_at = every, max_steps, evaluate_at

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self.every > 0 and step % self.every == 0 and step < self.max_steps:
            self.evaluate_at(step)


def pool_draws(blocks: list[dict]) -> dict:
    """One evaluation block from ``blocks``: the same games (same seeds, same order), each block
    one sampling draw (``EvalRequest.draw``), every block with ``per_seed``.

    Each game's reward is its mean over the draws (``per_seed``); ``reward_mean`` is their mean and
    ``reward_se`` their standard error over the games (the draws of one game share its word, so
    they are not independent games). ``episodes`` and the counts (integers, and dicts of them
    such as the invalid moves by reason) are summed over the draws; every other number (rates,
    means) is the mean of the draws' figures, so a rate stays comparable with a one-draw
    evaluation of the same games. ``draws`` says how many were pooled. One block is returned
    as it is.

    Raises:
        ValueError: no block, or blocks of different games (``per_seed`` lengths differ).
    """
    if not blocks:
        raise ValueError("expected at least one evaluation block to pool, found none")
    if len(blocks) == 1:
        return blocks[0]
    plays = [b["per_seed"] for b in blocks]
    if len({len(p) for p in plays}) != 1:
        raise ValueError(
            f"expected draws of the same games, found {[len(p) for p in plays]} games per draw"
        )
    out: dict = {}
    for key, first in blocks[0].items():
        values = [b.get(key) for b in blocks]
        if isinstance(first, bool) or key in ("per_seed", "reward_mean", "reward_se"):
            continue
        if isinstance(first, int):
            out[key] = sum(values)
        elif isinstance(first, dict):
            out[key] = dict(sorted(sum((Counter(v) for v in values), Counter()).items()))
        elif isinstance(first, float) or first is None:
            present = [v for v in values if v is not None]
            out[key] = round(statistics.fmean(present), 4) if present else None
    per_seed = [round(statistics.fmean(game), 4) for game in zip(*plays, strict=True)]
    out["per_seed"] = per_seed
    out["reward_mean"] = round(statistics.fmean(per_seed), 4)
    out["reward_se"] = round(statistics.stdev(per_seed) / math.sqrt(len(per_seed)), 4)
    out["draws"] = len(blocks)
    return out


def paired_difference(before: list[float], after: list[float]) -> dict:
    """Mean and standard error of ``after[i] - before[i]`` over paired games (same seeds, same
    order), and the difference in standard errors (``z``).

    Raises:
        ValueError: the lists differ in length or hold fewer than 2 games.
    """
    if len(before) != len(after) or len(before) < 2:
        raise ValueError(
            f"expected two evaluations of the same seeds (at least 2), found {len(before)} "
            f"and {len(after)} games; evaluate both on eval_seeds(count=...) with per_seed=True"
        )
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {
        "games": len(diffs),
        "reward_diff": round(mean, 4),
        "reward_diff_se": round(se, 4),
        "z": round(mean / se, 2) if se > 0 else None,
    }
