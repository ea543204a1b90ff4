"""Served is published: single faults in each step of a replica's sync, against a fake engine
that keeps the bf16 bits it is given (``FakeEngine``). Each test injects one failure (staging on a
full disk, the version record, the resume, the prefix reset, an old manifest written back, another
run's manifest) and then checks what a user would: the bits the engine serves against the
trainer's bits of the version the replica reports, whether it takes requests (``ready``), and what
its heartbeat says."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import heartbeat_path

from .rollout_helpers import FakeEngine, Trainer
from .test_sync_loop import assert_exact, make, serving

DOWN = "model.layers.0.mlp.down_proj.weight"
NORM = "model.norm.weight"
Q = "model.layers.0.self_attn.q_proj.weight"  # changed by v1 (rollout_helpers.EDITS[0])


@pytest.fixture
def bucket(tmp_path) -> str:
    return str(tmp_path / "bucket")


def heartbeat(loop) -> dict:
    return json.loads(loop.store.read_bytes(heartbeat_path(loop.replica_id)))


def served_matches(eng: FakeEngine, trainer: Trainer, version: int) -> bool:
    return all(np.array_equal(eng.weights[n], a) for n, a in trainer.versions[version].items())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_failed_stage_never_serves_mixed_weights(
    char_model_dir, bucket, tmp_path, device, monkeypatch
):
    """The reviewer's case: staging v2 (it changes ``down_proj``) hits a full disk once; v3
    changes only ``model.norm.weight``. Before, v3's delta was staged onto v1 and the replica
    reported v3, status ok, with ``down_proj`` still at v1. Now the failed pull is kept, the next
    stage goes from what vLLM serves (v1) to v3, and every served tensor is v3's."""
    import rollout.staging as staging

    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 1, device=device)
    assert_exact(eng, loop, tr, 1)
    real, calls = staging.serialize_file, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(staging, "serialize_file", full_disk)
    v2 = tr.publish([DOWN])
    assert loop.poll_once() is None
    # nothing reached vLLM: it serves v1 whole, and says so
    assert loop.served_version == 1 and eng.version == "1" and served_matches(eng, tr, 1)
    assert loop.held.version == v2 and loop.status == "error" and "No space left" in loop.last_error
    hb = heartbeat(loop)
    assert hb["held_version"] == 1 and hb["status"] == "error" and hb["lag_versions"] == 1
    v3 = tr.publish([NORM])
    rec = loop.poll_once()
    assert rec.version == v3 and rec.from_version == 1
    assert_exact(eng, loop, tr, v3)  # down_proj at v3 too
    assert not np.array_equal(tr.versions[1][DOWN], tr.versions[v3][DOWN])
    assert loop.status == "ok" and heartbeat(loop)["held_version"] == v3
    tr.close()


def test_a_stage_that_does_not_start_at_the_served_version_reloads_every_tensor(
    char_model_dir, bucket, tmp_path
):
    """The staging's own guard: a pull whose plan starts elsewhere than the served version is
    staged as every tensor, never as patches onto the wrong base."""
    from rollout.staging import stage_pull

    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 1)
    tr.publish([DOWN])
    pulled = loop.follower.poll()  # held v2, not served
    assert pulled.plan.from_version == 1
    staged = stage_pull(
        pulled, loop.held, loop.info, "in-place", 0, str(tmp_path / "s.safetensors")
    )
    assert staged.mode == "reload" and staged.tensors == len(tr.bits)
    tr.close()


@pytest.mark.parametrize("fault", ["fail_set_version", "fail_resume"])
def test_a_failed_version_record_or_resume_is_not_ready_until_reloaded(
    char_model_dir, bucket, tmp_path, fault
):
    """After the apply, recording the version or resuming fails once: the replica is not ready
    (the front answers 503), its status is ``recovering``, never ``ok``; the next poll reloads
    every tensor, records the version and resumes, and it serves the version it reports."""
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, device="cuda")
    v = tr.publish_many(1)
    setattr(eng, fault, 2)  # the sync's call, and the same call in its immediate full reload
    assert loop.poll_once() is None
    assert not loop.ready and loop.status == "recovering" and loop.dirty
    assert loop.served_version == 0  # what it reports is never the new version unproven
    hb = heartbeat(loop)
    assert hb["status"] == "recovering" and "injected" in hb["last_error"]
    loop.poll_once()
    assert loop.ready and loop.status == "ok" and not eng.paused
    assert_exact(eng, loop, tr, v)
    assert eng.applies[-1] == ("reload", sorted(tr.bits))  # every tensor reloaded
    tr.close()


def test_a_failed_prefix_reset_is_retried_not_fatal(char_model_dir, bucket, tmp_path):
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path)
    v = tr.publish_many(1)
    eng.fail_reset = 1
    rec = loop.poll_once()
    assert rec.version == v and loop.ready and loop._prefix_reset_pending
    assert_exact(eng, loop, tr, v)
    loop.poll_once()
    assert not loop._prefix_reset_pending
    tr.close()


def test_an_old_manifest_written_back_never_moves_a_replica_backward(
    char_model_dir, bucket, tmp_path
):
    """Writing v1's manifest back over v2's (a replay, or a cache answering a stale read) used
    to move the replica to v1 with status ok. Now it is ignored and reported, the replica keeps
    serving v2, and once the current manifest is read again it is ok."""
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 1)
    old = loop.store.read_bytes(MANIFEST_PATH)
    v2 = tr.publish_many(1)
    loop.poll_once()
    assert_exact(eng, loop, tr, v2)
    current = loop.store.read_bytes(MANIFEST_PATH)
    loop.store.write_bytes(MANIFEST_PATH, old)
    pauses = eng.pauses
    assert loop.poll_once() is None
    assert eng.pauses == pauses  # nothing touched
    assert_exact(eng, loop, tr, v2)
    assert loop.status == "error" and "StaleManifestError" in loop.last_error
    hb = heartbeat(loop)
    assert hb["held_version"] == v2 and hb["newest_seen"] == v2
    loop.store.write_bytes(MANIFEST_PATH, current)
    loop.poll_once()
    assert loop.status == "ok" and loop.served_version == v2
    tr.close()


