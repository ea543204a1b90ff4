"""TRL's ``weight_transfer=`` backed by the bucket: each sync publishes a delta.

AsyncGRPOTrainer (trl 1.16) calls ``pause()``, ``send_weights(iterator)``, ``resume()`` around
every weight sync. Here ``send_weights`` hands the named parameters to a
:class:`deltasync.publisher.DeltaPublisher`: the training loop waits only for the diff against the
last published snapshot; encoding and upload continue on the publisher's thread. ``pause`` and
``resume`` do nothing: replicas pull from the bucket on their own schedule and pause themselves
only for the in-memory apply.

In an adapter run (``adapter_fn`` given) each sync publishes the LoRA adapter's tensors only (PEFT
names, ``trainer.loop.adapter``); TRL's stream of the merged base weights is not read, so no base
tensor is copied or published. With one trainer process nothing waits on that stream (under
FSDP2 it would be a collective: adapter runs refuse several processes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from deltasync.publisher import DeltaPublisher

log = logging.getLogger("trainer.loop.bucket_transfer")


class BucketWeightTransfer:
    """Implements TRL's ``WeightTransferProtocol`` on a DeltaPublisher.

    Args:
        publisher: the run's publisher (owned by the caller, closed by :meth:`destroy`).
        step_fn: returns the trainer's current optimizer step (recorded in the manifest).
        first_apply_fn: called with the first published version after it is committed, e.g. to
            wait until a local replica serves it before TRL starts requesting rollouts.
        adapter_fn: adapter runs: returns the adapter's tensors to publish ({PEFT key: tensor},
            ``trainer.loop.adapter.adapter_tensors``); TRL's streamed iterator is then ignored.
            None: publish what TRL streams (full weights).
    """

    def __init__(
        self,
        publisher: DeltaPublisher,
        step_fn=lambda: None,
        first_apply_fn=None,
        adapter_fn=None,
    ):
        self.publisher = publisher
        self.step_fn = step_fn
        self.first_apply_fn = first_apply_fn
        self.adapter_fn = adapter_fn
        self.last_version: int | None = None
        self.syncs = 0
        self.skipped = 0  # syncs the publisher's cadence did not publish
        self.diff_s: list[float] = []

    def init_weight_transfer(self) -> None:
        """Nothing to set up: the bucket is the transport."""

    def pause(self) -> None:
        """No-op: replicas are never paused by the trainer."""

    def resume(self) -> None:
        """No-op: see :meth:`pause`."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish the model as the next version; returns once the diff is done.

        Args:
            iterator: (HF checkpoint name, tensor) for every parameter, as TRL streams them; not
                read in an adapter run (the adapter's tensors from ``adapter_fn`` are published).

        Raises:
            The error that stopped the publisher (refused credentials, a missing bucket,
            another writer: ``DeltaPublisher.publish``). A store that fails for a while raises
            nothing: training goes on and the publisher waits it out (``publisher.outage``,
            shown on the step line by ``trainer.loop.metrics``); the first sync waits for its
            commit, as a replica needs it.
        """
        t0 = time.perf_counter()
        if self.publisher.cadence is not None and not self.publisher.cadence_due():
            # the publisher's cadence (hf:// buckets: the token's request budget) skips this
            # sync: the next publish carries its changes; TRL's stream is still read through.
            # The first sync is counted too (the cadence always publishes it)
            for _ in iterator if self.adapter_fn is None else ():
                pass
            self.syncs += 1
            self.skipped += 1
            return
        if self.adapter_fn is None:
            named = [(name, t.detach()) for name, t in iterator]
        else:
            named = list(self.adapter_fn().items())
        self.last_version = self.publisher.publish(named, step=self.step_fn())
        self.syncs += 1
        if self.syncs == 1 and self.first_apply_fn is not None:
            self.publisher.flush()
            self.first_apply_fn(self.last_version)
        self.diff_s.append(time.perf_counter() - t0)
        log.debug("published v%d (diff %.3fs)", self.last_version, self.diff_s[-1])

    def destroy(self) -> None:
        """Flush the last publish and release the writer lease."""
        self.publisher.close()
