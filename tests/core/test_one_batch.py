"""One write a version on a store whose batches are all-or-nothing (``Store.atomic_batches``).

There the publisher puts a version's payload parts, the retention deletes already due, the lease
when due and ``manifest.json`` (last) in ONE ``Store.write_many``; elsewhere (the default, the Hub
included) two, the manifest after its payloads have landed. A memory store stands in for such a
store: it writes a batch in order and stops at the first failure, so a manifest never lands
without the parts before it. Checked: batches and requests per version with and without; a
follower stays bit for bit; a batch that fails at a part or at the manifest (also when the
manifest landed and only the answer was lost) leaves no manifest naming a missing file, and the
version is re-published as an anchor with nothing lost. Print the figures with ``-s``.
"""

from __future__ import annotations

import pytest

from deltasync.follow import Follower
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.store import Store

from .conftest import TinyTrainer
from .test_publish_outage import RETRIES, assert_bits, assert_chain, flaky_store, publisher, uri


def named_files(m: Manifest) -> set[str]:
    return {f.path for v in m.versions for p in (v.delta, v.anchor) if p for f in p.files}


def assert_manifest_names_only_present_files(store: Store) -> Manifest | None:
    raw = store.read_bytes(MANIFEST_PATH) if store.exists(MANIFEST_PATH) else None
    if raw is None:
        return None
    m = Manifest.from_json(raw)
    missing = {p for p in named_files(m) if not store.exists(p)}
    assert not missing, f"the manifest names missing payloads: {sorted(missing)}"
    return m


def publish_versions(atomic: bool, versions: int = 8) -> tuple[list[int], list[int]]:
    """Publish ``versions`` versions on a memory store; (write_many calls, API requests) per
    version, with a follower checked bit for bit after each and the bucket after the close."""
    trainer = TinyTrainer()
    where = uri()
    store = Store(where)
    store.atomic_batches = atomic
    batches = [0]
    write_many = store.write_many

    def counted(items, delete=None):
        batches[0] += 1
        return write_many(items, delete=delete)

    store.write_many = counted
    cfg = PublisherConfig(anchor_every=3, keep_anchors=1)  # anchors and retention deletes too
    pub = DeltaPublisher(store, config=cfg)
    follower = Follower(where)
    per_version, api_per_version = [], []
    for step in range(versions):
        trainer.step()
        b0, a0 = batches[0], store.requests.api
        pub.publish(trainer.named(), step=step)
        pub.flush()
        per_version.append(batches[0] - b0)
        api_per_version.append(store.requests.api - a0)
        assert_manifest_names_only_present_files(store)
        assert follower.poll().version == step
        assert_bits(follower, trainer.bits())
    assert len(pub.manifest.versions) < versions  # retention dropped versions
    pub.close()  # the last pending deletes go with the lease release
    m = assert_manifest_names_only_present_files(store)
    on_store = {p for p in store.ls("") if p.startswith(("anchors/", "deltas/"))}
    assert on_store == named_files(m)  # the dropped versions' files are gone
    return per_version, api_per_version


def test_one_batch_a_version_on_an_atomic_store_and_followers_stay_bit_exact():
    two, two_api = publish_versions(atomic=False)
    one, one_api = publish_versions(atomic=True)
    print(f"\nwrite_many per version: two batches {two}, one batch {one}")
    assert two == [2] * 8 and one == [1] * 8
    # a memory store counts a request per file written (no batches), so the same in both; what
    # one batch saves on hf:// is counted in tests/core/test_hub_budget.py
    assert one_api == two_api


@pytest.mark.parametrize(
    "target, landed",
    [
        ("deltas/", False),  # the batch stops at a part: no manifest
        (MANIFEST_PATH, False),  # the parts landed, the manifest did not
        (MANIFEST_PATH, True),  # all of it landed, the answer was lost
    ],
    ids=["part", "manifest", "manifest-landed"],
)
def test_a_failed_single_batch_names_no_missing_payload_and_is_republished(trainer, target, landed):
    where = uri()
    store, fs = flaky_store(where)
    store.atomic_batches = True
    pub, events, _ = publisher(store)
    follower = Follower(where)
    for step in range(2):
        trainer.step()
        pub.publish(trainer.named(), step=step)
        pub.flush()
    assert follower.poll().version == 1

    pub.retry_s = (1.0, 1.0)  # the bucket is checked between the failure and the re-publish
    fs.fail_writes(target, RETRIES, landed)
    trainer.step()
    assert pub.publish(trainer.named(), step=2) == 2
    assert events["started"].wait(10)
    m = assert_manifest_names_only_present_files(Store(where))
    assert m.latest.version == (2 if landed else 1)
    pub.flush(timeout=30)
    assert fs.failed == RETRIES
    entry = pub.manifest.latest
    assert entry.version == 2 and entry.base_version is None  # re-published as an anchor
    assert events["ended"].is_set()
    trainer.step()
    pub.publish(trainer.named(), step=3)
    pub.flush()
    assert pub.manifest.latest.base_version == 2
    assert assert_chain(pub) == {0, 1, 2, 3}  # every version committed, none lost
    assert_manifest_names_only_present_files(Store(where))
    assert follower.poll().version == 3
    assert_bits(follower, trainer.bits())
    pub.close()


def test_a_store_without_atomic_batches_refuses_payloads_in_the_manifest_batch(trainer):
    from deltasync.bucket_writer import commit_manifest

    store = Store(uri())
    pub = DeltaPublisher(store)
    trainer.step()
    pub.publish(trainer.named(), step=0)
    pub.flush()
    with pytest.raises(ValueError, match="not all-or-nothing"):
        commit_manifest(
            store,
            pub.lease,
            pub.manifest.latest,
            pub.manifest,
            pub._fingerprint,
            1,
            items=[("deltas/x", b"1")],
        )
    pub.close()
