"""How a GRPO group's rewards become advantages: TRL's group-normalised one, or centred only.

TRL 1.16's async rollout worker gives each episode ``(r - mean) / (std + 1e-8)`` over its GRPO
group (``AsyncRolloutWorker._score_group``), with no option to leave out the division; TRL's
synchronous ``GRPOConfig`` has one (``scale_rewards``: ``"group"``, ``"batch"``, ``"none"``).
Dividing by the group's standard deviation gives a group whose games differ by a yellow letter
the same weight as a group where one game won: Wordle's partial credit makes most groups of the
local run such near-ties, so most of the gradient is noise (Liu et al. 2025, "Understanding
R1-Zero-Like Training", arXiv:2503.20783, section 3.1: the std term biases GRPO toward groups of
near-equal reward). :class:`CentredAdvantages` undoes the division as the trainer takes each sample
from TRL's queue, leaving ``r - mean`` (``scale_rewards="none"``).
"""

from __future__ import annotations

import math

SCALES = ("group", "none")  # TRL GRPOConfig.scale_rewards values this run supports
_EPS = 1e-8  # the epsilon TRL adds to the group's std (async_rollout_worker.py)


class CentredAdvantages:
    """TRL's rollout queue as the trainer sees it, with each sample's advantage multiplied back by
    its group's ``std + 1e-8`` (TRL's epsilon): ``advantage = reward - group mean``.

    Args:
        inner: the queue TRL's dataset reads (``trainer.rollout_queue``); ``get`` returns TRL's
            ``RolloutSample`` (``advantage``: float; ``metrics["reward_std"]``: the group's
            population std of the rewards, NaN when no episode of the group was scored).
    """

    def __init__(self, inner):
        self._inner = inner

    def get(self, *args, **kwargs):
        sample = self._inner.get(*args, **kwargs)
        std = sample.metrics.get("reward_std")
        if isinstance(std, (int, float)) and math.isfinite(std):
            sample.advantage = float(sample.advantage) * (float(std) + _EPS)
        return sample

    def __getattr__(self, name):  # put_nowait, qsize, ... unchanged
        return getattr(self._inner, name)