def test_a_manifest_of_another_run_is_refused(char_model_dir, bucket, tmp_path):
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 1)
    other = Trainer(char_model_dir, str(tmp_path / "other"), seed=3)
    other.publish_many(4)  # another run, further on
    foreign = other.pub.store.read_bytes(MANIFEST_PATH)
    assert (
        Manifest.from_json(foreign).run_id
        != Manifest.from_json(loop.store.read_bytes(MANIFEST_PATH)).run_id
    )
    loop.store.write_bytes(MANIFEST_PATH, foreign)
    pauses = eng.pauses
    assert loop.poll_once() is None
    assert eng.pauses == pauses
    assert_exact(eng, loop, tr, 1)
    assert loop.status == "error" and "ForeignRunError" in loop.last_error
    assert heartbeat(loop)["newest_seen"] == 1
    tr.close()
    other.close()


def test_a_replica_that_starts_after_faults_serves_the_newest_version_whole(
    char_model_dir, bucket, tmp_path
):
    """The outcome a user checks across the faults above: a second replica started fresh and the
    faulted one serve the same bits, the trainer's newest."""
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 2)
    eng.fail_set_version = 2
    v = tr.publish_many(1)
    loop.poll_once()
    loop.poll_once()
    eng2, loop2 = make(tr, bucket, tmp_path, rid="fresh")
    loop2.poll_once()
    assert_exact(eng, loop, tr, v)
    assert_exact(eng2, loop2, tr, v)
    assert all(np.array_equal(eng.weights[n], eng2.weights[n]) for n in eng.weights)
    tr.close()


def test_the_full_weights_check_finds_a_wrong_tensor_no_patch_touched_and_repairs_it(
    char_model_dir, bucket, tmp_path
):
    """A served tensor goes wrong behind the sync's back (the worker's own in-place check covers
    only the tensors in a patch): the check compares every served tensor's digest with the
    version's verified digests, names the tensor, repairs it by a full reload, and a clean check
    follows."""
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path, 2)
    first = loop.check_served()
    assert first["mismatched"] == [] and first["tensors"] == len(tr.bits)
    assert loop.status == "ok"
    pauses = eng.pauses
    eng.weights[DOWN] = eng.weights[DOWN].copy()
    eng.weights[DOWN].reshape(-1)[7] ^= np.uint16(1)  # one bit of one element
    out = loop.check_served()
    assert out["mismatched"] == [DOWN] and out["version"] == 2 and out["repaired"]
    assert eng.pauses == pauses + 1  # the repair's pause; the check itself pauses nothing
    assert DOWN in loop.last_error and loop.errors == 1  # said, and repaired: status ok
    assert loop.status == "ok" and "differ" in heartbeat(loop)["last_error"]
    assert_exact(eng, loop, tr, 2)  # repaired
    assert loop.check_served()["mismatched"] == []
    loop.poll_once()
    assert loop.status == "ok" and loop.ready
    tr.close()


def test_a_recovery_is_checked_and_a_reload_that_does_not_serve_the_bits_stays_paused(
    char_model_dir, bucket, tmp_path, monkeypatch
):
    """After a full reload the check runs at once; an engine whose reload leaves a wrong tensor
    (here: one reload that skips a tensor) is not ready and stays paused until a reload that
    serves the bits."""
    tr, eng, loop = serving(char_model_dir, bucket, tmp_path)
    v = tr.publish_many(1)
    eng.fail_next = 1  # the apply fails: a full reload follows
    real_apply, skipped = eng.apply, []

    def lossy_apply(path, mode):
        got = real_apply(path, mode)
        if mode == "reload" and len(eng.applies[-1][1]) == len(tr.bits) and not skipped:
            skipped.append(Q)
            eng.weights[Q] = tr.versions[0][Q].copy()  # one tensor v1 changed left at v0
        return got

    monkeypatch.setattr(eng, "apply", lossy_apply)
    reads = eng.readbacks
    assert loop.poll_once() is None
    assert eng.readbacks == reads + 1 and skipped == [Q]
    assert not loop.ready and eng.paused and Q in loop.last_error
    assert loop.served_version == 0  # never reported as v1 while a tensor is not v1's
    assert heartbeat(loop)["status"] == "recovering"
    loop.poll_once()  # the next full reload serves the bits; checked again
    assert loop.ready and not eng.paused and eng.readbacks == reads + 2
    assert_exact(eng, loop, tr, v)
    tr.close()


def test_the_check_runs_on_its_schedule(char_model_dir, bucket, tmp_path):
    """``check_interval_s``: a poll that finds nothing new checks once the interval passed."""
    from rollout.sync_loop import SyncLoop

    now = [0.0]
    tr = Trainer(char_model_dir, bucket)
    eng = FakeEngine({n: a.shape for n, a in tr.bits.items()})
    loop = SyncLoop(
        bucket,
        eng,
        "sched",
        stage_dir=str(tmp_path / "st"),
        clock=lambda: now[0],
        check_interval_s=60.0,
    )
    tr.publish_many(1)
    loop.poll_once()
    loop.poll_once()
    assert loop.checks == []
    now[0] = 61.0
    loop.poll_once()
    assert [c["version"] for c in loop.checks] == [1] and loop.checks[0]["mismatched"] == []
    loop.poll_once()
    assert len(loop.checks) == 1  # not again before the next interval
    tr.close()
