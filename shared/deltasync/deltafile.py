"""Payload files: anchors and deltas as safetensors files (no pickle). Layout: docs/PROTOCOL.md.

An anchor part holds full tensors as BF16 in checkpoint names and shapes, loadable by any
safetensors reader. A delta part holds, per changed tensor, one U8 tensor named like the
checkpoint tensor whose bytes are the codec blob (see ``codec``). The str->str metadata names the
format, kind, version, base version, encoding, and per-tensor shape, change count and the xxh3-64
digest of the full post-update tensor.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np
from safetensors import TensorSpec, serialize, serialize_file

from . import codec
from .errors import DeltaCorruptError

FORMAT = "deltasync/1"
ANCHOR_ENCODING = "bf16"


@dataclass
class PartTensor:
    """One tensor entry of a parsed part: its real shape, post-update digest, change count, and
    data (np.uint16 bits for anchors, the codec blob as np.uint8 for deltas)."""

    shape: tuple[int, ...]
    digest: str
    changed: int
    data: np.ndarray


@dataclass
class Part:
    """A parsed payload file."""

    kind: str  # "anchor" | "delta"
    version: int
    base_version: int | None
    run_id: str
    part: int
    parts: int
    tensors: dict[str, PartTensor] = field(default_factory=dict)


def split_parts(sizes: list[tuple[str, int]], part_bytes: int) -> list[list[str]]:
    """Group names (in order) into parts of at most ``part_bytes`` bytes each (a tensor larger than
    the cap gets a part of its own). Always returns at least one (possibly empty) part."""
    parts: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if parts[-1] and used + n > part_bytes:
            parts.append([])
            used = 0
        parts[-1].append(name)
        used += n
    return parts


@dataclass(frozen=True)
class PartLabel:
    """Where a part file belongs, as its metadata says: ``version`` (and ``base_version`` for a
    delta, None for an anchor) of run ``run_id``, part ``part`` of ``parts`` (0-based)."""

    version: int
    base_version: int | None
    run_id: str
    part: int
    parts: int


def _meta(kind: str, label: PartLabel, encoding: str, tensors: dict) -> dict[str, str]:
    return {
        "format": FORMAT,
        "kind": kind,
        "version": str(label.version),
        "base_version": "" if label.base_version is None else str(label.base_version),
        "run_id": label.run_id,
        "part": str(label.part),
        "parts": str(label.parts),
        "encoding": encoding,
        "tensors": json.dumps(tensors, separators=(",", ":"), sort_keys=True),
    }


def write_anchor_part(
    path: str, label: PartLabel, tensors: dict[str, np.ndarray], digests: dict[str, str]
) -> None:
    """Write an anchor part file at ``path`` (atomically): full bf16 tensors ({name: np.uint16
    array, C-contiguous}), each with the xxh3-64 ``digests[name]`` of its bits. Written straight
    to the file: an anchor part can be hundreds of MB, and serializing it in memory first was
    slower (docs/BENCHMARKS.md)."""
    info = {n: {"shape": list(a.shape), "digest": digests[n]} for n, a in tensors.items()}
    meta = _meta("anchor", label, ANCHOR_ENCODING, info)
    tmp = f"{path}.tmp-{os.getpid()}"
    serialize_file(_specs(tensors, "bfloat16"), tmp, metadata=meta)
    del tensors  # the buffers behind the specs had to stay alive until here
    os.replace(tmp, path)


def delta_part(
    label: PartLabel,
    blobs: dict[str, bytes],
    shapes: dict[str, tuple[int, ...]],
    digests: dict[str, str],
    changed: dict[str, int],
) -> bytes:
    """A delta part file's bytes: per tensor its codec blob (``blobs[name]``), with the tensor's
    shape, the xxh3-64 digest of its post-update bits and its count of changed elements."""
    arrays = {n: np.frombuffer(b, np.uint8) for n, b in blobs.items()}
    info = {
        n: {"shape": list(shapes[n]), "digest": digests[n], "changed": int(changed[n])}
        for n in blobs
    }
    meta = _meta("delta", label, codec.ENCODING, info)
    return serialize(_specs(arrays, "uint8"), metadata=meta)  # ``arrays`` keeps the buffers alive


def _specs(arrays: dict[str, np.ndarray], dtype: str) -> dict[str, TensorSpec]:
    return {
        n: TensorSpec(dtype=dtype, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
        for n, a in arrays.items()
    }


def _bad(msg: str) -> DeltaCorruptError:
    return DeltaCorruptError(f"payload file invalid: {msg}")


def read_part(data: bytes) -> Part:
    """Parse and validate a payload file's bytes. Tensors are read-only views into ``data``
    (nothing is copied: the header is parsed here, once).

    Raises:
        DeltaCorruptError: if it is not a safetensors file of this format, or its metadata,
            dtypes or sizes are inconsistent (blobs themselves are checked when decoded).
    """
    header, body = _header(data)
    meta = header.pop("__metadata__", None) or {}
    raw = {name: _entry(name, t, body) for name, t in header.items()}
    if sorted((b, e) for b, e in raw.values()) != _tiles(sorted(raw.values()), body):
        raise _bad("tensor data overlaps or leaves holes (safetensors requires neither)")
    if meta.get("format") != FORMAT:
        raise _bad(f"expected format {FORMAT!r}, found {meta.get('format')!r}")
    kind = meta.get("kind")
    try:
        version = int(meta["version"])
        base = int(meta["base_version"]) if meta.get("base_version") else None
        info = json.loads(meta["tensors"])
        part, parts = int(meta["part"]), int(meta["parts"])
    except (KeyError, ValueError, TypeError) as e:
        raise _bad(f"metadata incomplete or malformed ({e})") from e
    if kind not in ("anchor", "delta") or (kind == "delta") != (base is not None):
        raise _bad(f"kind {kind!r} with base_version {base!r}")
    want_enc = codec.ENCODING if kind == "delta" else ANCHOR_ENCODING
    if meta.get("encoding") != want_enc:
        raise _bad(f"expected encoding {want_enc!r}, found {meta.get('encoding')!r}")
    if set(info) != set(raw):
        raise _bad(f"metadata names {sorted(info)[:5]}... but file holds {sorted(raw)[:5]}...")
    out = Part(kind, version, base, meta.get("run_id", ""), part, parts)
    for name, (begin, end) in raw.items():
        i, t = info[name], header[name]
        shape = tuple(int(s) for s in i.get("shape", []))
        if any(s < 0 for s in shape):
            raise _bad(f"{name}: negative dimension in {shape}")
        if kind == "anchor":
            if t["dtype"] != "BF16" or tuple(t["shape"]) != shape:
                raise _bad(f"{name}: expected BF16 {shape}, found {t['dtype']} {t['shape']}")
            if end - begin != 2 * int(np.prod(shape)):
                raise _bad(f"{name}: {end - begin} bytes for BF16 {shape}")
            arr = np.frombuffer(body, np.uint16, (end - begin) // 2, begin).reshape(shape)
            out.tensors[name] = PartTensor(shape, str(i.get("digest", "")), 0, arr)
        else:
            if t["dtype"] != "U8" or list(t["shape"]) != [end - begin]:
                raise _bad(f"{name}: expected a U8 blob of {end - begin}, found {t['dtype']}")
            changed = int(i.get("changed", -1))
            if not 0 <= changed <= int(np.prod(shape)):
                raise _bad(f"{name}: change count {changed} out of range for shape {shape}")
            arr = np.frombuffer(body, np.uint8, end - begin, begin)
            out.tensors[name] = PartTensor(shape, str(i.get("digest", "")), changed, arr)
    return out


def _header(data: bytes) -> tuple[dict, memoryview]:
    """The safetensors header (a dict) and the data section (a view into ``data``)."""
    if len(data) < 8:
        raise _bad(f"expected a safetensors file, found {len(data)} bytes")
    (hlen,) = struct.unpack_from("<Q", data, 0)
    if hlen > len(data) - 8:
        raise _bad(f"header length {hlen} exceeds the file ({len(data)} bytes): truncated?")
    try:
        header = json.loads(bytes(data[8 : 8 + hlen]))
    except ValueError as e:
        raise _bad(f"header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise _bad(f"expected a JSON object as header, found {type(header).__name__}")
    return header, memoryview(data)[8 + hlen :]


def _entry(name: str, t, body: memoryview) -> tuple[int, int]:
    """A tensor entry's byte range in the data section, checked to lie inside it."""
    try:
        begin, end = (int(x) for x in t["data_offsets"])
        _ = (str(t["dtype"]), [int(s) for s in t["shape"]])
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(f"{name}: malformed tensor entry {t!r} ({e})") from e
    if not 0 <= begin <= end <= len(body):
        raise _bad(f"{name}: bytes [{begin}, {end}) outside the data ({len(body)} bytes)")
    return begin, end


def _tiles(ranges: list[tuple[int, int]], body: memoryview) -> list[tuple[int, int]] | None:
    """The ranges that would cover ``body`` exactly, end to end, in the order given (equal to
    ``ranges`` only when they do); None when their sizes do not add up to ``body``."""
    out, at = [], 0
    for begin, end in ranges:
        out.append((at, at + end - begin))
        at += end - begin
    return out if at == len(body) else None
