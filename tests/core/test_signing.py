"""Signed versions (``deltasync.signing``): a reader given the run's public key follows a signed run
bit for bit, and refuses, keeping the bits it holds, a version whose payload was changed (its xxh3
recomputed in the manifest, so that only the signature catches it), a payload changed under an
intact manifest (only its signed SHA-256 catches it), an unsigned manifest, a manifest signed by
another key, and an older signed manifest written back. Readers without a key still read signed
and unsigned runs. A key file others can read is refused."""

from __future__ import annotations

import os

import pytest
import xxhash

from deltasync.errors import (
    ForeignKeyError,
    KeyFileError,
    PayloadDigestError,
    SignatureError,
    StaleManifestError,
    UnsignedVersionError,
)
from deltasync.follow import Follower
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.publisher import DeltaPublisher
from deltasync.signing import RunKey, load_or_create, sign_manifest
from deltasync.store import Store

from .test_follow import assert_bits


def _publish(pub, trainer, k=1):
    for _ in range(k):
        trainer.step()
        v = pub.publish(trainer.named(), step=0)
        pub.flush()
    return v


def _reader(bucket, key: RunKey):
    reported = []
    follower = Follower(bucket, public_key=key.public_key, report=lambda e, w: reported.append(e))
    return follower, reported


def _held_bits(follower):
    return {n: a.copy() for n, a in follower.held.tensors.items()}


def _unchanged(follower, version, bits):
    return follower.held.version == version and all(
        (follower.held.tensors[n] == b).all() for n, b in bits.items()
    )


@pytest.fixture
def key():
    return RunKey.generate()


def test_a_signed_run_is_followed_bit_for_bit(bucket, trainer, key):
    follower, reported = _reader(bucket, key)
    with DeltaPublisher(bucket, signer=key) as pub:
        for _ in range(3):
            v = _publish(pub, trainer)
            assert follower.poll().version == v
            assert_bits(follower, trainer.bits())
    assert not reported
    manifest = Manifest.from_json(Store(bucket).read_bytes(MANIFEST_PATH))
    assert manifest.signature.public_key == key.public_key
    assert all(len(f.sha256) == 64 for v in manifest.versions for f in (v.anchor or v.delta).files)
    # a reader without the key (dashboard, make eval, resume) reads it as well
    plain = Follower(bucket)
    assert plain.poll().version == v


def test_an_unsigned_run_is_still_read_without_a_key(bucket, trainer):
    with DeltaPublisher(bucket) as pub:
        v = _publish(pub, trainer, 2)
    raw = Store(bucket).read_bytes(MANIFEST_PATH)
    assert b"signature" not in raw and b"sha256" not in raw  # the unsigned JSON is unchanged
    assert Follower(bucket).poll().version == v


def _tamper_payload(store: Store, manifest: Manifest, recompute_xxh3: bool) -> bytes:
    """Flip one byte near the end of the newest version's first payload file; with
    ``recompute_xxh3``, also write its new xxh3 into the manifest (keeping the old signature).
    Returns the manifest bytes written back."""
    latest = manifest.latest
    ref = (latest.delta or latest.anchor).files[0]
    data = bytearray(store.read_bytes(ref.path))
    data[-5] ^= 0x01
    store.write_bytes(ref.path, bytes(data))
    if recompute_xxh3:
        ref.digest = xxhash.xxh3_64_hexdigest(bytes(data))
        store.write_bytes(MANIFEST_PATH, manifest.to_json())
    return manifest.to_json()


def test_a_changed_payload_with_its_xxh3_recomputed_is_refused(bucket, trainer, key):
    store = Store(bucket)
    follower, reported = _reader(bucket, key)
    with DeltaPublisher(bucket, signer=key) as pub:
        v = _publish(pub, trainer)
        follower.poll()
        bits = _held_bits(follower)
        _publish(pub, trainer)
        manifest = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
        _tamper_payload(store, manifest, recompute_xxh3=True)
        assert follower.poll() is None
        assert type(reported[-1]) is SignatureError
        assert "changed after it was signed" in str(reported[-1])
        assert _unchanged(follower, v, bits)
        # the trainer's next commit signs its own history, not the changed one: the changed
        # file is still refused (by its signed SHA-256), and the reader keeps its bits
        _publish(pub, trainer)
        signed = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
        assert signed.entry(v + 1).delta.files[0].digest != manifest.latest.delta.files[0].digest
        assert follower.poll() is None
        assert isinstance(reported[-1], PayloadDigestError)
        assert _unchanged(follower, v, bits)
        # once the trainer publishes an anchor, the reader goes around the changed delta
        pub.config.anchor_every = 1
        v4 = _publish(pub, trainer)
        pulled = follower.poll()
        assert pulled.version == v4 and pulled.kind == "anchor"
        assert_bits(follower, trainer.bits())


