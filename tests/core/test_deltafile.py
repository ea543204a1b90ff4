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
    label = deltafile.PartLabel(5, None, "r", 0, 1)
    deltafile.write_anchor_part(str(path), label, t, {n: digest(a) for n, a in t.items()})
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
    label = deltafile.PartLabel(8, 7, "r", 0, 1)
    data = deltafile.delta_part(label, {"x": blob}, {"x": (10, 10)}, {"x": digest(new)}, {"x": 2})
    part = deltafile.read_part(data)
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


def _rewrite(data: bytes, edit, tail: bytes = b"") -> bytes:
    """The part with its safetensors header changed by ``edit(header)`` (and ``tail`` added)."""
    (hlen,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + hlen])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + hlen :] + tail


def _offsets(name, begin, end):
    return lambda h: h[name].update(data_offsets=[begin, end])


@pytest.mark.parametrize(
    "edit, tail, match",
    [
        (_offsets("w", 0, 10**6), b"", "outside the data"),  # past the end
        (_offsets("w", -2, 24), b"", "outside the data"),
        (_offsets("b", 2, 4), b"", "overlaps or leaves holes"),  # b overlaps w
        (lambda h: None, b"\0\0", "overlaps or leaves holes"),  # bytes no tensor claims
        (lambda h: h["w"].pop("data_offsets"), b"", "malformed"),
        (lambda h: h["w"].update(shape=[4, 3]), b"", "expected BF16"),
    ],
)
def test_tensor_ranges_are_checked(tmp_path, edit, tail, match):
    """read_part parses the header itself and returns views into the downloaded bytes, so it
    refuses every byte range that the safetensors library would: out of the data, overlapping,
    or leaving bytes no tensor claims."""
    _, path = _anchor(tmp_path)
    with pytest.raises(DeltaCorruptError, match=match):
        deltafile.read_part(_rewrite(path.read_bytes(), edit, tail))


def test_parsed_tensors_are_views_of_the_downloaded_bytes(tmp_path):
    t, path = _anchor(tmp_path)
    data = path.read_bytes()
    part = deltafile.read_part(data)
    for n, a in t.items():
        arr = part.tensors[n].data
        assert np.array_equal(arr, a) and not arr.flags.writeable
        assert np.shares_memory(arr, np.frombuffer(data, np.uint8))  # no copy was made
