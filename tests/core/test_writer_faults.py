"""Writers cannot destroy history: each fault happens once and the bucket's committed versions
survive it bit for bit, on file:// and memory:// stores.

Covered: payload file names carry the writer's id (and buckets with the older names still read
and resume); a spurious not-found on the manifest read at start (resume, or a clear refusal,
nothing deleted; ``new_run`` starts over only when asked); an invalid manifest at start; two
trainers started at once (one runs, one stops); a concurrent writer at commit; a takeover
mid-run; a lease lost during an upload; the lease renewed during a slow upload; a trainer killed
mid-anchor-upload and restarted (orphans removed only under the new lease, every committed
version still read bit for bit); a spurious not-found before a commit.

Synchronisation waits on events set by a store wrapper (:class:`FaultStore`), never on sleeps.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from deltasync.errors import ConcurrentWriterError, ManifestError, StoreNotFoundError
from deltasync.manifest import MANIFEST_PATH, WRITER_PATH, Manifest, WriterLease
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.store import Store
from deltasync.subscriber import DeltaSubscriber, HeldWeights

WAIT_S = 30.0  # the longest any event is waited for; a test that gets there has failed


class FaultStore(Store):
    """A Store that calls ``hook(op, path)`` before each operation (``op``: "read", "write",
    "ls", "rm"), where a test fails one or waits on an event; ``ops`` records them in order.
    Payload files always go through the store (``local_path`` is None), as on a remote bucket."""

    def __init__(self, uri: str, hook=None):
        super().__init__(uri)
        self.hook = hook
        self.ops: list[tuple[str, str]] = []

    def _at(self, op: str, path: str) -> None:
        self.ops.append((op, path))
        if self.hook is not None:
            self.hook(op, path)

    def local_path(self, path):
        return None

    def read_bytes(self, path):
        self._at("read", path)
        return super().read_bytes(path)

    def write_bytes(self, path, data):
        self._at("write", path)
        super().write_bytes(path, data)

    def put_file(self, local_path, path):
        self._at("write", path)
        super().put_file(local_path, path)

    def ls(self, prefix):
        self._at("ls", prefix)
        return super().ls(prefix)

    def rm(self, paths):
        for p in paths:
            self._at("rm", p)
        super().rm(paths)


class Killed(BaseException):
    """The trainer process died here (SIGKILL): nothing after it runs, not even cleanup."""


def is_payload(path: str) -> bool:
    return path.startswith(("anchors/", "deltas/"))


def payload_bytes(uri: str) -> dict[str, bytes]:
    """Every payload file in the bucket, with its bytes."""
    store = Store(uri)
    return {p: store.read_bytes(p) for p in store.ls("") if is_payload(p)}


def manifest_of(uri: str) -> Manifest:
    return Manifest.from_json(Store(uri).read_bytes(MANIFEST_PATH))


def committed_bytes(uri: str) -> dict[str, bytes]:
    """The manifest's bytes and every file it names, with its bytes."""
    store = Store(uri)
    m = manifest_of(uri)
    out = {MANIFEST_PATH: store.read_bytes(MANIFEST_PATH)}
    for v in m.versions:
        for payload in (v.delta, v.anchor):
            for f in payload.files if payload else ():
                out[f.path] = store.read_bytes(f.path)
    return out


def lease_holder(uri: str) -> str | None:
    store = Store(uri)
    if not store.exists(WRITER_PATH):
        return None
    return WriterLease.model_validate_json(store.read_bytes(WRITER_PATH)).writer_id


def publish(pub, trainer, n: int, truth: dict, first_step: int = 0) -> None:
    """``n`` versions, each committed before the next (``truth``: version -> bits)."""
    for i in range(n):
        trainer.step()
        truth[pub.publish(trainer.named(), step=first_step + i)] = trainer.bits()
        pub.flush()


def run_with_history(uri, trainer, n=4, **cfg) -> dict:
    """A closed run of ``n`` versions (anchors and deltas); returns version -> bits."""
    truth: dict = {}
    with DeltaPublisher(uri, run_id="r", config=PublisherConfig(anchor_every=2, **cfg)) as pub:
        publish(pub, trainer, n, truth)
    return truth


