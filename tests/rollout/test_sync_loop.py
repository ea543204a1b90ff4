"""The sync loop against a fake engine (no vLLM; fast): following a file:// bucket bit for bit on
both apply paths, fused shards staged together, a late start from an anchor, a corrupted delta
refused while the old version keeps serving and recovered by re-anchoring, a wrong base
(a diverged trainer) refused the same way, a failed apply inside the engine repaired by a full
reload before generation resumes, and the heartbeat written to ``replicas/<id>.json``."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import heartbeat_path
from deltasync.store import Store
from rollout.sync_loop import SyncLoop

from .rollout_helpers import FakeEngine, Trainer, corrupt_payload


@pytest.fixture
def bucket(tmp_path) -> str:
    return str(tmp_path / "bucket")


def make(trainer: Trainer, bucket: str, tmp_path, device="cpu", rid="r0"):
    shapes = {n: a.shape for n, a in trainer.bits.items()}
    eng = FakeEngine(shapes, device=device)
    loop = SyncLoop(bucket, eng, rid, stage_dir=str(tmp_path / f"stage-{rid}"))
    loop.connect()
    return eng, loop


def serving(char_model_dir, bucket, tmp_path, deltas=0, device="cpu", **trainer_kw):
    """A trainer that published v0 and ``deltas`` deltas, and a loop that serves the newest."""
    tr = Trainer(char_model_dir, bucket, **trainer_kw)
    eng, loop = make(tr, bucket, tmp_path, device)
    tr.publish_many(deltas)
    loop.poll_once()
    return tr, eng, loop


def assert_exact(eng: FakeEngine, loop: SyncLoop, trainer: Trainer, version: int):
    assert loop.served_version == version and eng.version == str(version)
    want = trainer.versions[version]
    for n, a in want.items():
        assert np.array_equal(loop.held.tensors[n], a), n
        assert np.array_equal(eng.weights[n], a), n
    assert not eng.paused


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_follows_each_version_bit_exact(char_model_dir, bucket, tmp_path, device):
    tr = Trainer(char_model_dir, bucket)
    eng, loop = make(tr, bucket, tmp_path, device)
    assert loop.apply_path == ("reload" if device == "cpu" else "in-place")
    assert loop.poll_once() is None  # nothing published yet
    tr.publish()
    rec = loop.poll_once()
    assert rec.kind == "anchor" and eng.applies[-1][0] == "reload"
    assert_exact(eng, loop, tr, 0)
    for i in range(4):
        v = tr.publish_many(1)
        rec = loop.poll_once()
        assert rec.kind == "delta" and rec.version == v and rec.paused_s >= rec.apply_s > 0
        assert_exact(eng, loop, tr, v)
        if i == 0 and device == "cpu":  # q_proj and up_proj changed: all shards reloaded
            names = eng.applies[-1][1]
            assert "model.layers.0.self_attn.k_proj.weight" in names
            assert "model.layers.0.self_attn.v_proj.weight" in names
            assert "model.layers.1.mlp.gate_proj.weight" in names
            assert "model.layers.1.self_attn.q_proj.weight" not in names
        if device == "cuda":
            assert eng.applies[-1][0] == "in-place"
    hb = json.loads(loop.store.read_bytes(heartbeat_path("r0")))
    assert hb["held_version"] == 4 and hb["lag_versions"] == 0 and hb["status"] == "ok"
    assert [r["version"] for r in hb["recent"]] == [0, 1, 2, 3, 4]
    tr.close()


def test_several_versions_behind_apply_in_one_pause(char_model_dir, bucket, tmp_path):
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path)
    v = tr.publish_many(3)
    pauses = eng.pauses
    rec = loop.poll_once()
    assert rec.kind == "chain" and rec.steps == 3 and eng.pauses == pauses + 1
    assert_exact(eng, loop, tr, v)
    tr.close()


def test_late_replica_starts_from_newest_anchor(char_model_dir, bucket, tmp_path):
    tr = Trainer(char_model_dir, bucket, anchor_every=2)
    v = tr.publish_many(5)
    eng, loop = make(tr, bucket, tmp_path, rid="late")
    rec = loop.poll_once()
    assert rec.kind == "anchor" and rec.steps == 2  # anchor v4 + delta v5
    assert_exact(eng, loop, tr, v)
    tr.close()


def test_corrupt_delta_is_refused_then_recovered_from_next_anchor(char_model_dir, bucket, tmp_path):
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 2, anchor_every=4)
    assert_exact(eng, loop, tr, 2)
    tr.publish_many(1)  # v3, a delta only
    m = Manifest.from_json(loop.store.read_bytes(MANIFEST_PATH))
    corrupt_payload(loop.store.root, m.entry(3).delta.files[0].path)
    pauses = eng.pauses
    assert loop.poll_once() is None
    assert eng.pauses == pauses  # refused before any pause
    assert_exact(eng, loop, tr, 2)
    assert loop.status == "error" and "DeltaCorruptError" in loop.last_error
    hb = json.loads(loop.store.read_bytes(heartbeat_path("r0")))
    assert hb["errors"] >= 1 and hb["lag_versions"] == 1 and hb["held_version"] == 2
    assert loop.poll_once() is None  # still no clean path: keeps serving v2
    tr.publish(names=None)  # v4: anchor (+ delta over the bad v3)
    rec = loop.poll_once()
    assert rec.kind == "anchor" and rec.version == 4
    assert_exact(eng, loop, tr, 4)
    assert loop.status == "ok"
    tr.close()


@pytest.mark.parametrize("newer", [False, True])
def test_failed_pause_is_retried(char_model_dir, bucket, tmp_path, newer):
    """A pause the engine refuses applies nothing; the verified version is served at the next
    poll, merged with a version published meanwhile (``newer``)."""
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, device="cuda")  # in-place: merged
    v = tr.publish_many(1)
    eng.fail_pause = 1
    assert loop.poll_once() is None
    assert loop.served_version == 0 and eng.version == "0" and not eng.paused
    assert all(np.array_equal(eng.weights[n], a) for n, a in tr.versions[0].items())
    assert loop.status == "error" and "pause" in loop.last_error
    if newer:
        v = tr.publish_many(1)
    rec = loop.poll_once()
    assert rec.version == v and rec.from_version == 0 and rec.steps == v
    assert_exact(eng, loop, tr, v)
    assert loop.status == "ok"
    tr.close()


def test_unexpected_error_does_not_stop_the_thread(char_model_dir, bucket, tmp_path, monkeypatch):
    """An error nobody expected, in the poll itself, is reported, and the loop's thread goes on
    following the bucket."""
    tr = Trainer(char_model_dir, bucket)
    eng, loop = make(tr, bucket, tmp_path)
    loop.follower.poll_interval_s = 0.05
    real, calls = loop.subscriber.read_manifest, []

    def broken_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real()

    monkeypatch.setattr(loop.subscriber, "read_manifest", broken_once)
    tr.publish()
    loop.start()
    deadline = time.time() + 30
    while loop.served_version != 0 and time.time() < deadline:
        time.sleep(0.05)
    loop.stop()
    assert "RuntimeError: injected" in loop.last_error and loop.errors >= 1
    assert_exact(eng, loop, tr, 0)
    tr.close()


def test_wrong_base_is_refused_and_recovered(char_model_dir, bucket, tmp_path):
    """A trainer that diverged (another history to the same version numbers) publishes a delta
    whose base v2 is not the v2 the replica holds: the result digests disagree, so it is
    refused; its next anchor is taken. The diverged trainer publishes into a bucket of its own,
    and its versions are carried into the run's bucket through the public Store and Manifest."""
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 2, anchor_every=4)
    tr.close()
    other = str(tmp_path / "diverged")
    tr2 = Trainer(char_model_dir, other, anchor_every=4, seed=7)
    tr2.publish()
    tr2.publish(["model.norm.weight"])
    tr2.publish(["model.norm.weight"])  # its own v2, not the replica's

    def carry(version: int) -> None:
        """Copy ``version``'s files and manifest entry from the diverged bucket to the run's."""
        src, dst = Store(other), Store(bucket)
        entry = Manifest.from_json(src.read_bytes(MANIFEST_PATH)).entry(version)
        for payload in (entry.delta, entry.anchor):
            for f in payload.files if payload else []:
                dst.write_bytes(f.path, src.read_bytes(f.path))
        run = Manifest.from_json(dst.read_bytes(MANIFEST_PATH))
        dst.write_bytes(
            MANIFEST_PATH, run.model_copy(update={"versions": [*run.versions, entry]}).to_json()
        )

    v3 = tr2.publish(["model.norm.weight", "model.layers.0.mlp.up_proj.weight"])
    carry(v3)
    assert loop.poll_once() is None
    assert loop.served_version == 2 and "digest" in loop.last_error
    v4 = tr2.publish(["model.norm.weight"])  # anchor (anchor_every=4)
    carry(v4)
    rec = loop.poll_once()
    assert rec.version == v4 == v3 + 1 and rec.kind == "anchor"
    assert_exact(eng, loop, tr2, v4)
    tr2.close()


