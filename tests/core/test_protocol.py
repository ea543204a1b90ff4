"""The sync protocol end to end on file:// and memory:// stores: DeltaPublisher -> bucket ->
DeltaSubscriber. Chains, anchors, retention, restart, coalescing, concurrent writers, crash
between payload and manifest, corrupt files and wrong bases."""

import numpy as np
import pytest

from deltasync.errors import (
    BaseVersionMismatch,
    ConcurrentWriterError,
    DeltaCorruptError,
    ModelMismatchError,
)
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.store import Store
from deltasync.subscriber import DeltaSubscriber, HeldWeights, apply_patches, merge_patches


def equal(held: HeldWeights, bits: dict) -> bool:
    return set(held.tensors) == set(bits) and all(
        np.array_equal(held.tensors[n], b) for n, b in bits.items()
    )


def publish_steps(pub, trainer, n, flush_each=True):
    truth = {}
    for i in range(n):
        trainer.step()
        v = pub.publish(trainer.named(), step=i)
        truth[v] = trainer.bits()
        if flush_each:
            pub.flush()
    return truth


def test_follow_chain_bit_exact(bucket, trainer):
    cfg = PublisherConfig(anchor_every=4, keep_anchors=3, anchor_replay_fraction=1e9)
    sub = DeltaSubscriber(bucket)
    held = HeldWeights()
    with DeltaPublisher(bucket, config=cfg) as pub:
        truth = {pub.publish(trainer.named(), step=0): trainer.bits()}
        pub.flush()
        for _ in range(3):
            truth.update(publish_steps(pub, trainer, 3))
            done = sub.sync(held)
            assert held.version == max(truth)
            assert equal(held, truth[held.version])
            assert all(s.kind == "delta" for s, _ in done[1:])
    m = sub.read_manifest()
    assert [v.version for v in m.versions] == sorted(truth)
    assert sum(1 for v in m.versions if v.anchor) == 3  # v0, v4, v8
    # a fresh replica replays from the newest anchor and lands on the same bits
    fresh = HeldWeights()
    steps = sub.sync(fresh)
    assert steps[0][0].kind == "anchor" and steps[0][0].version == 8
    assert fresh.version == held.version and equal(fresh, truth[fresh.version])


def test_replay_from_anchor_equals_direct(bucket, trainer):
    """Patches of a chain folded into one equal the direct difference from the start version."""
    sub = DeltaSubscriber(bucket)
    with DeltaPublisher(
        bucket, config=PublisherConfig(anchor_every=100, anchor_replay_fraction=1e9)
    ) as pub:
        pub.publish(trainer.named(), step=0)
        pub.flush()
        held = HeldWeights()
        sub.sync(held)
        start = {n: a.copy() for n, a in held.tensors.items()}
        truth = publish_steps(pub, trainer, 5)
    done = sub.sync(held)
    merged = merge_patches(held, [p for _, p in done])
    replica = {n: a.copy() for n, a in start.items()}
    apply_patches(replica, merged)
    final = truth[max(truth)]
    for n in final:
        assert np.array_equal(replica[n], final[n])
        direct = np.flatnonzero(start[n].reshape(-1) != final[n].reshape(-1))
        got = next((p.indices for p in merged if p.name == n), np.zeros(0, np.int64))
        assert set(direct) <= set(got)  # union may include elements that changed back


def test_retention_keeps_what_replay_needs(bucket, trainer):
    cfg = PublisherConfig(anchor_every=3, keep_anchors=2, anchor_replay_fraction=1e9)
    with DeltaPublisher(bucket, config=cfg) as pub:
        pub.publish(trainer.named(), step=0)
        truth = publish_steps(pub, trainer, 10)
    store = Store(bucket)
    m = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    anchors = [v.version for v in m.versions if v.anchor]
    assert len(anchors) == 2
    assert m.versions[0].version == anchors[0]  # nothing older than the oldest kept anchor
    named = {f.path for v in m.versions for p in (v.delta, v.anchor) if p for f in p.files}
    on_disk = {p for p in store.ls("anchors") + store.ls("deltas")}
    assert on_disk == named  # dropped versions' files were deleted, kept ones are all there
    sub = DeltaSubscriber(store)
    for start in anchors:  # replay from each kept anchor reaches the newest bits
        held = HeldWeights()
        sub.plan(None, m, target=start)
        sub.sync(held, target=start)
        sub.sync(held)
        assert equal(held, truth[m.latest.version])