def reads_every_version(uri: str, truth: dict) -> None:
    """A fresh replica reaches each committed version, bit for bit; one that follows the run
    from its first version reaches the newest."""
    sub = DeltaSubscriber(uri)
    versions = [v.version for v in sub.read_manifest().versions]
    assert set(versions) <= set(truth)
    for v in versions:
        held = HeldWeights()
        sub.sync(held, target=v)
        assert held.version == v
        assert set(held.tensors) == set(truth[v])
        for name, bits in truth[v].items():
            assert np.array_equal(held.tensors[name], bits), (v, name)


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test, which asserts on it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# --------------------------------------------------------------------------------- payload names
def test_payload_names_carry_the_writer_id(bucket, trainer):
    truth = run_with_history(bucket, trainer, n=3)
    m = manifest_of(bucket)
    named = [f.path for v in m.versions for p in (v.delta, v.anchor) if p for f in p.files]
    assert named and sorted(named) == sorted(payload_bytes(bucket))
    pattern = rf"(anchors|deltas)/v[0-9]{{10}}/part-[0-9]{{4}}-{m.writer_id}\.safetensors"
    assert all(re.fullmatch(pattern, p) for p in named), named
    reads_every_version(bucket, truth)


def test_a_bucket_with_names_without_writer_ids_reads_and_resumes(bucket, trainer):
    """Backward compatible reading: a run written before names carried the writer id."""
    truth = run_with_history(bucket, trainer, n=3)
    store = Store(bucket)
    m = manifest_of(bucket)
    old = {}
    for v in m.versions:
        for payload in (v.delta, v.anchor):
            for f in payload.files if payload else ():
                new_path = f.path.replace(f"-{m.writer_id}.", ".")
                store.write_bytes(new_path, store.read_bytes(f.path))
                store.rm([f.path])
                f.path = new_path
                old[new_path] = store.read_bytes(new_path)
    store.write_bytes(MANIFEST_PATH, m.to_json())
    reads_every_version(bucket, truth)
    # a trainer resumes it: the old files are named, so they are no orphans
    with DeltaPublisher(bucket, run_id="r", config=PublisherConfig(keep_anchors=10)) as pub:
        publish(pub, trainer, 2, truth, first_step=10)
    assert {p: b for p, b in payload_bytes(bucket).items() if p in old} == old
    reads_every_version(bucket, truth)


# ---------------------------------------------------------------------------- start-up faults
def test_a_spurious_not_found_on_the_manifest_at_start_resumes_and_deletes_nothing(bucket, trainer):
    truth = run_with_history(bucket, trainer)
    before = payload_bytes(bucket)
    misses = []

    def one_404(op, path):
        if op == "read" and path == MANIFEST_PATH and not misses:
            misses.append(path)
            raise StoreNotFoundError(f"simulated spurious 404 for {path}")

    store = FaultStore(bucket, one_404)
    with DeltaPublisher(store, run_id="r") as pub:
        assert misses == [MANIFEST_PATH]
        assert pub.latest_committed == max(truth)  # resumed, not a new run
        assert payload_bytes(bucket) == before  # nothing deleted
        publish(pub, trainer, 2, truth, first_step=10)
    assert [v.version for v in manifest_of(bucket).versions][-3:] == sorted(truth)[-3:]
    reads_every_version(bucket, truth)


def test_a_manifest_that_stays_not_found_over_payloads_refuses_to_start(bucket, trainer):
    truth = run_with_history(bucket, trainer)
    committed = committed_bytes(bucket)

    def always_404(op, path):
        if op == "read" and path == MANIFEST_PATH:
            raise StoreNotFoundError(f"simulated 404 for {path}")

    with pytest.raises(ManifestError, match=r"payload files.*Nothing was deleted.*new_run=True"):
        DeltaPublisher(FaultStore(bucket, always_404), run_id="r")
    assert committed_bytes(bucket) == committed  # every committed file, bit for bit
    assert lease_holder(bucket) is None  # the refused publisher holds nothing
    reads_every_version(bucket, truth)
    # once the manifest reads again, a plain start resumes
    with DeltaPublisher(bucket, run_id="r") as pub:
        assert pub.latest_committed == max(truth)


