"""The bucket store (deltasync.store): atomic local writes, listing, retries of transient errors,
immediate typed failures for missing objects and refused credentials, URI validation."""

import os

import pytest

from deltasync.errors import StoreAuthError, StoreError, StoreNotFoundError
from deltasync.store import Store


def test_roundtrip_and_listing(bucket):
    s = Store(bucket)
    s.write_bytes("a/b/c.bin", b"123")
    s.write_bytes("a/d.bin", b"45")
    assert s.read_bytes("a/b/c.bin") == b"123"
    assert sorted(s.ls("a")) == ["a/b/c.bin", "a/d.bin"]
    assert s.ls("nothing-here") == []
    s.rm(["a/d.bin", "a/never-existed"])
    assert not s.exists("a/d.bin")
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        s.read_bytes("a/d.bin")


def test_put_and_get_file(bucket, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    s = Store(bucket)
    s.put_file(str(src), "big/part-0000.safetensors")
    dst = tmp_path / "dst.bin"
    s.get_file("big/part-0000.safetensors", str(dst))
    assert dst.read_bytes() == src.read_bytes()


def test_local_write_is_atomic_and_leaves_no_temp(tmp_path):
    s = Store(str(tmp_path / "b"))
    s.write_bytes("manifest.json", b"old")
    s.write_bytes("manifest.json", b"new")
    assert s.read_bytes("manifest.json") == b"new"
    assert os.listdir(tmp_path / "b") == ["manifest.json"]


def test_transient_errors_are_retried(tmp_path, monkeypatch):
    s = Store(str(tmp_path / "b"), backoff_s=0.001)
    s.write_bytes("x", b"1")
    calls = []
    real = s.fs.cat_file

    def flaky(path, *a, **k):
        calls.append(path)
        if len(calls) < 3:
            raise ConnectionError("reset by peer")
        return real(path, *a, **k)

    monkeypatch.setattr(s.fs, "cat_file", flaky)
    assert s.read_bytes("x") == b"1"
    assert len(calls) == 3


def test_persistent_transient_error_raises_store_error(tmp_path, monkeypatch):
    s = Store(str(tmp_path / "b"), retries=2, backoff_s=0.001)

    def down(*a, **k):
        raise TimeoutError("timed out")

    monkeypatch.setattr(s.fs, "cat_file", down)
    with pytest.raises(StoreError, match="after 2 attempts"):
        s.read_bytes("x")


def test_auth_error_fails_at_once(tmp_path, monkeypatch):
    s = Store(str(tmp_path / "b"), backoff_s=10)  # a retry would make this test hang
    calls = []

    def refused(*a, **k):
        calls.append(1)
        raise PermissionError("401 Unauthorized")

    monkeypatch.setattr(s.fs, "cat_file", refused)
    with pytest.raises(StoreAuthError, match="HF_TOKEN"):
        s.read_bytes("x")
    assert len(calls) == 1


def test_uri_validation():
    with pytest.raises(ValueError, match="hf://buckets"):
        Store("hf://datasets/someone/repo")
    with pytest.raises(ValueError, match="expected a store URI"):
        Store("")


def test_resolve_uri_shorthands(tmp_path, monkeypatch):
    from deltasync.store import resolve_uri

    monkeypatch.chdir(tmp_path)
    assert resolve_uri("alice/run1") == "hf://buckets/alice/run1"
    assert resolve_uri("alice/run1/exp") == "hf://buckets/alice/run1/exp"
    (tmp_path / "runs").mkdir()
    assert resolve_uri("runs/local") == f"file://{tmp_path}/runs/local"  # exists: a folder
    assert resolve_uri("s3://b/p") == "s3://b/p"
    assert resolve_uri("bucket") == f"file://{tmp_path}/bucket"


def test_reader_does_not_create_folders(tmp_path):
    Store(str(tmp_path / "absent"), create=False)
    assert not (tmp_path / "absent").exists()


def test_write_many_writes_bytes_and_files(bucket, tmp_path):
    from pathlib import Path

    src = tmp_path / "part.bin"
    src.write_bytes(b"abc" * 1000)
    s = Store(bucket)
    s.write_many([("deltas/v1/part-0000.safetensors", Path(src)), ("manifest.json", b"{}")])
    s.write_many([])
    assert s.read_bytes("deltas/v1/part-0000.safetensors") == src.read_bytes()
    assert s.read_bytes("manifest.json") == b"{}"