def test_restart_continues_sequence_with_anchor(bucket, trainer):
    sub = DeltaSubscriber(bucket)
    held = HeldWeights()
    with DeltaPublisher(bucket, run_id="r1") as pub:
        pub.publish(trainer.named(), step=0)
        last = max(publish_steps(pub, trainer, 3))
    sub.sync(held)
    assert held.version == last
    with DeltaPublisher(bucket, run_id="r1") as pub2:
        trainer.step()
        v = pub2.publish(trainer.named(), step=10)
        assert v == last + 1
        pub2.flush()
        entry = pub2.manifest.latest
        assert entry.anchor is not None and entry.delta is None
        v2 = pub2.publish(trainer.named(), step=11)
    done = sub.sync(held)
    assert [s.kind for s, _ in done] == ["anchor", "delta"]
    assert held.version == v2 and equal(held, trainer.bits())


def test_second_writer_refused(bucket, trainer):
    with DeltaPublisher(bucket) as pub:
        pub.publish(trainer.named())
        with pytest.raises(ConcurrentWriterError, match="takeover"):
            DeltaPublisher(bucket)


def test_model_mismatch_refused(bucket, trainer):
    with DeltaPublisher(bucket) as pub:
        pub.publish(trainer.named())
        bad = trainer.named()
        bad[0] = (bad[0][0], bad[0][1][:-1])
        with pytest.raises(ModelMismatchError, match="wrong shape"):
            pub.publish(bad)
        with pytest.raises(ModelMismatchError, match="missing"):
            pub.publish(trainer.named()[1:])
        pub.publish(trainer.named())  # the publisher keeps working after bad input


def test_coalescing_when_uploads_fall_behind(bucket, trainer):
    import threading

    gate, entered = threading.Event(), threading.Event()
    pub = DeltaPublisher(bucket)

    def slow_commit(entry):  # the public seam: v0's commit waits on the gate
        entered.set()
        gate.wait(10)

    pub.before_commit = slow_commit
    v0 = pub.publish(trainer.named(), step=0)
    assert entered.wait(10)  # v0 is being uploaded (blocked on the gate): later ones queue
    truth = {}
    for s in range(1, 6):
        trainer.step()
        truth[pub.publish(trainer.named(), step=s)] = trainer.bits()
    gate.set()
    pub.close()
    m = Manifest.from_json(Store(bucket).read_bytes(MANIFEST_PATH))
    versions = [v.version for v in m.versions]
    assert versions[0] == v0 and versions[-1] == max(truth)
    assert len(versions) < 1 + len(truth)  # pending versions were folded together
    assert sum(v.coalesced for v in m.versions) == len(truth) + 1 - len(versions)
    held = HeldWeights()
    DeltaSubscriber(bucket).sync(held)
    assert equal(held, truth[max(truth)])


def test_crash_between_payload_and_manifest_keeps_previous_version(bucket, trainer):
    sub = DeltaSubscriber(bucket)
    pub = DeltaPublisher(bucket, config=PublisherConfig(lease_s=600))
    pub.publish(trainer.named(), step=0)
    good = max(publish_steps(pub, trainer, 2))
    good_bits = trainer.bits()
    real_write = pub.store.write_bytes

    def crash_on_manifest(path, data):
        if path == MANIFEST_PATH:
            raise OSError("simulated crash before the manifest commit")
        real_write(path, data)

    pub.store.write_bytes = crash_on_manifest
    trainer.step()
    pub.publish(trainer.named(), step=9)
    with pytest.raises(OSError, match="simulated"):
        pub.flush()
    store = Store(bucket)
    assert any(p.startswith(f"deltas/v{good + 1:010d}") for p in store.ls("deltas"))  # orphan
    held = HeldWeights()
    sub.sync(held)
    assert held.version == good and equal(held, good_bits)
    # a restarted trainer takes over, removes the orphan and continues the sequence
    pub2 = DeltaPublisher(bucket, config=PublisherConfig(takeover=True))
    assert not any(p.startswith(f"deltas/v{good + 1:010d}") for p in store.ls("deltas"))
    with pub2:
        assert pub2.publish(trainer.named(), step=10) == good + 1
    sub.sync(held)
    assert held.version == good + 1 and equal(held, trainer.bits())