def test_new_run_on_a_prefix_with_payloads_but_no_manifest_is_asked_for_explicitly(bucket, trainer):
    """A trainer that died before its first commit leaves payloads and no manifest: a restart
    is refused until it asks for a new run; then those files go."""
    store = FaultStore(bucket)

    def die_before_commit(entry):
        raise Killed("SIGKILL before the first commit")

    first = DeltaPublisher(store, config=PublisherConfig(lease_s=600))
    first.before_commit = die_before_commit
    trainer.step()
    first.publish(trainer.named(), step=0)
    with pytest.raises(Killed):  # the publisher died: no close, no cleanup
        first.flush(WAIT_S)
    left = sorted(payload_bytes(bucket))
    assert left and not Store(bucket).exists(MANIFEST_PATH)
    with pytest.raises(ManifestError, match="new_run=True"):
        DeltaPublisher(bucket, config=PublisherConfig(takeover=True))
    assert sorted(payload_bytes(bucket)) == left
    cfg = PublisherConfig(takeover=True, new_run=True)
    with DeltaPublisher(bucket, run_id="fresh", config=cfg) as pub:
        assert pub.latest_committed is None
        assert not set(payload_bytes(bucket)) & set(left)  # the dead writer's files are gone
        truth: dict = {}
        publish(pub, trainer, 2, truth)
    assert min(truth) == 0
    reads_every_version(bucket, truth)


def test_an_invalid_manifest_at_start_is_a_manifest_error_and_deletes_nothing(bucket, trainer):
    run_with_history(bucket, trainer)
    store = Store(bucket)
    orphan = "anchors/v0000000099/part-0000-deadbeef0000.safetensors"
    store.write_bytes(orphan, b"a dead writer's part")
    store.write_bytes(MANIFEST_PATH, store.read_bytes(MANIFEST_PATH)[:-40])  # truncated
    before = payload_bytes(bucket)
    manifest_before = store.read_bytes(MANIFEST_PATH)
    with pytest.raises(ManifestError, match="not a valid deltasync manifest"):
        DeltaPublisher(bucket, run_id="r")
    assert payload_bytes(bucket) == before  # the orphan too: only a valid manifest says so
    assert store.read_bytes(MANIFEST_PATH) == manifest_before
    assert lease_holder(bucket) is None


def test_the_lease_is_taken_before_the_manifest_read_and_orphans_go_only_under_it(bucket, trainer):
    run_with_history(bucket, trainer)
    orphan = "deltas/v0000000099/part-0000-deadbeef0000.safetensors"
    Store(bucket).write_bytes(orphan, b"a dead writer's part")
    store = FaultStore(bucket)
    with DeltaPublisher(store, run_id="r"):
        ops = list(store.ops)
    lease_written = ops.index(("write", WRITER_PATH))
    assert ops.index(("read", MANIFEST_PATH)) > lease_written
    assert ops.index(("ls", "")) > lease_written
    removed = ops.index(("rm", orphan))
    assert ("read", WRITER_PATH) in ops[lease_written + 1 : removed]  # checked right before
    assert [op for op in ops if op[0] == "rm"] == [("rm", orphan)]
    assert orphan not in payload_bytes(bucket)


# ---------------------------------------------------------------------------- two writers
def test_two_trainers_started_at_once_one_runs_and_the_other_stops(bucket, trainer):
    """Both read no lease and write theirs; the read back decides: the last write goes on."""
    truth = run_with_history(bucket, trainer)
    committed = committed_bytes(bucket)
    both_wrote, both_read = threading.Barrier(2, timeout=WAIT_S), threading.Barrier(2)

    def racing(store_ops):
        def hook(op, path):
            if path != WRITER_PATH:
                return
            seen = [o for o in store_ops if o[1] == WRITER_PATH]
            if op == "write" and len(seen) == 2:  # read, write: both have read "no lease"
                both_wrote.wait()
            if op == "read" and len(seen) == 3:  # the read back: both have written
                both_read.wait(WAIT_S)

        return hook

    stores = [FaultStore(bucket), FaultStore(bucket)]
    for s in stores:
        s.hook = racing(s.ops)
    starts = [in_thread(lambda s=s: DeltaPublisher(s, run_id="r")) for s in stores]
    for t, _ in starts:
        t.join(WAIT_S)
    results = [out for _, out in starts]
    winners = [out["value"] for out in results if "value" in out]
    losers = [out["error"] for out in results if "error" in out]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], ConcurrentWriterError)
    assert "took this run over" in str(losers[0])
    (pub,) = winners
    assert lease_holder(bucket) == pub.writer_id
    assert committed_bytes(bucket) == committed
    with pub:
        publish(pub, trainer, 2, truth, first_step=10)
    after = committed_bytes(bucket)
    assert all(after[p] == b for p, b in committed.items() if p in after and p != MANIFEST_PATH)
    reads_every_version(bucket, truth)


