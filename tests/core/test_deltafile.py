"""Payload files (deltasync.deltafile): safetensors parts that any reader can open, part splitting,
and typed errors for truncated, garbage, mislabelled or inconsistent files."""

import json
import struct

import numpy as np
import pytest
from safetensors.torch import load_file

from deltasync import codec, deltafile
from deltasync.bf16 import digest
from deltasync.errors import DeltaCorruptError


def _anchor(tmp_path):
    rng = np.random.default_rng(0)
    t = {"w": rng.integers(0, 2**16, (3, 4)).astype(np.uint16), "b": np.array(7, np.uint16)}
    path = tmp_path / "a.safetensors"
    deltafile.write_anchor_part(str(path), t, {n: digest(a) for n, a in t.items()}, 5, "r", 0, 1)
    return t, path


def test_anchor_part_is_plain_bf16_safetensors(tmp_path):
    t, path = _anchor(tmp_path)
    loaded = load_file(str(path))  # any safetensors reader: torch here
    for n, a in t.items():
        assert str(loaded[n].dtype) == "torch.bfloat16" and tuple(loaded[n].shape) == a.shape
        assert np.array_equal(
            loaded[n].view(dtype=__import__("torch").int16).numpy(), a.view(np.int16)
        )
    part = deltafile.read_part(path.read_bytes())
    assert (part.kind, part.version, part.base_version) == ("anchor", 5, None)
    assert all(np.array_equal(part.tensors[n].data, a) for n, a in t.items())


def test_delta_part_roundtrip(tmp_path):
    base = np.arange(100, dtype=np.uint16)
    new = base.copy()
    new[[3, 50]] += 1
    blob = codec.encode(codec.diff(base, new), base)
    path = tmp_path / "d.safetensors"
    deltafile.write_delta_part(
        str(path), {"x": blob}, {"x": (10, 10)}, {"x": digest(new)}, {"x": 2}, 8, 7, "r", 0, 1
    )
    part = deltafile.read_part(path.read_bytes())
    assert (part.kind, part.version, part.base_version) == ("delta", 8, 7)
    t = part.tensors["x"]
    assert t.shape == (10, 10) and t.changed == 2 and bytes(t.data) == blob


def test_split_parts_respects_cap():
    sizes = [("a", 40), ("b", 40), ("c", 100), ("d", 10)]
    parts = deltafile.split_parts(sizes, 80)
    assert parts == [["a", "b"], ["c"], ["d"]]
    assert deltafile.split_parts([], 80) == [[]]


@pytest.mark.parametrize("cut", [0, 7, 8, 30, -1])
def test_truncated_part_raises(tmp_path, cut):
    _, path = _anchor(tmp_path)
    data = path.read_bytes()
    with pytest.raises(DeltaCorruptError):
        deltafile.read_part(data[:cut] if cut >= 0 else data[:-1])


def test_garbage_and_foreign_files_raise(tmp_path):
    with pytest.raises(DeltaCorruptError):
        deltafile.read_part(b"\xff" * 64)
    header = json.dumps({"__metadata__": {"format": "other/9"}}).encode()
    with pytest.raises(DeltaCorruptError, match="format"):
        deltafile.read_part(struct.pack("<Q", len(header)) + header)


def test_inconsistent_metadata_raises(tmp_path):
    _, path = _anchor(tmp_path)
    data = path.read_bytes()
    (hlen,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + hlen])
    header["__metadata__"]["kind"] = "delta"  # a delta without a base
    h = json.dumps(header, separators=(",", ":")).encode().ljust(hlen)
    assert len(h) == hlen
    with pytest.raises(DeltaCorruptError, match="kind"):
        deltafile.read_part(data[:8] + h + data[8 + hlen :])
