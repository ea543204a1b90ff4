"""Publishing from a trainer whose parameters are spread over ranks (FSDP2, DDP): one version per
optimizer step, each rank diffing only what it holds.

Every rank calls :meth:`ShardedPublisher.publish` with its ``model.named_parameters()`` (a
collective: same names, same order). A ``DTensor`` sharded on dim 0 of a 1-D mesh (FSDP2's layout)
is diffed by every rank on its local shard, on the shard's device; a plain tensor (replicated, as
under DDP) is diffed by rank 0 alone. Each change is 12 bytes (int64 position in the full tensor,
old and new bf16 bits), so at 1% density the ranks send rank 0 about 0.12 bytes per parameter,
where gathering full parameters moves 2 bytes per parameter; rank 0 never holds the model on its
device, only the host snapshot the encoder needs. Rank 0 commits the version through
:meth:`DeltaPublisher.publish_changes`; the first version is an anchor of full tensors, gathered
once with ``DTensor.full_tensor()``.

A trainer that already hands rank 0 full tensors (TRL's AsyncGRPOTrainer gathers them for its
``weight_transfer.send_weights``) uses :class:`~deltasync.publisher.DeltaPublisher` on rank 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from . import codec
from .bf16 import to_bf16_bits
from .publisher import DeltaPublisher, PublisherConfig
from .snapshot import Snapshot


def _local_piece(t: Any) -> tuple[Any, int] | None:
    """(the local shard, flat offset of its first element in the full tensor) for a DTensor
    sharded on dim 0 of a 1-D mesh; None for a plain tensor.

    Raises:
        ValueError: any other DTensor layout (2-D meshes, Shard(d > 0), partial placements).
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    if mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ValueError(
            f"expected a DTensor sharded on dim 0 of a 1-D mesh (FSDP2's layout), found "
            f"placements {t.placements} on a {mesh.ndim}-D mesh; gather it with full_tensor() and "
            "publish full tensors with DeltaPublisher on rank 0"
        )
    _, row = Shard.local_shard_size_and_offset(t.shape[0], mesh.size(), mesh.get_local_rank())
    return t.to_local(), int(row) * math.prod(t.shape[1:])


class ShardedPublisher:
    """A :class:`DeltaPublisher` on rank 0, fed by the diffs of every rank's shards.

    Args:
        store, run_id, config: as for :class:`DeltaPublisher` (used on rank 0 only; the
            config's ``diff_on`` also picks where each rank diffs its shards).
        group: the ``torch.distributed`` process group (default: the world).
        adapter: must be None: adapter runs publish from one process (``DeltaPublisher``).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: an ``adapter`` was given.
        The errors of :class:`DeltaPublisher` (on rank 0).
    """

    def __init__(self, store, run_id: str | None = None, config=None, group=None, adapter=None):
        if adapter is not None:
            raise ValueError(
                "ShardedPublisher publishes full weights only, found an adapter; publish a LoRA "
                "adapter from rank 0 with DeltaPublisher(store, adapter=...) (the adapter's "
                "tensors are small enough to gather)"
            )
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ShardedPublisher needs torch.distributed.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.config = config or PublisherConfig()
        # rank 0's publisher only advances its host snapshot by the gathered changes
        host = dataclasses.replace(self.config, diff_on="host")
        self.publisher = DeltaPublisher(store, run_id, host) if self.rank == 0 else None
        self._mine = Snapshot(self.config.diff_on)  # the pieces this rank diffs
        self._offsets: dict[str, int] = {}
        self._started = False

    def publish(self, named_tensors, step: int | None = None) -> int:
        """Diff every rank's pieces and commit one version on rank 0 (collective).

        Args:
            named_tensors: this rank's (checkpoint name, parameter) pairs: DTensors sharded on
                dim 0 and plain tensors, in the same order on every rank.
            step: the optimizer step, recorded in the manifest.

        Returns:
            The version number, on every rank.

        Raises:
            On rank 0 the publisher's error; on the other ranks a RuntimeError naming it (rank 0
            broadcasts its outcome, so no rank is left waiting in a collective).
        """
        import torch.distributed as dist

        named = list(named_tensors)
        pieces, sharded = [], set()
        for name, t in named:
            local = _local_piece(t)
            if local is not None:
                pieces.append((name, local[0]))
                self._offsets[name] = local[1]
                sharded.add(name)
            elif self.rank == 0:
                pieces.append((name, t))
                self._offsets[name] = 0
        error: Exception | None = None
        if not self._started:  # the anchor: full tensors, gathered one at a time
            self._mine.reset(pieces)
            full = []
            for n, t in named:
                whole = t.full_tensor() if n in sharded else t
                if self.rank == 0:
                    full.append((n, to_bf16_bits(whole)))  # a host copy; the device's is freed
            try:
                version = self.publisher.publish(full, step) if self.publisher else None
            except Exception as e:  # broadcast below, then raised on every rank
                version, error = None, e
            self._started = error is None
        else:
            changes = self._mine.diff(pieces)
            found = [
                (n, ch.idx + self._offsets[n], ch.old_bits, ch.new_bits)
                for n, ch in changes.items()
            ]
            gathered = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
            dist.gather_object(found, gathered, dst=0, group=self.group)
            version = None
            if self.publisher is not None:
                try:
                    version = self.publisher.publish_changes(merge(gathered), step)
                except Exception as e:  # broadcast below, then raised on every rank
                    error = e
        out = [version if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(out, src=0, group=self.group)
        if error is not None:
            raise error
        if isinstance(out[0], str):
            raise RuntimeError(f"rank 0 failed to publish: {out[0]}")
        return out[0]

    def flush(self, timeout: float | None = None) -> None:
        """Rank 0: wait until every queued version is committed (other ranks: nothing)."""
        if self.publisher is not None:
            self.publisher.flush(timeout)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


def merge(per_rank: list[list[tuple]]) -> dict[str, codec.TensorChange]:
    """Join the ranks' changes (lists of (name, idx, old, new)) into one TensorChange per tensor,
    positions ascending (shards hold disjoint ranges, so sorting once suffices)."""
    by_name: dict[str, list[tuple]] = {}
    for found in per_rank:
        for name, idx, old, new in found:
            by_name.setdefault(name, []).append((idx, old, new))
    out = {}
    for name, parts in by_name.items():
        idx = np.concatenate([p[0] for p in parts])
        old = np.concatenate([p[1] for p in parts])
        new = np.concatenate([p[2] for p in parts])
        order = np.argsort(idx, kind="stable")
        out[name] = codec.TensorChange(idx[order], old[order], new[order])
    return out
