"""The states of a replica's sync loop and the transitions allowed between them, in one table.

The state's string value is what the replica reports: ``status`` in its heartbeat
(``replicas/<id>.json``, read by the dashboard and the trainer's fleet) and in ``GET /health``.
``SyncLoop`` changes state only through ``SyncLoop._set_state``, which checks this table.
"""

from __future__ import annotations

from enum import Enum


class SyncState(str, Enum):
    """What a replica's sync loop is doing (a ``str``: it compares and serializes as its value).

    Values:
        STARTING: nothing served from the bucket yet, and no error outstanding.
        SYNCING: applying verified deltas onto the version served (or, after a full reload,
            still behind the newest version).
        RECOVERING: loading whole tensors: a first version or a re-anchor, or a full reload
            after an apply failed inside vLLM (generation paused until it succeeds).
        OK: serving the newest version seen in the bucket.
        ERROR: the last poll, verification or apply failed (``last_error``); the replica serves
            the version it had, if any.
        STOPPED: ``SyncLoop.stop`` ran; final.
    """

    STARTING = "starting"
    SYNCING = "syncing"
    RECOVERING = "recovering"
    OK = "ok"
    ERROR = "error"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


S = SyncState
# Where each state may go next, besides staying where it is (setting the same state again).
TRANSITIONS: dict[SyncState, frozenset[SyncState]] = {
    # OK only after an apply: a first version goes through RECOVERING (or SYNCING)
    S.STARTING: frozenset({S.SYNCING, S.RECOVERING, S.ERROR, S.STOPPED}),
    S.SYNCING: frozenset({S.OK, S.RECOVERING, S.ERROR, S.STOPPED}),
    S.RECOVERING: frozenset({S.OK, S.SYNCING, S.ERROR, S.STOPPED}),
    S.OK: frozenset({S.SYNCING, S.RECOVERING, S.ERROR, S.STOPPED}),
    # back to STARTING only when an unreadable bucket is readable again before any version served
    S.ERROR: frozenset({S.STARTING, S.OK, S.SYNCING, S.RECOVERING, S.STOPPED}),
    S.STOPPED: frozenset(),
}
del S


class SyncStateError(RuntimeError):
    """A state change that ``TRANSITIONS`` does not allow (a bug in the loop, or a loop used
    after ``stop``)."""


def check_transition(old: SyncState, new: SyncState) -> None:
    """Raise unless the loop may go from ``old`` to ``new`` (always true when they are equal).

    Raises:
        SyncStateError: ``new`` is not in ``TRANSITIONS[old]``; the message lists the states
            allowed from ``old``.
    """
    if new is old or new in TRANSITIONS[old]:
        return
    allowed = ", ".join(sorted(s.value for s in TRANSITIONS[old])) or "none: it is final"
    hint = " (start a new SyncLoop)" if old is SyncState.STOPPED else ""
    raise SyncStateError(
        f"sync state {old.value!r} cannot change to {new.value!r}; expected one of: {allowed}{hint}"
    )