def test_failed_apply_stays_paused_until_full_reload(char_model_dir, bucket, tmp_path):
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path)
    v = tr.publish_many(1)
    eng.fail_next = 2  # the apply and the first full reload fail
    assert loop.poll_once() is None
    assert loop.dirty and eng.paused and not loop.ready
    assert loop.poll_once() is None  # the retry of the full reload succeeds
    assert not loop.dirty and loop.ready
    assert_exact(eng, loop, tr, v)
    assert eng.applies[-1][1] == sorted(tr.bits)  # every tensor reloaded
    tr.close()


def test_truncated_delta_is_refused_and_replica_keeps_serving(char_model_dir, bucket, tmp_path):
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 1, anchor_every=3)
    tr.publish_many(1)  # v2, a delta only
    m = Manifest.from_json(loop.store.read_bytes(MANIFEST_PATH))
    path = m.entry(2).delta.files[0].path
    data = loop.store.read_bytes(path)
    loop.store.write_bytes(path, data[: len(data) // 2])  # an interrupted copy
    pauses = eng.pauses
    assert loop.poll_once() is None
    assert eng.pauses == pauses and loop.status == "error"
    assert "DeltaCorruptError" in loop.last_error and "bytes" in loop.last_error
    assert_exact(eng, loop, tr, 1)
    tr.publish(names=None)  # v3: anchor
    rec = loop.poll_once()
    assert rec.kind == "anchor" and rec.version == 3
    assert_exact(eng, loop, tr, 3)
    tr.close()


def test_deleted_delta_is_replanned(char_model_dir, bucket, tmp_path):
    """A payload file that vanished (e.g. retention ran between the manifest read and the fetch)
    is reported; the replica keeps serving and follows once a path exists again."""
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 1, anchor_every=3)
    tr.publish_many(1)  # v2, a delta only
    m = Manifest.from_json(loop.store.read_bytes(MANIFEST_PATH))
    loop.store.rm([m.entry(2).delta.files[0].path])
    assert loop.poll_once() is None
    assert "StoreNotFoundError" in loop.last_error
    assert_exact(eng, loop, tr, 1)
    tr.publish(names=None)  # v3: anchor
    rec = loop.poll_once()
    assert rec.version == 3 and rec.kind == "anchor"
    assert_exact(eng, loop, tr, 3)
    tr.close()


def test_unreadable_bucket_is_loud_within_one_poll_and_retried_slowly(
    char_model_dir, bucket, tmp_path, monkeypatch
):
    from deltasync.errors import StoreAuthError

    tr = Trainer(char_model_dir, bucket)
    tr.publish()
    eng, loop = make(tr, bucket, tmp_path)
    real = loop.subscriber.read_manifest

    def refused():
        raise StoreAuthError("read hf://buckets/me/run/manifest.json: HTTP 401 ... set HF_TOKEN")

    monkeypatch.setattr(loop.subscriber, "read_manifest", refused)
    assert loop.poll_once() is None  # reported, not raised
    assert loop.status == "error" and "HF_TOKEN" in loop.last_error
    assert loop.last_error.startswith("StoreAuthError")
    assert loop.next_poll_delay_s() == loop.error_poll_interval_s > loop.poll_interval_s
    hb = json.loads(open(f"{bucket}/{heartbeat_path('r0')}").read())
    assert hb["status"] == "error" and "HF_TOKEN" in hb["last_error"]
    monkeypatch.setattr(loop.subscriber, "read_manifest", real)  # the token was fixed
    rec = loop.poll_once()
    assert rec is not None and loop.status == "ok" and loop.served_version == 0
    assert loop.next_poll_delay_s() == loop.poll_interval_s


def test_polling_backs_off_while_nothing_changes(char_model_dir, bucket, tmp_path):
    tr = Trainer(char_model_dir, bucket)
    tr.publish()
    shapes = {n: a.shape for n, a in tr.bits.items()}
    loop = SyncLoop(
        bucket,
        FakeEngine(shapes),
        "r0",
        poll_interval_s=0.5,
        max_poll_interval_s=4.0,
        stage_dir=str(tmp_path / "stage"),
    )
    loop.connect()
    loop.poll_once()
    assert loop.served_version == 0 and loop.next_poll_delay_s() == 0.5
    delays = []
    for _ in range(5):
        loop.poll_once()
        delays.append(loop.next_poll_delay_s())
    assert delays == sorted(delays) and delays[0] > 0.5 and delays[-1] == 4.0
    tr.publish_many(1)
    loop.poll_once()
    assert loop.served_version == 1 and loop.next_poll_delay_s() == 0.5


def test_heartbeats_on_remote_stores_are_rationed(char_model_dir, bucket, tmp_path, monkeypatch):
    """Remote stores (each write is 2 Hub API requests): at most one heartbeat per 60 s while
    nothing changes, one right after an applied version, never two within the gap (60 s by default); local stores
    keep their interval and write state changes at once."""
    import rollout.sync_loop as sync_loop

    pytest.importorskip("huggingface_hub")  # the hf:// store (no request is made)
    tr = Trainer(char_model_dir, bucket)
    shapes = {n: a.shape for n, a in tr.bits.items()}
    remote = SyncLoop("hf://buckets/me/run", FakeEngine(shapes), "r0", heartbeat_interval_s=10)
    assert (remote.heartbeat_interval_s, remote.heartbeat_min_gap_s) == (60.0, 60.0)
    local = SyncLoop(bucket, FakeEngine(shapes), "r1", heartbeat_interval_s=10)
    assert (local.heartbeat_interval_s, local.heartbeat_min_gap_s) == (10, 0.0)

    t = [0.0]
    writes = []
    monkeypatch.setattr(sync_loop, "write_heartbeat", lambda store, hb: writes.append(t[0]))
    loop = SyncLoop(
        bucket,
        FakeEngine(shapes),
        "r0",
        heartbeat_interval_s=60,
        heartbeat_min_gap_s=30,
        stage_dir=str(tmp_path / "stage"),
        clock=lambda: t[0],
    )
    loop.connect()
    tr.publish()
    for now in range(0, 300, 5):  # nothing changes after v0: a heartbeat per 60 s
        t[0] = float(now)
        loop.poll_once()
    assert loop.served_version == 0
    assert writes == [0.0, 60.0, 120.0, 180.0, 240.0]
    t[0] = 250.0
    tr.publish_many(1)
    assert loop.poll_once() is not None  # applied, but 10 s after the last one: it waits
    assert writes[-1] == 240.0
    t[0] = 270.0
    loop.poll_once()  # the first poll after the 30 s gap writes it
    assert writes[-1] == 270.0
    t[0] = 301.0
    tr.publish_many(1)
    loop.poll_once()  # applied 31 s after the last heartbeat: written right away
    assert writes[-1] == 301.0 and loop.served_version == 2
    gaps = [b - a for a, b in zip(writes, writes[1:], strict=False)]
    assert min(gaps) >= 30
    tr.close()