def test_a_changed_payload_under_an_intact_manifest_is_refused(bucket, trainer, key):
    """Even were the xxh3 to collide, the signed SHA-256 of the bytes refuses the file."""
    store = Store(bucket)
    follower, reported = _reader(bucket, key)
    with DeltaPublisher(bucket, signer=key) as pub:
        v = _publish(pub, trainer)
        follower.poll()
        bits = _held_bits(follower)
        _publish(pub, trainer)
        _tamper_payload(store, Manifest.from_json(store.read_bytes(MANIFEST_PATH)), False)
        assert follower.poll() is None
        assert isinstance(reported[-1], PayloadDigestError)
        assert "(signed)" in str(reported[-1])
        assert _unchanged(follower, v, bits)


def test_an_unsigned_manifest_is_refused(bucket, trainer, key):
    store = Store(bucket)
    follower, reported = _reader(bucket, key)
    with DeltaPublisher(bucket, signer=key) as pub:
        v = _publish(pub, trainer)
        follower.poll()
        bits = _held_bits(follower)
        _publish(pub, trainer)
    manifest = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    store.write_bytes(MANIFEST_PATH, manifest.model_copy(update={"signature": None}).to_json())
    assert follower.poll() is None
    assert isinstance(reported[-1], UnsignedVersionError)
    assert "found no signature" in str(reported[-1]) and "RUN_PUBLIC_KEY" in str(reported[-1])
    assert _unchanged(follower, v, bits) and follower.newest_seen == v


def test_a_manifest_signed_by_another_key_is_refused(bucket, trainer, key):
    store = Store(bucket)
    follower, reported = _reader(bucket, key)
    other = RunKey.generate()
    with DeltaPublisher(bucket, signer=key) as pub:
        v = _publish(pub, trainer)
        follower.poll()
        bits = _held_bits(follower)
        _publish(pub, trainer)
        good = store.read_bytes(MANIFEST_PATH)
        forged = sign_manifest(Manifest.from_json(good), other)
        store.write_bytes(MANIFEST_PATH, forged.to_json())
        assert follower.poll() is None
        assert isinstance(reported[-1], ForeignKeyError)
        assert other.public_key in str(reported[-1]) and key.public_key in str(reported[-1])
        assert _unchanged(follower, v, bits)
        store.write_bytes(MANIFEST_PATH, good)  # the run's own manifest is followed again
        assert follower.poll().version == v + 1


def test_a_replayed_older_signed_manifest_is_refused(bucket, trainer, key):
    store = Store(bucket)
    follower, reported = _reader(bucket, key)
    with DeltaPublisher(bucket, signer=key) as pub:
        _publish(pub, trainer)
        old = store.read_bytes(MANIFEST_PATH)  # validly signed, by the run's key
        v = _publish(pub, trainer, 2)
        follower.poll()
        bits = _held_bits(follower)
        store.write_bytes(MANIFEST_PATH, old)
        assert follower.poll() is None
        assert isinstance(reported[-1], StaleManifestError)
        assert _unchanged(follower, v, bits)


def test_a_reader_with_a_key_refuses_without_a_reporter(bucket, trainer, key):
    with DeltaPublisher(bucket) as pub:
        _publish(pub, trainer)
    with pytest.raises(UnsignedVersionError, match="expected a manifest signed by the run key"):
        Follower(bucket, public_key=key.public_key).poll()


def test_a_resumed_unsigned_run_goes_on_signed(bucket, trainer, key):
    """A run that started unsigned and resumes with a key: its old payloads have no signed
    SHA-256, so a reader with the key starts from the new (signed) anchor."""
    with DeltaPublisher(bucket) as pub:
        _publish(pub, trainer, 2)
    with DeltaPublisher(bucket, signer=key) as pub:
        v = _publish(pub, trainer)
    follower, reported = _reader(bucket, key)
    assert follower.poll().version == v
    assert_bits(follower, trainer.bits())


def test_key_files(tmp_path):
    path = tmp_path / "keys" / "run_key.pem"
    key, made = load_or_create(path)
    assert made and os.stat(path).st_mode & 0o777 == 0o600
    again, made = load_or_create(path)  # kept across deploys and restarts
    assert not made and again.public_key == key.public_key
    assert len(key.public_key) == 44 and "PRIVATE" not in repr(key)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match=f"found mode 0644; fix: chmod 600 {path}"):
        RunKey.load(path)
    with pytest.raises(KeyFileError, match="found no file"):
        RunKey.load(tmp_path / "missing.pem")
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    bad.chmod(0o600)
    with pytest.raises(KeyFileError, match="does not load"):
        RunKey.load(bad)


def test_a_malformed_public_key_is_refused_at_start(bucket):
    with pytest.raises(KeyFileError, match="base64 of 32 bytes"):
        Follower(bucket, public_key="not-a-key")
