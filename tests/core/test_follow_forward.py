"""Versions only move forward: a reader (``deltasync.follow.Follower``) never follows a manifest
older than one it saw (an old manifest written back, a stale read from a cache in front of the
store) or one of another run, raises the declared error (or reports it, for a long-lived reader),
keeps the bits it holds, and follows again once the current manifest is read."""

import pytest

from deltasync.errors import ForeignRunError, StaleManifestError
from deltasync.follow import Follower
from deltasync.manifest import MANIFEST_PATH
from deltasync.publisher import DeltaPublisher
from deltasync.store import Store

from .test_follow import assert_bits


def _publish(pub, trainer, k):
    for _ in range(k):
        trainer.step()
        v = pub.publish(trainer.named(), step=0)
        pub.flush()
    return v


def test_an_old_manifest_is_ignored_and_the_held_bits_stay(bucket, trainer):
    store = Store(bucket)
    reported = []
    follower = Follower(bucket, report=lambda e, what: reported.append(e))
    with DeltaPublisher(bucket) as pub:
        _publish(pub, trainer, 1)
        old = store.read_bytes(MANIFEST_PATH)
        v = _publish(pub, trainer, 2)
        follower.poll()
        assert follower.held.version == v
        bits = {n: a.copy() for n, a in follower.held.tensors.items()}
        current = store.read_bytes(MANIFEST_PATH)
        store.write_bytes(MANIFEST_PATH, old)
        assert follower.poll() is None
        assert isinstance(reported[-1], StaleManifestError) and follower.failed
        assert follower.held.version == v and follower.newest_seen == v
        assert all((follower.held.tensors[n] == b).all() for n, b in bits.items())
        store.write_bytes(MANIFEST_PATH, current)
        v2 = _publish(pub, trainer, 1)
        assert follower.poll().version == v2
        assert_bits(follower, trainer.bits())


def test_without_a_reporter_the_stale_manifest_raises(bucket, trainer):
    store = Store(bucket)
    follower = Follower(bucket)
    with DeltaPublisher(bucket) as pub:
        _publish(pub, trainer, 1)
        old = store.read_bytes(MANIFEST_PATH)
        _publish(pub, trainer, 1)
        follower.poll()
        store.write_bytes(MANIFEST_PATH, old)
        with pytest.raises(StaleManifestError, match="expected a newest version of at least v1"):
            follower.poll()


def test_a_manifest_of_another_run_is_refused(bucket, tmp_path, trainer):
    store = Store(bucket)
    follower = Follower(bucket)
    with DeltaPublisher(bucket) as pub:
        _publish(pub, trainer, 1)
    follower.poll()
    other = str(tmp_path / "other")
    with DeltaPublisher(other) as pub2:
        _publish(pub2, trainer, 3)
    store.write_bytes(MANIFEST_PATH, Store(other).read_bytes(MANIFEST_PATH))
    with pytest.raises(ForeignRunError, match="expected run"):
        follower.poll()
    assert follower.held.version == 0
