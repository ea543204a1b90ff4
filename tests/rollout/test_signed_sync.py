"""Signed versions on a replica (``RUN_PUBLIC_KEY``): it serves a version signed by the run key bit
for bit; a version whose payload was changed (its xxh3 recomputed in the manifest, so only the
signature catches it), an unsigned manifest, one signed by another key, and an older signed
manifest written back are each refused: nothing of it reaches the engine (no pause), it keeps
serving its version bit for bit, and its heartbeat (what the dashboard shows) says why."""

from __future__ import annotations

import json

import pytest
import xxhash

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.signing import RunKey, sign_manifest
from deltasync.status import heartbeat_path
from rollout.sync_loop import SyncLoop

from .rollout_helpers import FakeEngine, Trainer
from .test_sync_loop import assert_exact


@pytest.fixture
def key() -> RunKey:
    return RunKey.generate()


def signed_replica(char_model_dir, tmp_path, key: RunKey, public_key: str | None = None):
    """A signing trainer that published v0 and v1, and a replica with the run's public key
    serving v1."""
    bucket = str(tmp_path / "bucket")
    tr = Trainer(char_model_dir, bucket, signer=key)
    eng = FakeEngine({n: a.shape for n, a in tr.bits.items()})
    loop = SyncLoop(
        bucket, eng, "signed", stage_dir=str(tmp_path / "stage"), public_key=key.public_key
    )
    loop.connect()
    tr.publish_many(1)
    loop.poll_once()
    return tr, eng, loop


def heartbeat(loop) -> dict:
    return json.loads(loop.store.read_bytes(heartbeat_path(loop.replica_id)))


def test_a_signed_run_is_served_bit_for_bit(char_model_dir, tmp_path, key):
    tr, eng, loop = signed_replica(char_model_dir, tmp_path, key)
    assert_exact(eng, loop, tr, 1)
    for _ in range(2):
        v = tr.publish_many(1)
        assert loop.poll_once().version == v
        assert_exact(eng, loop, tr, v)
    hb = heartbeat(loop)
    assert hb["status"] == "ok" and hb["held_version"] == v and hb["last_error"] is None
    tr.close()


def _changed_payload(store, manifest: Manifest) -> bytes:
    ref = manifest.latest.delta.files[0]
    data = bytearray(store.read_bytes(ref.path))
    data[-5] ^= 0x01
    store.write_bytes(ref.path, bytes(data))
    ref.digest = xxhash.xxh3_64_hexdigest(bytes(data))  # the unkeyed digest agrees again
    return manifest.to_json()


ATTACKS = {
    "changed payload, xxh3 recomputed": (
        _changed_payload,
        "SignatureError",
        "changed after it was signed",
    ),
    "unsigned": (
        lambda store, m: m.model_copy(update={"signature": None}).to_json(),
        "UnsignedVersionError",
        "found no signature",
    ),
    "another key": (
        lambda store, m: sign_manifest(m, RunKey.generate()).to_json(),
        "ForeignKeyError",
        "found one by key",
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_forged_version_is_refused_and_the_served_one_kept(char_model_dir, tmp_path, key, attack):
    forge, kind, why = ATTACKS[attack]
    tr, eng, loop = signed_replica(char_model_dir, tmp_path, key)
    v2 = tr.publish_many(1)  # v2 is in the bucket, then its manifest is forged
    manifest = Manifest.from_json(loop.store.read_bytes(MANIFEST_PATH))
    loop.store.write_bytes(MANIFEST_PATH, forge(loop.store, manifest))
    pauses, applies = eng.pauses, len(eng.applies)
    assert loop.poll_once() is None
    assert eng.pauses == pauses and len(eng.applies) == applies  # nothing reached vLLM
    assert_exact(eng, loop, tr, 1)  # still serving v1, bit for bit
    assert loop.ready and loop.status == "error"
    hb = heartbeat(loop)
    assert hb["held_version"] == 1 and hb["status"] == "error"
    assert hb["last_error"].startswith(f"{kind}:") and why in hb["last_error"]
    assert v2 == 2
    tr.close()


def test_a_replayed_older_signed_manifest_is_refused(char_model_dir, tmp_path, key):
    tr, eng, loop = signed_replica(char_model_dir, tmp_path, key)
    old = loop.store.read_bytes(MANIFEST_PATH)  # v1's, validly signed by the run key
    v2 = tr.publish_many(1)
    loop.poll_once()
    assert_exact(eng, loop, tr, v2)
    loop.store.write_bytes(MANIFEST_PATH, old)
    pauses = eng.pauses
    assert loop.poll_once() is None
    assert eng.pauses == pauses
    assert_exact(eng, loop, tr, v2)
    hb = heartbeat(loop)
    assert hb["held_version"] == v2 and hb["last_error"].startswith("StaleManifestError:")
    tr.close()


def test_an_unsigned_run_is_never_served_by_a_replica_with_a_key(char_model_dir, tmp_path, key):
    bucket = str(tmp_path / "bucket")
    tr = Trainer(char_model_dir, bucket)  # publishes without a key
    eng = FakeEngine({n: a.shape for n, a in tr.bits.items()})
    loop = SyncLoop(bucket, eng, "r", stage_dir=str(tmp_path / "s"), public_key=key.public_key)
    loop.connect()
    tr.publish_many(1)
    assert loop.poll_once() is None
    assert not loop.ready and loop.served_version is None and not eng.applies
    assert heartbeat(loop)["last_error"].startswith("UnsignedVersionError:")
    tr.close()
