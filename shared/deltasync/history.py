"""``VersionHistory``: the bf16 weights of a run's last few versions, rebuilt bit for bit from one
held copy and the old values of what each version changed.

An asynchronous trainer trains on samples that older versions generated (staleness k: the policy
k versions before the newest). To weigh such a sample by its generating policy, the trainer needs
that policy's weights exactly as published; keeping k full copies costs k x the model, while
between two versions only ~0.2-16% of the elements change (docs/BENCHMARKS.md sections 6 and 11).
The history follows the run like a replica (``DeltaSubscriber``: every delta verified against the
publisher's digests), holds the newest version's bits, and for each of the newest ``keep`` deltas
keeps the positions it changed and the bits they held before (6 bytes per changed element: int32
position, uint16 bits; a pretrained model at 0.2% density keeps a version in ~1% of a bf16 copy,
the local model at 16% in ~half of one).
Version ``v`` is the newest bits with the deltas after ``v`` undone, newest first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import DeltaSyncError, VersionNotKeptError
from .subscriber import DeltaSubscriber, HeldWeights, Patch


@dataclass
class _Undo:
    """What one delta changed: per tensor, the flat positions (int64) and their old bits."""

    base_version: int
    changes: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes + o.nbytes for i, o in self.changes.values())


class VersionHistory:
    """The newest version of a run and the ``keep`` versions before it, each rebuildable bit for
    bit (:meth:`weights_at`).

    Args:
        subscriber: a ``DeltaSubscriber`` on the run (the trainer's own bucket).
        keep: how many versions before the newest stay rebuildable (e.g. the run's
            ``max_staleness``).

    Raises (on construction):
        ValueError: ``keep`` below 0.
    """

    def __init__(self, subscriber: DeltaSubscriber, keep: int):
        if keep < 0:
            raise ValueError(f"keep: expected 0 or more versions, found {keep}")
        self.subscriber, self.keep = subscriber, keep
        self.held = HeldWeights()
        self._undo: OrderedDict[int, _Undo] = OrderedDict()  # version -> what its delta changed

    def update(self) -> int | None:
        """Follow the run to its newest version; returns it (None: nothing published yet).

        A version reached by a delta from the one held keeps its undo record; a jump by an
        anchor (the history fell behind retention, or the trainer restarted) forgets the older
        versions, which are then no longer rebuildable.

        Raises:
            the errors of ``DeltaSubscriber.sync``. A refused step (a damaged or missing delta)
            also forgets everything held: the next update re-plans from nothing, through the
            newest anchor, as a new replica would.
        """
        try:
            pulled = self.subscriber.sync(self.held)
        except DeltaSyncError:
            self.held, self._undo = HeldWeights(), OrderedDict()  # a step may have half-applied
            raise
        for step, applied in pulled:
            if step.kind == "anchor":
                self._undo.clear()
                continue
            patches: list[Patch] = applied
            changes = {p.name: (_compact(p.indices, p.shape), p.old_values) for p in patches}
            self._undo[step.version] = _Undo(step.base_version, changes)
            while len(self._undo) > self.keep:
                self._undo.popitem(last=False)
        return self.held.version

    def versions(self) -> list[int]:
        """The versions :meth:`weights_at` can rebuild, oldest first (the newest included)."""
        if self.held.version is None:
            return []
        # the undo records chain newest -> oldest: each one reaches its delta's base
        return sorted({u.base_version for u in self._undo.values()} | {self.held.version})

    def weights_at(self, version: int) -> dict[str, np.ndarray]:
        """The bf16 bits (np.uint16, the checkpoint's shapes) of every tensor at ``version``.
        Tensors no delta after ``version`` touched are the held arrays themselves (read-only
        views: do not write to them); the others are copies with the changes undone.

        Raises:
            VersionNotKeptError: ``version`` is not one of :meth:`versions`.
        """
        if version not in self.versions():
            raise VersionNotKeptError(
                f"version {version}: this history can rebuild {self.versions()} (the newest and "
                f"the {self.keep} before it, reached by deltas); raise keep, or follow the run "
                "version by version"
            )
        copies: dict[str, np.ndarray] = {}
        for v, undo in reversed(self._undo.items()):  # newest first
            if v <= version:
                break
            for name, (idx, old) in undo.changes.items():
                if name not in copies:
                    copies[name] = self.held.tensors[name].copy()
                copies[name].reshape(-1)[idx] = old
        out = {}
        for name, t in self.held.tensors.items():
            if name in copies:
                out[name] = copies[name]
            else:
                out[name] = t.view()
                out[name].flags.writeable = False
        return out

    def nbytes(self) -> int:
        """Bytes the undo records hold (what the history costs beyond the held weights)."""
        return sum(u.nbytes for u in self._undo.values())


def _compact(indices: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Flat positions as int32 where the tensor has fewer than 2**31 elements, else int64."""
    return indices.astype(np.int32) if int(np.prod(shape)) < 2**31 else indices
