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

import numpy as np

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


def turn_spans(completion_mask) -> list[tuple[int, int]]:
    """The ``[start, end)`` token ranges of the trained runs of ``completion_mask`` (one episode's
    ``(T,)`` 0/1 array): in a tool episode each run is one assistant turn, the tool replies and
    the turn headers between them untrained."""
    spans, start = [], None
    for i, m in enumerate(completion_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(completion_mask)))
    return spans


class TurnCredit:
    """TRL's rollout queue as the trainer sees it, with each episode's advantage spread over its
    turns: a token of turn ``t`` gets ``advantage + weight * (u_t - mean u)``, where ``u_t`` is
    the turn's own reward (``turn_rewards(sample.completion)``, the task's) and the mean is over
    the episode's turns that have one. Within an episode the added terms sum to zero over those
    turns, so the game's reward still sets how hard the whole episode is pushed, and the moves
    that lost reward are pushed down against the moves of the same game that earned it (GRPO
    alone gives every token of a game the same advantage, so a wrong move inside a good game is
    reinforced with it). Turn-level credit assignment after MT-GRPO (Zeng et al. 2025,
    arXiv:2505.11821), whose turn advantages are normalised across the group instead.

    The sample's ``advantage`` becomes a ``(T,)`` float32 array over its tokens (TRL's packer
    reads it per token through ``trainer.loop.trl_compat``); an episode with fewer than two
    rewarded turns, or whose turns do not match its trained runs one to one, keeps its scalar
    (``unmatched`` counts the latter).

    Args:
        inner: the queue TRL's dataset reads (``get`` returns a ``RolloutSample``: ``advantage``
            float, ``completion`` messages, ``completion_mask`` (T,) 0/1 array).
        turn_rewards: ``f(completion) -> [float | None]``, one entry per assistant message.
        weight: the turn term's weight (> 0), in the reward's units.
        metrics: the trainer's metric sink (TRL's ``trainer._metrics["train"]``, lists by key)
            or None: each episode appends to ``turn_credit/spread`` (1: its advantage became per
            token), ``turn_credit/unmatched`` and, where spread, ``turn_credit/term_abs_mean``
            (the mean ``|weight * (u_t - mean u)|`` over its rewarded turns), which TRL averages
            into each step's log (``logs/steps.jsonl``).
    """

    def __init__(self, inner, turn_rewards, weight: float, metrics=None):
        self._inner = inner
        self._turn_rewards = turn_rewards
        self.weight = float(weight)
        self.metrics = metrics
        self.spread = 0  # episodes whose advantage became per token
        self.unmatched = 0  # episodes whose assistant turns and trained runs differ in number

    def _record(self, spread: bool, unmatched: bool, term_abs: float | None = None) -> None:
        self.spread += spread
        self.unmatched += unmatched
        if self.metrics is not None:
            self.metrics["turn_credit/spread"].append(float(spread))
            self.metrics["turn_credit/unmatched"].append(float(unmatched))
            if term_abs is not None:
                self.metrics["turn_credit/term_abs_mean"].append(term_abs)

    def get(self, *args, **kwargs):
        sample = self._inner.get(*args, **kwargs)
        rewards = self._turn_rewards(list(sample.completion))
        spans = turn_spans(sample.completion_mask)
        if len(spans) != len(rewards):
            self._record(False, True)
            return sample
        known = [r for r in rewards if r is not None]
        if len(known) < 2:
            self._record(False, False)
            return sample
        mean = math.fsum(known) / len(known)
        adv = np.full(len(sample.completion_mask), float(sample.advantage), dtype=np.float32)
        for (start, end), r in zip(spans, rewards, strict=True):
            if r is not None:
                adv[start:end] += self.weight * (r - mean)
        sample.advantage = adv
        self._record(
            True, False, self.weight * math.fsum(abs(r - mean) for r in known) / len(known)
        )
        return sample

    def __getattr__(self, name):  # put_nowait, qsize, ... unchanged
        return getattr(self._inner, name)
