"""The learning curve of a run: held-out evaluations through the replica while GRPO trains, and the
paired comparison of the first and the last.

:class:`EvalEvery` is a ``transformers.TrainerCallback`` that, every ``every`` optimizer steps,
waits until the replica serves the newest published version and plays the held-out games through
it (``trainer.task.evaluate``). Training waits meanwhile (the rollout worker keeps its bounded queue),
so the evaluation does not share the CPU with a training step. :func:`paired_difference` compares
two evaluations of the same seeds game by game: the same word is played before and after, so the
per-seed difference removes the words' own difficulty from the standard error.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from transformers import TrainerCallback


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