def test_corrupt_file_and_wrong_base_never_apply(bucket, trainer):
    sub = DeltaSubscriber(bucket)
    held = HeldWeights()
    with DeltaPublisher(bucket) as pub:
        pub.publish(trainer.named(), step=0)
        pub.flush()
        sub.sync(held)
        truth = publish_steps(pub, trainer, 2)
    m = sub.read_manifest()
    plan = sub.plan(held.version, m)
    first, second = plan.steps
    before = {n: a.copy() for n, a in held.tensors.items()}
    # wrong base: the second delta on the version-0 weights
    with pytest.raises(BaseVersionMismatch, match="holds v0"):
        sub.decode_into(sub.fetch(second), held, m)
    # a flipped byte in the payload: the file digest catches it
    store = Store(bucket)
    path = first.files[0].path
    data = bytearray(store.read_bytes(path))
    data[-3] ^= 0x40
    store.write_bytes(path, bytes(data))
    with pytest.raises(DeltaCorruptError, match="xxh3"):
        sub.fetch(first)
    store.write_bytes(path, bytes(data[:-3]) + bytes([data[-3] ^ 0x40]) + bytes(data[-2:]))
    # a replica whose base bits diverged: the result digest catches it
    name = next(iter(held.tensors))
    held.tensors[name].reshape(-1)[0] ^= 1
    with pytest.raises(DeltaCorruptError, match="digest"):
        sub.decode_into(sub.fetch(first), held, m)
    held.tensors[name].reshape(-1)[0] ^= 1
    assert held.version == 0 and equal(held, before)  # nothing applied by the failures
    sub.sync(held)
    assert equal(held, truth[max(truth)])


def test_before_commit_sees_each_version_after_upload_and_before_the_manifest(tmp_path):
    """The publisher's public fault seam: the hook runs once per version, when the payload is in
    the bucket and the manifest does not name it yet; what it damages, readers then refuse."""
    import numpy as np

    from deltasync.manifest import MANIFEST_PATH, Manifest
    from deltasync.publisher import DeltaPublisher
    from deltasync.store import Store

    store = Store(str(tmp_path / "bucket"))
    pub = DeltaPublisher(store)
    seen = []

    def hook(entry):
        named = (
            Manifest.from_json(store.read_bytes(MANIFEST_PATH)).versions
            if store.exists(MANIFEST_PATH)
            else []
        )
        payload = (entry.anchor or entry.delta).files[0].path
        committed = entry.version in [v.version for v in named]
        seen.append((entry.version, store.exists(payload), committed))

    pub.before_commit = hook
    w = np.arange(64, dtype=np.uint16)
    pub.publish([("w", w.copy())])
    pub.flush()
    w[3] ^= 1
    pub.publish([("w", w.copy())])
    pub.close()
    assert seen == [(0, True, False), (1, True, False)]


def test_newest_published_is_this_publishers_own(tmp_path):
    """``newest_published``: None before this publisher's first version (even over a manifest an
    earlier writer left), then the version it committed last."""
    import numpy as np

    from deltasync.publisher import DeltaPublisher

    bits = {"w": np.arange(64, dtype=np.uint16)}
    first = DeltaPublisher(str(tmp_path))
    first.publish(bits.items(), step=0)
    first.close()
    again = DeltaPublisher(str(tmp_path))
    assert again.latest_committed == 0 and again.newest_published is None
    bits["w"][3] += 1
    v = again.publish(bits.items(), step=1)
    again.flush()
    assert again.newest_published == v == 1
    again.close()
