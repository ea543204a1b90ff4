"""A replica that fell behind catches up by the cheaper path in bytes: ``DeltaSubscriber.plan``
takes the anchor at the newest version when it is smaller than the delta chain from the held
version (dense steps), and the chain when that is smaller (sparse steps); either lands on the
trainer's bits. bench/bench_catch_up.py measures the same choice at real sizes."""

import numpy as np
import pytest

from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.subscriber import DeltaSubscriber, HeldWeights


@pytest.mark.parametrize(("lr", "path"), [(1e-2, "anchor"), (1e-7, "chain")])
def test_replica_behind_takes_the_cheaper_path(bucket, trainer, lr, path):
    cfg = PublisherConfig(anchor_every=4, anchor_replay_fraction=1e9)  # anchors at v0 and v4
    sub = DeltaSubscriber(bucket)
    held = HeldWeights()
    with DeltaPublisher(bucket, config=cfg) as pub:
        pub.publish(trainer.named(), step=0)
        pub.flush()
        sub.sync(held)  # the replica holds v0, then falls 4 versions behind
        for step in range(1, 5):
            trainer.step(lr)
            pub.publish(trainer.named(), step=step)
            pub.flush()
    manifest = sub.read_manifest()
    chain_bytes = sum(manifest.entry(v).delta.bytes for v in range(1, 5))
    anchor_bytes = manifest.entry(4).anchor.bytes
    assert (anchor_bytes < chain_bytes) == (path == "anchor"), (anchor_bytes, chain_bytes)

    plan = sub.plan(held.version, manifest)
    expected = [("anchor", 4)] if path == "anchor" else [("delta", v) for v in range(1, 5)]
    assert [(s.kind, s.version) for s in plan.steps] == expected
    assert plan.bytes == min(anchor_bytes, chain_bytes)
    sub.sync(held)
    assert held.version == 4
    assert all(np.array_equal(held.tensors[n], b) for n, b in trainer.bits().items())
    sub.close()
