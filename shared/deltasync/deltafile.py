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
from safetensors import TensorSpec, deserialize, serialize_file

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


def _meta(kind, version, base_version, run_id, part, parts, encoding, tensors) -> dict[str, str]:
    return {
        "format": FORMAT,
        "kind": kind,
        "version": str(version),
        "base_version": "" if base_version is None else str(base_version),
        "run_id": run_id,
        "part": str(part),
        "parts": str(parts),
        "encoding": encoding,
        "tensors": json.dumps(tensors, separators=(",", ":"), sort_keys=True),
    }


def write_anchor_part(path, tensors, digests, version, run_id, part, parts) -> None:
    """Write full bf16 tensors ({name: np.uint16 array}) as an anchor part file at ``path``."""
    specs = {
        n: TensorSpec(
            dtype="bfloat16", shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
        )
        for n, a in tensors.items()
    }
    info = {n: {"shape": list(a.shape), "digest": digests[n]} for n, a in tensors.items()}
    meta = _meta("anchor", version, None, run_id, part, parts, ANCHOR_ENCODING, info)
    _write(path, specs, meta, keep=list(tensors.values()))


def write_delta_part(
    path, blobs, shapes, digests, changed, version, base_version, run_id, part, parts
):
    """Write codec blobs ({name: bytes}) as a delta part file at ``path``."""
    arrays = {n: np.frombuffer(b, np.uint8) for n, b in blobs.items()}
    specs = {
        n: TensorSpec(dtype="uint8", shape=[a.shape[0]], data_ptr=a.ctypes.data, data_len=a.nbytes)
        for n, a in arrays.items()
    }
    info = {
        n: {"shape": list(shapes[n]), "digest": digests[n], "changed": int(changed[n])}
        for n in blobs
    }
    meta = _meta("delta", version, base_version, run_id, part, parts, codec.ENCODING, info)
    _write(path, specs, meta, keep=list(arrays.values()))


def _write(path, specs, meta, keep) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    serialize_file(specs, tmp, metadata=meta)
    del keep  # the buffers behind data_ptr had to stay alive until here
    os.replace(tmp, path)


def _bad(msg: str) -> DeltaCorruptError:
    return DeltaCorruptError(f"payload file invalid: {msg}")


def read_part(data: bytes) -> Part:
    """Parse and validate a payload file's bytes.

    Raises:
        DeltaCorruptError: if it is not a safetensors file of this format, or its metadata,
            dtypes or sizes are inconsistent (blobs themselves are checked when decoded).
    """
    if len(data) < 8:
        raise _bad(f"expected a safetensors file, found {len(data)} bytes")
    (hlen,) = struct.unpack_from("<Q", data, 0)
    if hlen > len(data) - 8:
        raise _bad(f"header length {hlen} exceeds the file ({len(data)} bytes): truncated?")
    try:
        header = json.loads(bytes(data[8 : 8 + hlen]))
        meta = header.get("__metadata__") or {}
        raw = dict(deserialize(bytes(data)))
    except Exception as e:  # any parse failure of untrusted bytes is corruption
        raise _bad(f"not a readable safetensors file ({type(e).__name__}: {e})") from e
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
    for name, t in raw.items():
        i = info[name]
        shape = tuple(int(s) for s in i.get("shape", []))
        if any(s < 0 for s in shape):
            raise _bad(f"{name}: negative dimension in {shape}")
        buf = t["data"]
        if kind == "anchor":
            if t["dtype"] != "BF16" or tuple(t["shape"]) != shape:
                raise _bad(f"{name}: expected BF16 {shape}, found {t['dtype']} {t['shape']}")
            arr = np.frombuffer(buf, np.uint16).reshape(shape)
            out.tensors[name] = PartTensor(shape, str(i.get("digest", "")), 0, arr)
        else:
            if t["dtype"] != "U8":
                raise _bad(f"{name}: expected a U8 blob, found {t['dtype']}")
            changed = int(i.get("changed", -1))
            if not 0 <= changed <= int(np.prod(shape)):
                raise _bad(f"{name}: change count {changed} out of range for shape {shape}")
            arr = np.frombuffer(buf, np.uint8)
            out.tensors[name] = PartTensor(shape, str(i.get("digest", "")), changed, arr)
    return out
