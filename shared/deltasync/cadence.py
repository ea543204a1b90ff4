"""``PublishCadence``: how many weight syncs between publishes, chosen from the Hub's request budget.

The Hub limits each token per fixed 5-minute window (free: 1,000 API + 5,000 resolver requests;
PRO 2,500 / 12,000; Team 3,000 / 20,000; Enterprise 6,000 / 50,000: the Hub docs' rate limits,
/work/shared/NOTES-hub-openenv.md, docs/SCALE.md "Hub request budget"). A publish costs about 4 API
requests (two ``batch_bucket_files`` calls), so at a 1 s step the publisher alone made 1,178 API
requests per 5 minutes, over the free tier (docs/BENCHMARKS.md section 13).

The cadence publishes every ``k``-th sync. From the store's request counter
(``deltasync.store.RequestCount``) and its own clock it measures, over a sliding window, the
requests per publish and the syncs per second, and projects the share of the limit that a cadence
``k`` would use in 5 minutes. Over ``target_share`` it raises ``k`` at once to the smallest that
fits; it lowers ``k`` only while the projection for a lower ``k`` stays under ``low_share``
(hysteresis), and never within ``hold_s`` of a 429. A 429 (:meth:`throttled`) doubles ``k``. While
the requests of the last 5 minutes already reach the target, a due publish waits (the rates are
not known at the start, nor right after a change of pace). The
skipped syncs are not diffed nor uploaded: the next publish diffs against the last published
bits, so every version stays bit-exact.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable

from .errors import DeltaSyncError

log = logging.getLogger("deltasync.publisher")

WINDOW_S = 300.0  # the Hub's rate-limit window
# plan -> (API, resolver) requests per token per 5-minute window (Hub docs, rate limits)
HUB_PLANS: dict[str, tuple[int, int]] = {
    "free": (1000, 5000),
    "pro": (2500, 12000),
    "team": (3000, 20000),
    "enterprise": (6000, 50000),
}


class HubPlanError(DeltaSyncError, ValueError):
    """A ``hub_plan`` that is neither a plan's name nor a positive number of requests."""


def plan_limits(plan: str | int) -> tuple[int, int | None]:
    """(API, resolver) requests per 5 minutes of ``plan``: a name in :data:`HUB_PLANS`, or the
    API requests per 5 minutes as an integer (the resolver limit is then not enforced: None).

    Raises:
        HubPlanError: an unknown name, or a number below 1.
    """
    text = str(plan).strip().lower()
    if text in HUB_PLANS:
        return HUB_PLANS[text]
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise HubPlanError(
            f"hub_plan: expected one of {sorted(HUB_PLANS)} or the token's API requests per "
            f"5 minutes (an integer >= 1), found {plan!r}; fix: --hub-plan free (the default), "
            "--hub-plan pro, or e.g. --hub-plan 1500"
        )
    return n, None