def test_a_concurrent_writer_at_commit_is_refused_and_never_overwrites(bucket, trainer):
    """A uploads v1 after B took over and committed its own v1 (an anchor each, so under
    names without writer ids A's parts would land on B's): A's commit is refused, and every
    file B committed keeps its bits."""
    cfg = PublisherConfig(anchor_every=1, lease_s=600)
    upload_started, b_committed = threading.Event(), threading.Event()

    def hold_v1_upload(op, path):
        if op == "write" and is_payload(path) and "/v0000000001/" in path:
            upload_started.set()
            assert b_committed.wait(WAIT_S)

    a = DeltaPublisher(FaultStore(bucket, hold_v1_upload), run_id="r", config=cfg)
    truth: dict = {}
    publish(a, trainer, 1, truth)  # v0
    trainer.step()
    assert a.publish(trainer.named(), step=1) == 1
    assert upload_started.wait(WAIT_S)
    with DeltaPublisher(bucket, run_id="r", config=PublisherConfig(takeover=True)) as b:
        assert b.publish(trainer.named(), step=1) == 1
        b.flush()
        truth[1] = trainer.bits()
        committed = committed_bytes(bucket)
        b_committed.set()
        with pytest.raises(ConcurrentWriterError, match="took this run over"):
            a.flush()
        assert committed_bytes(bucket) == committed  # manifest and B's files, bit for bit
        a_v1 = [p for p in payload_bytes(bucket) if a.writer_id in p and "/v0000000001/" in p]
        b_v1 = [p for p in committed if "/v0000000001/" in p]
        assert {p.rsplit("-", 1)[0] for p in a_v1} >= {p.rsplit("-", 1)[0] for p in b_v1}
        assert not set(a_v1) & set(committed)  # A's v1 went beside B's, as an orphan
        assert lease_holder(bucket) == b.writer_id
        publish(b, trainer, 1, truth, first_step=2)
    with pytest.raises(ConcurrentWriterError):
        a.close()
    reads_every_version(bucket, truth)


def test_a_takeover_mid_run_stops_the_old_writer_before_it_commits(bucket, trainer):
    old = DeltaPublisher(bucket, run_id="r", config=PublisherConfig(anchor_every=1))
    truth: dict = {}
    publish(old, trainer, 3, truth)
    new = DeltaPublisher(bucket, run_id="r", config=PublisherConfig(takeover=True))
    publish(new, trainer, 2, truth, first_step=3)
    committed = committed_bytes(bucket)
    trainer.step()
    stale = old.publish(trainer.named(), step=99)  # the old trainer goes on: its next version
    with pytest.raises(ConcurrentWriterError, match=f"writer {new.writer_id}.*took this run"):
        old.flush()
    assert stale in [v.version for v in manifest_of(bucket).versions]  # the new writer's
    assert committed_bytes(bucket) == committed  # nothing committed changed
    assert lease_holder(bucket) == new.writer_id
    with pytest.raises(ConcurrentWriterError):
        old.close()  # keeps the error; releases nothing
    assert lease_holder(bucket) == new.writer_id
    new.close()
    reads_every_version(bucket, truth)


