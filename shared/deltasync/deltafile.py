"""Payload files: anchors and deltas as safetensors files (no pickle). Layout: docs/PROTOCOL.md.

An anchor part holds full tensors as BF16 in checkpoint names and shapes, loadable by any
safetensors reader. A delta part holds, per changed tensor, one U8 tensor named like the
checkpoint tensor whose bytes are the codec blob (see ``codec``). The str->str metadata names the
format, kind, version, base version, encoding, and per-tensor shape, change count and the xxh3-64
digest of the full post-update tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
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


# Bounds on what a part's header may declare: numpy's own limit on dimensions (32 before numpy
# 2), and element counts that int64 arithmetic holds with room to spare.
MAX_DIMS = 32
MAX_ELEMENTS = 2**62
_DECIMAL = re.compile(r"[0-9]{1,18}")  # a non-negative int64, as str(int) writes it


def read_part(data: bytes) -> Part:
    """Parse and validate a payload file's bytes. Tensors are read-only views into ``data``
    (nothing is copied: the header is parsed here, once).

    Every field is checked for its type and range before it is used: metadata values are strings,
    ``version``/``base_version``/``part``/``parts`` decimal (``0 <= part < parts``), ``tensors``
    a JSON object of ``{"shape": [int >= 0, ...], "digest": str}`` (+ ``"changed": int`` in
    deltas, at most the tensor's elements), shapes of at most ``MAX_DIMS`` dimensions and
    ``MAX_ELEMENTS`` elements.

    Raises:
        DeltaCorruptError: if it is not a safetensors file of this format, or its metadata,
            dtypes or sizes are malformed or inconsistent (blobs themselves are checked when
            decoded). No other exception escapes for any input bytes.
    """
    header, body = _header(data)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(f"expected __metadata__ as a JSON object of strings, found {_short(meta)}")
    raw = {name: _entry(name, t, body) for name, t in header.items()}
    if sorted((b, e) for b, e in raw.values()) != _tiles(sorted(raw.values()), body):
        raise _bad("tensor data overlaps or leaves holes (safetensors requires neither)")
    if meta.get("format") != FORMAT:
        raise _bad(f"expected format {FORMAT!r}, found {meta.get('format')!r}")
    kind = meta.get("kind")
    version, part, parts = (_decimal(meta, k) for k in ("version", "part", "parts"))
    base = _decimal(meta, "base_version") if meta.get("base_version") else None
    if not part < parts:
        raise _bad(f"expected part < parts, found part {part} of {parts}")
    if kind not in ("anchor", "delta") or (kind == "delta") != (base is not None):
        raise _bad(f"kind {kind!r} with base_version {base!r}")
    want_enc = codec.ENCODING if kind == "delta" else ANCHOR_ENCODING
    if meta.get("encoding") != want_enc:
        raise _bad(f"expected encoding {want_enc!r}, found {meta.get('encoding')!r}")
    if "run_id" not in meta:
        raise _bad("metadata has no run_id")
    info = _tensors_meta(meta)
    if set(info) != set(raw):
        raise _bad(f"metadata names {sorted(info)[:5]}... but file holds {sorted(raw)[:5]}...")
    out = Part(kind, version, base, meta["run_id"], part, parts)
    for name, (begin, end) in raw.items():
        i, t = info[name], header[name]
        shape, digest = _shape(name, i.get("shape")), i.get("digest")
        if not isinstance(digest, str):
            raise _bad(f"{name}: expected a digest string in the metadata, found {_short(digest)}")
        numel = math.prod(shape)
        if kind == "anchor":
            if t["dtype"] != "BF16" or t["shape"] != list(shape):
                raise _bad(f"{name}: expected BF16 {shape}, found {t['dtype']} {t['shape']}")
            if end - begin != 2 * numel:
                raise _bad(f"{name}: {end - begin} bytes for BF16 {shape}")
            arr = np.frombuffer(body, np.uint16, numel, begin).reshape(shape)
            out.tensors[name] = PartTensor(shape, digest, 0, arr)
        else:
            if t["dtype"] != "U8" or t["shape"] != [end - begin]:
                raise _bad(f"{name}: expected a U8 blob of {end - begin}, found {t['dtype']}")
            changed = i.get("changed")
            if not _is_int(changed) or not 0 <= changed <= numel:
                raise _bad(
                    f"{name}: expected a change count from 0 to {numel} (shape {shape}), "
                    f"found {_short(changed)}"
                )
            arr = np.frombuffer(body, np.uint8, end - begin, begin)
            out.tensors[name] = PartTensor(shape, digest, changed, arr)
    return out


def _short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (values from a hostile file can be long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _decimal(meta: dict[str, str], key: str) -> int:
    """``meta[key]`` as a non-negative int, written in decimal digits."""
    text = meta.get(key)
    if text is None or not _DECIMAL.fullmatch(text):
        raise _bad(f"metadata {key!r}: expected a decimal integer >= 0, found {_short(text)}")
    return int(text)


def _tensors_meta(meta: dict[str, str]) -> dict[str, dict]:
    """The ``tensors`` metadata entry: a JSON object of one object per tensor."""
    try:
        info = json.loads(meta["tensors"])
    except KeyError as e:
        raise _bad("metadata has no 'tensors' entry") from e
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to parse
        raise _bad(f"metadata 'tensors' is not JSON ({_short(str(e))})") from e
    if not isinstance(info, dict) or not all(isinstance(i, dict) for i in info.values()):
        raise _bad(f"metadata 'tensors': expected an object of objects, found {_short(info)}")
    return info


def _shape(name: str, shape) -> tuple[int, ...]:
    """A shape from the metadata: at most ``MAX_DIMS`` ints >= 0, ``MAX_ELEMENTS`` elements."""
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(_is_int(s) and 0 <= s <= MAX_ELEMENTS for s in shape)
        or math.prod(shape) > MAX_ELEMENTS
    ):
        raise _bad(
            f"{name}: expected a shape of at most {MAX_DIMS} dimensions >= 0 and "
            f"{MAX_ELEMENTS} elements, found {_short(shape)}"
        )
    return tuple(shape)


def _header(data: bytes) -> tuple[dict, memoryview]:
    """The safetensors header (a dict) and the data section (a view into ``data``)."""
    if len(data) < 8:
        raise _bad(f"expected a safetensors file, found {len(data)} bytes")
    (hlen,) = struct.unpack_from("<Q", data, 0)
    if hlen > len(data) - 8:
        raise _bad(f"header length {hlen} exceeds the file ({len(data)} bytes): truncated?")
    try:
        header = json.loads(bytes(data[8 : 8 + hlen]))
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to parse
        raise _bad(f"header is not JSON ({_short(str(e))})") from e
    if not isinstance(header, dict):
        raise _bad(f"expected a JSON object as header, found {type(header).__name__}")
    return header, memoryview(data)[8 + hlen :]


def _entry(name: str, t, body: memoryview) -> tuple[int, int]:
    """A tensor entry's byte range in the data section, checked to lie inside it, and its
    ``dtype`` (str) and ``shape`` (ints >= 0) checked for their types."""
    offsets = t.get("data_offsets") if isinstance(t, dict) else None
    shape = t.get("shape") if isinstance(t, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(x) for x in offsets)
        or not isinstance(t.get("dtype"), str)
        or not isinstance(shape, list)
        or not all(_is_int(s) and s >= 0 for s in shape)
    ):
        raise _bad(
            f"{name}: malformed tensor entry {_short(t)} (expected dtype: str, shape: [int >= 0], "
            "data_offsets: [begin, end])"
        )
    begin, end = offsets
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