class PublishCadence:
    """Chooses ``k``, the syncs between publishes (see the module docstring).

    Args:
        requests_fn: the store's cumulative (API, resolver) requests (``RequestCount.snapshot``).
        plan: see :func:`plan_limits`.
        target_share: the share of the limit the publisher aims at (the rest: the trainer's
            fleet discovery and metrics writes on the same token, and headroom).
        low_share: ``k`` is lowered only while the lower ``k`` projects under this share.
        floor, ceiling: bounds of ``k`` (ceiling None: none).
        window_s: the sliding window the rates are measured over.
        min_span_s, min_publishes: the evidence needed before ``k`` changes.
        hold_s: no lowering for this long after a 429.
        clock: monotonic seconds (a simulated clock in tests).

    Attributes:
        k: the current cadence; ``ks``: every value ``k`` took, in order (the first is ``floor``).
        throttles: 429s reported by :meth:`throttled`.
        deferred: due publishes put off because the window's requests reached the target.
    """

    def __init__(
        self,
        requests_fn: Callable[[], tuple[int, int]],
        plan: str | int = "free",
        target_share: float = 0.8,
        low_share: float = 0.6,
        floor: int = 1,
        ceiling: int | None = None,
        window_s: float = WINDOW_S,
        min_span_s: float = 10.0,
        min_publishes: int = 3,
        hold_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < low_share < target_share <= 1:
            raise ValueError(
                f"expected 0 < low_share < target_share <= 1, found {low_share}, {target_share}"
            )
        if floor < 1 or (ceiling is not None and ceiling < floor):
            raise ValueError(f"expected 1 <= floor <= ceiling, found {floor}, {ceiling}")
        self.limits = plan_limits(plan)
        self.requests_fn = requests_fn
        self.target_share, self.low_share = target_share, low_share
        self.floor, self.ceiling = floor, ceiling
        self.window_s, self.min_span_s, self.min_publishes = window_s, min_span_s, min_publishes
        self.hold_s, self.clock = hold_s, clock
        self.k = floor
        self.ks = [floor]
        self.throttles = 0
        self.deferred = 0  # due publishes put off as the window's requests reached the target
        self._since = 0  # syncs since the last publish
        self._syncs = 0
        self._publishes = 0
        self._hold_until = float("-inf")
        self._per_publish: tuple[float, float] | None = None  # (API, resolver) per publish
        # (t, syncs, publishes, api, resolver), oldest first
        self._samples: collections.deque = collections.deque()

    # ------------------------------------------------------------------------------ decisions
    def due(self) -> bool:
        """Count one sync; whether it is published (the first always is). Re-chooses ``k``
        from the window first."""
        self._syncs += 1
        self._sample()
        self._choose()
        self._since += 1
        if self._publishes == 0 or (self._since >= self.k and not self._spent()):
            self._since = 0
            self._publishes += 1
            return True
        return False

    def _spent(self) -> bool:
        """Whether the requests of the last ``window_s`` already reach the target share (then a
        due publish waits for the next sync): bounds any 5-minute window, the Hub's fixed ones
        too, by the target plus one publish, also before the rates are known."""
        if len(self._samples) < 2:
            return False
        _, _, _, a0, r0 = self._samples[0]
        _, _, _, a1, r1 = self._samples[-1]
        api_lim, res_lim = self.limits
        spent = (
            (a1 - a0) / api_lim if not res_lim else max((a1 - a0) / api_lim, (r1 - r0) / res_lim)
        )
        if spent >= self.target_share:
            self.deferred += 1
            return True
        return False

    def throttled(self, retry_after_s: float | None = None) -> int:
        """A 429 reached the publisher: double ``k`` (within the ceiling) and hold it for
        ``hold_s``; returns the new ``k``."""
        self.throttles += 1
        self._hold_until = self.clock() + self.hold_s
        self._set(self._bounded(2 * self.k), f"HTTP 429 (Retry-After {retry_after_s}s)")
        return self.k

    def share(self, k: int) -> float | None:
        """The projected share of the limit a cadence ``k`` uses (the larger of API and
        resolver), from the window; None before there is enough evidence."""
        if len(self._samples) < 2:
            return None
        t0, s0, p0, a0, r0 = self._samples[0]
        t1, s1, p1, a1, r1 = self._samples[-1]
        span, publishes = t1 - t0, p1 - p0
        if span < self.min_span_s:
            return None
        if publishes >= self.min_publishes:  # else (few publishes at a slow rate): the last cost
            self._per_publish = ((a1 - a0) / publishes, (r1 - r0) / publishes)
        if self._per_publish is None:
            return None
        syncs_per_window = (s1 - s0) / span * WINDOW_S
        (api_lim, res_lim), (api, res) = self.limits, self._per_publish
        shares = [api * syncs_per_window / k / api_lim]
        if res_lim:
            shares.append(res * syncs_per_window / k / res_lim)
        return max(shares)

    def _sample(self) -> None:
        now = self.clock()
        api, resolver = self.requests_fn()
        self._samples.append((now, self._syncs, self._publishes, api, resolver))
        # keep one sample at or before the window's start, so the span covers the window
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def _choose(self) -> None:
        share = self.share(1)
        if share is None:
            return
        # share(k) = share(1) / k
        if share / self.k > self.target_share:
            need = math.ceil(share / self.target_share)
            self._set(self._bounded(need), f"{share / self.k:.0%} of the limit projected")
        elif self.k > self.floor and self.clock() >= self._hold_until:
            lower = self._bounded(max(self.floor, math.ceil(share / self.low_share)))
            if lower < self.k:
                self._set(lower, f"{share / lower:.0%} of the limit projected at k={lower}")

    def _bounded(self, k: int) -> int:
        k = max(self.floor, k)
        return k if self.ceiling is None else min(self.ceiling, k)

    def _set(self, k: int, why: str) -> None:
        if k == self.k:
            return
        api, res = self.limits
        log.info(
            "publish cadence: every %d sync(s), was %d (%s; limit %d API%s requests per 5 min, "
            "aiming at %.0f%%)",
            k,
            self.k,
            why,
            api,
            f" / {res} resolver" if res else "",
            100 * self.target_share,
        )
        self.k = k
        self.ks.append(k)

    def summary(self) -> dict:
        """``{"publish_every": {"min", "max", "last", "changes"}, "throttles": n}``."""
        return {
            "publish_every": {
                "min": min(self.ks),
                "max": max(self.ks),
                "last": self.k,
                "changes": len(self.ks) - 1,
            },
            "throttles": self.throttles,
            "deferred": self.deferred,
        }