def test_a_lease_lost_during_an_upload_stops_the_writer_before_its_commit(bucket, trainer):
    """The renewal thread finds the lease taken while the payload uploads; the upload's end
    raises ConcurrentWriterError and the manifest is never written."""
    uploading, renewal_waits, taken, release = (threading.Event() for _ in range(4))
    upload_at: list[int] = []

    def hook(op, path):
        if op == "write" and is_payload(path) and "/v0000000001/" in path and not upload_at:
            upload_at.append(len(store.ops) - 1)
            uploading.set()
            assert release.wait(WAIT_S)
        renewal = threading.current_thread().name == "deltasync-lease"
        if renewal and op == "read" and path == WRITER_PATH and not taken.is_set():
            renewal_waits.set()  # its check, before its write: the takeover goes in here
            assert taken.wait(WAIT_S)

    store = FaultStore(bucket, hook)
    a = DeltaPublisher(store, run_id="r", config=PublisherConfig(lease_s=0.6))
    truth: dict = {}
    publish(a, trainer, 1, truth)
    trainer.step()
    a.publish(trainer.named(), step=1)
    assert uploading.wait(WAIT_S) and renewal_waits.wait(WAIT_S)
    b = DeltaPublisher(bucket, run_id="r", config=PublisherConfig(takeover=True))
    committed = committed_bytes(bucket)
    taken.set()
    release.set()
    with pytest.raises(ConcurrentWriterError, match="took this run over"):
        a.flush()
    assert isinstance(a.lease.lost, ConcurrentWriterError)  # found by the renewal thread
    after_upload = store.ops[upload_at[0] :]
    assert ("write", MANIFEST_PATH) not in after_upload
    assert ("write", WRITER_PATH) not in after_upload
    assert committed_bytes(bucket) == committed
    assert lease_holder(bucket) == b.writer_id
    with pytest.raises(ConcurrentWriterError):
        a.close()
    b.close()
    reads_every_version(bucket, truth)


def test_the_lease_is_renewed_while_a_slow_upload_outlasts_it(bucket, trainer):
    """An anchor upload held for longer than ``lease_s``: the lease's thread keeps the lease
    fresh (a rival is refused at the end of it) and the version commits."""
    lease_s = 0.6
    uploading, renewed, release = threading.Event(), threading.Event(), threading.Event()
    upload_t0: list[float] = []
    renewals: list[float] = []  # monotonic s of each renewal the lease's thread wrote

    def hook(op, path):
        renewal = threading.current_thread().name == "deltasync-lease"
        if renewal and op == "write" and path == WRITER_PATH:
            renewals.append(time.monotonic())
            if len(renewals) == 4:  # each more than lease_s / 3 after the one before
                renewed.set()
        if op == "write" and is_payload(path) and not upload_t0:
            upload_t0.append(time.monotonic())
            uploading.set()
            assert release.wait(WAIT_S)

    store = FaultStore(bucket, hook)
    pub = DeltaPublisher(store, run_id="r", config=PublisherConfig(lease_s=lease_s))
    trainer.step()
    pub.publish(trainer.named(), step=0)
    assert uploading.wait(WAIT_S) and renewed.wait(WAIT_S)
    assert renewals[-1] - upload_t0[0] > lease_s  # the upload has outlasted the lease
    with pytest.raises(ConcurrentWriterError, match="last heartbeat"):
        DeltaPublisher(bucket, run_id="r", config=PublisherConfig(lease_s=lease_s))
    release.set()
    pub.flush()
    assert pub.latest_committed == 0 and pub.lease.lost is None
    pub.close()
    reads_every_version(bucket, {0: trainer.bits()})


