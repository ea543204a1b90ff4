"""When a replica writes its heartbeat (``replicas/<id>.json``): rationed on remote stores.

A state change asks for a write at once; otherwise one is written every ``interval_s``. On a
remote store each write costs 2 Hub API requests, so there the interval is at least 60 s and no
two writes are closer than ``min_gap_s`` (60 s by default): a state change inside the gap waits,
and is written at the first check after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

REMOTE_MIN_S = 60.0  # remote stores: the shortest interval, and the default gap


class HeartbeatSchedule:
    """Decides when the next heartbeat is written.

    Args:
        interval_s: seconds between heartbeats while nothing changes.
        min_gap_s: least seconds between two writes, forced ones included.
        clock: monotonic seconds (tests pass a simulated clock).
    """

    def __init__(
        self, interval_s: float, min_gap_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.interval_s = interval_s
        self.min_gap_s = min_gap_s
        self._clock = clock
        self._last: float | None = None  # clock time of the last write
        self._pending = False  # a forced write waits for min_gap_s

    @classmethod
    def for_store(
        cls,
        remote: bool,
        interval_s: float,
        min_gap_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> HeartbeatSchedule:
        """The schedule for a local (folder, ``memory://``) or remote store: on a remote one the
        interval is at least 60 s and the gap defaults to 60 s; on a local one the interval is
        as given and the gap defaults to 0."""
        if min_gap_s is None:
            min_gap_s = REMOTE_MIN_S if remote else 0.0
        return cls(max(interval_s, REMOTE_MIN_S) if remote else interval_s, min_gap_s, clock)

    def due(self, force: bool = False) -> bool:
        """Whether a heartbeat is to be written now (``force``: the state changed). When it is,
        it counts as written now."""
        now = self._clock()
        since = float("inf") if self._last is None else now - self._last
        if force or self._pending:
            if since < self.min_gap_s:
                self._pending = True
                return False
        elif since < self.interval_s:
            return False
        self._last = now
        self._pending = False
        return True

    def next_due_s(self) -> float:
        """Seconds until a heartbeat is due (0: now): ``interval_s`` after the last write, or
        ``min_gap_s`` after it while a forced write waits."""
        if self._last is None:
            return 0.0
        wait = self.min_gap_s if self._pending else self.interval_s
        return max(0.0, self._last + wait - self._clock())

    def forget(self) -> None:
        """Make the next heartbeat due whatever the gap (the final ``stopped`` one)."""
        self._last = None
