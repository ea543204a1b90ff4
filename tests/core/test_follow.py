"""The one follow loop (``deltasync.follow.Follower``): a follower running on its own thread ends
on the publisher's bits; a damaged delta is refused (raised, or reported for a long-lived reader),
never applied, and routed around through the next anchor; a part whose metadata is malformed is
downloaded once, refused, and never downloaded again; the poll interval backs off while
nothing changes and snaps back when a version appears."""

import json
import struct
import threading
import time

import numpy as np
import pytest

from deltasync.bf16 import bytes_digest
from deltasync.errors import DeltaCorruptError
from deltasync.follow import Follower
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.store import Store


def assert_bits(follower: Follower, bits: dict) -> None:
    assert set(follower.held.tensors) == set(bits)
    for n, b in bits.items():
        assert np.array_equal(follower.held.tensors[n], b), n


def test_follow_on_a_thread_ends_on_the_publishers_bits(bucket, trainer):
    cfg = PublisherConfig(anchor_every=3, keep_anchors=10)
    follower = Follower(bucket, poll_interval_s=0.01)
    stop, wake = threading.Event(), threading.Event()
    pulls = []

    def run():
        for pulled in follower.follow(stop, wake):
            if pulled is not None:
                pulls.append(pulled)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    with DeltaPublisher(bucket, config=cfg) as pub:
        for step in range(7):
            trainer.step()
            last = pub.publish(trainer.named(), step=step)
            pub.flush()
            time.sleep(0.02)
    deadline = time.time() + 30
    while follower.held.version != last and time.time() < deadline:
        wake.set()
        time.sleep(0.01)
    stop.set()
    wake.set()
    thread.join(10)
    assert not thread.is_alive()
    assert follower.held.version == last == 6
    assert_bits(follower, trainer.bits())
    # each pull starts where the previous one ended (or re-anchors), and records what it moved
    assert pulls[0].plan.from_version is None and pulls[0].kind == "anchor"
    for before, after in zip(pulls, pulls[1:], strict=False):
        assert after.plan.from_version == before.version
    rec = pulls[-1].record(paused_s=0.002, apply_s=0.001, apply_path="cpu-dict")
    assert rec.version == 6 and rec.bytes == sum(pulls[-1].sizes) > 0
    assert rec.applied_at >= rec.published_at
    follower.close()


def _damage(store: Store, path: str) -> None:
    data = bytearray(store.read_bytes(path))
    data[len(data) // 2] ^= 0x10
    store.write_bytes(path, bytes(data))


@pytest.mark.parametrize("reported", [False, True])
def test_damaged_delta_is_refused_then_routed_around(bucket, trainer, reported):
    errors = []
    report = (lambda exc, what: errors.append((exc, what))) if reported else None
    follower = Follower(bucket, report=report)
    cfg = PublisherConfig(anchor_every=3, keep_anchors=10)
    with DeltaPublisher(bucket, config=cfg) as pub:
        pub.publish(trainer.named(), step=0)
        pub.flush()
        assert follower.poll().version == 0
        good = trainer.bits()
        trainer.step()
        pub.publish(trainer.named(), step=1)  # v1: a delta only
        pub.flush()
        _damage(pub.store, pub.manifest.entry(1).delta.files[0].path)
        if reported:
            assert follower.poll() is None and follower.failed
            assert isinstance(errors[-1][0], DeltaCorruptError) and "v1" in errors[-1][1]
        else:
            with pytest.raises(DeltaCorruptError):
                follower.poll()
        assert follower.held.version == 0
        assert_bits(follower, good)  # nothing of the damaged delta was applied
        assert follower.poll() is None and "v1" in follower.stuck  # no path around it yet
        for step in (2, 3):  # v2 chains onto the bad v1; v3 is an anchor
            trainer.step()
            pub.publish(trainer.named(), step=step)
            pub.flush()
    pulled = follower.poll()
    assert pulled.kind == "anchor" and pulled.version == 3 and follower.stuck is None
    assert_bits(follower, trainer.bits())
    follower.close()


def _malformed_part(data: bytes) -> bytes:
    """The part with its ``tensors`` metadata entry holding a number per tensor, not an
    object: a well-formed safetensors file whose metadata a publisher never writes."""
    (hlen,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + hlen])
    names = [n for n in header if n != "__metadata__"]
    header["__metadata__"]["tensors"] = json.dumps({n: 7 for n in names})
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + hlen :]


def test_a_malformed_part_is_fetched_once_then_avoided(bucket, trainer):
    """A delta part that the manifest names with its own size and digest (so the download
    verifies) but whose metadata is malformed: refused as DeltaCorruptError, remembered, never
    downloaded again, and routed around through the next anchor."""
    errors = []
    follower = Follower(bucket, report=lambda exc, what: errors.append((exc, what)))
    with DeltaPublisher(bucket, run_id="r1") as pub:
        pub.publish(trainer.named(), step=0)
        pub.flush()  # v0 committed before v1 is asked for, or the two coalesce into one anchor
        trainer.step()
        pub.publish(trainer.named(), step=1)  # v1: a delta only
    store = follower.store
    manifest = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    ref = manifest.entry(1).delta.files[0]
    bad = _malformed_part(store.read_bytes(ref.path))
    ref.bytes, ref.digest = len(bad), bytes_digest(bad)
    store.write_bytes(ref.path, bad)
    store.write_bytes(MANIFEST_PATH, manifest.to_json())
    reads = []
    read_bytes = store.read_bytes
    store.read_bytes = lambda path: reads.append(path) or read_bytes(path)
    follower.poll()
    assert follower.held.version == 0 and reads.count(ref.path) == 1
    assert isinstance(errors[-1][0], DeltaCorruptError) and "tensors" in str(errors[-1][0])
    assert [k[:2] for k in follower.refused] == [("delta", 1)]
    assert follower.poll() is None and "v1" in follower.stuck
    assert reads.count(ref.path) == 1  # remembered: not downloaded again
    with DeltaPublisher(bucket, run_id="r1") as pub:  # a restart publishes an anchor: v2
        trainer.step()
        assert pub.publish(trainer.named(), step=2) == 2
    pulled = follower.poll()
    assert pulled.kind == "anchor" and pulled.version == 2 and reads.count(ref.path) == 1
    assert_bits(follower, trainer.bits())
    follower.close()


def test_poll_interval_backs_off_and_snaps_back(tmp_path, trainer):
    uri = str(tmp_path / "bucket")
    follower = Follower(uri, poll_interval_s=0.5, max_poll_interval_s=4.0)
    with DeltaPublisher(uri) as pub:
        pub.publish(trainer.named(), step=0)
        pub.flush()
        follower.poll()
        assert follower.delay_s == 0.5  # a new version: the fastest
        delays = []
        for _ in range(5):
            follower.poll()
            delays.append(follower.delay_s)
        assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]
        trainer.step()
        pub.publish(trainer.named(), step=1)
        pub.flush()
    assert follower.poll().version == 1 and follower.delay_s == 0.5
    follower.close()