# ---------------------------------------------------------------------------- crash and restart
@pytest.mark.parametrize("dies", ["mid-anchor-upload", "before-commit"])
def test_a_trainer_killed_during_an_anchor_resumes_with_history_intact(bucket, trainer, dies):
    cfg = PublisherConfig(anchor_every=3, keep_anchors=10, part_bytes=4096, lease_s=600)
    anchor_parts: list[str] = []
    written: list[str] = []  # v3's payload files that reached the bucket

    def kill_on_second_anchor_part(op, path):
        if op == "write" and path.startswith("anchors/v0000000003/"):
            anchor_parts.append(path)
            if dies == "mid-anchor-upload" and len(anchor_parts) == 2:
                raise Killed("SIGKILL between two anchor parts")
        if op == "write" and "/v0000000003/" in path:
            written.append(path)

    def kill_before_commit(entry):
        if entry.version == 3:
            raise Killed("SIGKILL after the upload, before the manifest")

    dead = DeltaPublisher(FaultStore(bucket, kill_on_second_anchor_part), "r", cfg)
    dead.before_commit = kill_before_commit
    truth: dict = {}
    publish(dead, trainer, 3, truth)  # v0 anchor, v1 and v2 deltas
    follower, held = DeltaSubscriber(bucket), HeldWeights()
    follower.sync(held)
    trainer.step()
    dead.publish(trainer.named(), step=3)  # v3: an anchor of several parts
    with pytest.raises(Killed):  # the publisher died: no close, no cleanup
        dead.flush(WAIT_S)
    committed = committed_bytes(bucket)
    orphans = sorted(set(payload_bytes(bucket)) - set(committed))
    assert len(anchor_parts) == 2  # the anchor has two parts: the kill fell between them
    assert orphans == sorted(written) and all(dead.writer_id in p for p in orphans)
    reads_every_version(bucket, truth)  # readers never see the dead writer's files

    with pytest.raises(ConcurrentWriterError, match="takeover"):  # its lease is still fresh
        DeltaPublisher(bucket, "r", cfg)
    assert sorted(set(payload_bytes(bucket)) - set(committed)) == orphans
    store = FaultStore(bucket)
    restarted = DeltaPublisher(store, "r", PublisherConfig(keep_anchors=10, takeover=True))
    lease_written = store.ops.index(("write", WRITER_PATH))
    assert sorted(p for op, p in store.ops[lease_written:] if op == "rm") == orphans
    assert set(payload_bytes(bucket)) == set(committed) - {MANIFEST_PATH}
    assert committed_bytes(bucket) == committed  # committed history, bit for bit
    with restarted:
        assert restarted.latest_committed == 2
        publish(restarted, trainer, 2, truth, first_step=3)  # v3 (an anchor), v4
    follower.sync(held)
    assert held.version == 4
    assert all(np.array_equal(held.tensors[n], b) for n, b in truth[4].items())
    after = committed_bytes(bucket)
    assert all(after[p] == b for p, b in committed.items() if p != MANIFEST_PATH)
    reads_every_version(bucket, truth)


def test_a_spurious_not_found_before_a_commit_keeps_the_history(bucket, trainer):
    truth = run_with_history(bucket, trainer, keep_anchors=10)
    misses: list[str] = []
    started = threading.Event()

    def one_404_after_start(op, path):
        if started.is_set() and op == "read" and path == MANIFEST_PATH and not misses:
            misses.append(path)
            raise StoreNotFoundError(f"simulated spurious 404 for {path}")

    store = FaultStore(bucket, one_404_after_start)
    with DeltaPublisher(store, run_id="r", config=PublisherConfig(keep_anchors=10)) as pub:
        started.set()
        publish(pub, trainer, 1, truth, first_step=10)
    assert misses == [MANIFEST_PATH]
    assert [v.version for v in manifest_of(bucket).versions] == sorted(truth)
    reads_every_version(bucket, truth)


def test_a_stale_manifest_read_before_a_commit_keeps_the_history(bucket, trainer):
    """Found by bench_fault_matrix: an older manifest of this writer read before a commit (the
    Hub answering a stale read, or an old manifest written back) was built on, and every version
    committed since dropped out of the manifest (the new delta's base with them). Now the commit
    goes on the manifest the writer holds, and a fresh replica follows the whole chain."""
    store = Store(bucket)
    with DeltaPublisher(bucket) as pub:
        for step in range(3):
            trainer.step()
            pub.publish(trainer.named(), step=step)
            pub.flush()
        old = store.read_bytes(MANIFEST_PATH)
        for step in range(3, 6):
            trainer.step()
            pub.publish(trainer.named(), step=step)
            pub.flush()
        store.write_bytes(MANIFEST_PATH, old)  # v2's manifest over v5's
        trainer.step()
        v = pub.publish(trainer.named(), step=6)
        pub.flush()
    m = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    kept = [e.version for e in m.versions]  # retention may drop what is before an anchor
    assert kept == list(range(kept[0], v + 1)) and kept[0] <= 5, kept
    fresh, held = DeltaSubscriber(bucket), HeldWeights()
    fresh.sync(held)
    assert held.version == v
    for n, b in trainer.bits().items():
        assert (held.tensors[n] == b).all(), n
    fresh.close()
