"""The delta codec: one bf16 tensor's change, coded relative to the base the receiver holds.

Encoding ``ulp-expclass-rice/1`` (byte layout in docs/PROTOCOL.md):

- Positions are coded per exponent class of the BASE value. Whether a bf16 element changes under
  a small update depends on its magnitude (the rounding step doubles with each exponent), so the
  change density differs strongly between classes. Within each class the changed ranks (or, where
  more than half the class changed, the unchanged ranks) are gap-coded with a Golomb-Rice code whose
  parameter is fitted per class; Golomb codes are optimal for geometric gaps (Golomb 1966,
  Gallager & van Voorhis 1975). This conditional coding goes below the H(p)/p bits per change that
  any coder blind to the base needs (see ../shared/ANCHORS.md, "The floor").
- Values are the difference of order keys (ulp steps, modulo 2**16, so lossless for any bits,
  NaN payloads and infinities included), zigzag-mapped, one byte each (255 escapes to a uint16),
  grouped by class and compressed with zstandard.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import zstandard

from . import kernels
from .errors import DeltaCorruptError

ENCODING = "ulp-expclass-rice/1"
_TABLE = np.dtype(
    [("cls", "u1"), ("mode", "u1"), ("k", "u1"), ("n_coded", "<u8"), ("n_changed", "<u8")]
)
_HEADER = struct.Struct("<IQ")  # number of table rows, bytes of the Rice bit stream
MODE_CHANGED, MODE_UNCHANGED = 1, 2


@dataclass
class TensorChange:
    """The changed elements of one tensor, found by :func:`diff`. All arrays have length M.

    Attributes:
        idx: int64 flat positions, ascending.
        old_bits, new_bits: uint16 bf16 bits before and after.
    """

    idx: np.ndarray
    old_bits: np.ndarray
    new_bits: np.ndarray

    @property
    def n_changed(self) -> int:
        return int(self.idx.shape[0])


def diff(base_bits: np.ndarray, new_bits: np.ndarray) -> TensorChange:
    """Find where two bf16 bit arrays (np.uint16, same shape) differ, bit for bit.

    One read of each input (numba, releases the GIL); this is all a trainer waits for. Neither
    input is modified.

    Raises:
        ValueError: if dtypes or shapes differ.
    """
    if base_bits.shape != new_bits.shape:
        raise ValueError(f"shape mismatch: base {base_bits.shape} vs new {new_bits.shape}")
    if base_bits.dtype != np.uint16 or new_bits.dtype != np.uint16:
        raise ValueError(f"expected np.uint16 bf16 bits, found {base_bits.dtype}/{new_bits.dtype}")
    b = np.ascontiguousarray(base_bits).reshape(-1)
    x = np.ascontiguousarray(new_bits).reshape(-1)
    return TensorChange(*kernels.diff(b, x))


def exponent_classes(bits: np.ndarray) -> np.ndarray:
    """The exponent class of every element, ``(bits >> 7) & 0xFF``, as flat uint8[n]."""
    flat = np.ascontiguousarray(bits).reshape(-1)
    return ((flat >> 7) & 0xFF).astype(np.uint8)


def _choose_k(gaps: np.ndarray) -> int:
    """Rice parameter minimising the exact coded size of gaps (int64[m] >= 0): the best of the
    few parameters around the one a geometric fit of the mean suggests."""
    if gaps.size == 0:
        return 0
    k0 = int(np.floor(np.log2(max(float(gaps.mean()) * 0.69, 1.0))))
    ks = range(max(0, k0 - 1), min(62, k0 + 2) + 1)
    return min(ks, key=lambda k: kernels.rice_cost(gaps, k))


def encode(change: TensorChange, base: np.ndarray, zstd_level: int = 3) -> bytes:
    """Encode a :class:`TensorChange` as a blob (layout in docs/PROTOCOL.md). Deterministic.

    Args:
        change: from :func:`diff`.
        base: the base the receiver holds, as its bf16 bits (np.uint16, any shape) or its
            :func:`exponent_classes` (np.uint8[n], which a publisher can keep up to date for the
            price of one byte per element instead of re-deriving it).
        zstd_level: zstandard level of the value stream.

    Raises:
        ValueError: ``base`` is neither uint16 bits nor uint8 classes.
    """
    if base.dtype == np.uint16:
        base = exponent_classes(base)
    elif base.dtype != np.uint8:
        raise ValueError(f"expected base bits (uint16) or classes (uint8), found {base.dtype}")
    cls, rank, counts = kernels.rank_changes(np.ascontiguousarray(base).reshape(-1), change.idx)
    starts, ranks_all, z = kernels.group_by_class(cls, rank, change.old_bits, change.new_bits)
    classes = np.flatnonzero(np.diff(starts))
    table = np.zeros(len(classes), _TABLE)
    gap_parts, k_parts = [], []
    for row, c in enumerate(classes):
        ranks = ranks_all[starts[c] : starts[c + 1]]
        m, n_cls = len(ranks), int(counts[c])
        if 2 * m > n_cls:
            keep = np.ones(n_cls, bool)
            keep[ranks] = False
            coded, mode = np.flatnonzero(keep), MODE_UNCHANGED
        else:
            coded, mode = ranks, MODE_CHANGED
        gaps = np.diff(coded, prepend=-1) - 1
        k = _choose_k(gaps)
        table[row] = (c, mode, k, len(coded), m)
        gap_parts.append(gaps.astype(np.uint64))
        k_parts.append(np.full(len(gaps), k, np.uint8))
    gaps_all = np.concatenate(gap_parts) if gap_parts else np.zeros(0, np.uint64)
    ks_all = np.concatenate(k_parts) if k_parts else np.zeros(0, np.uint8)
    rice = kernels.rice_encode(gaps_all, ks_all)
    # values: ulp step (order-key difference as int16), zigzag, minus one (it is never zero);
    # one byte each, 255 escapes to a uint16 stored after all value bytes
    zb = np.minimum(z, 255).astype(np.uint8)
    esc = z[z >= 255].astype("<u2")
    body = table.tobytes() + zb.tobytes() + esc.tobytes()
    frame = zstandard.ZstdCompressor(level=zstd_level, write_content_size=True).compress(body)
    return _HEADER.pack(len(table), rice.nbytes) + rice.tobytes() + frame


def _corrupt(msg: str) -> DeltaCorruptError:
    return DeltaCorruptError(f"delta blob invalid: {msg}")


def _check_counts(table: np.ndarray, n: int, rice_n: int) -> None:
    """Refuse a class table whose counts the tensor (n elements) or the Rice stream (``rice_n``
    bytes) cannot hold, before anything is sized by them. Classes are disjoint, so the coded
    ranks of all classes, plus the changes of the classes that code their unchanged ranks,
    number at most n; and each coded gap takes at least k + 1 bits."""
    coded = [int(c) for c in table["n_coded"]]  # each <= n (checked): Python ints, no overflow
    unchanged_mode = table["mode"] == MODE_UNCHANGED
    held = sum(coded) + sum(int(c) for c in table["n_changed"][unchanged_mode])
    if held > n:
        raise _corrupt(
            f"class table accounts for {held} elements, expected at most the tensor's {n}; "
            "the blob was made for another tensor or is damaged"
        )
    bits = sum(c * (int(k) + 1) for c, k in zip(coded, table["k"], strict=True))
    if bits > 8 * rice_n:
        raise _corrupt(
            f"class table needs at least {bits} position bits, the Rice stream has {8 * rice_n}"
        )


def decode(
    blob: bytes | memoryview, base_bits: np.ndarray, threads: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a blob against the base it was made from.

    Args:
        blob: bytes from :func:`encode`.
        base_bits: np.uint16 bf16 bits of the base tensor (any shape; read flat).
        threads: split the pass over the base into this many ranges decoded on parallel
            threads (the result is the same). It costs one more (histogram) pass over the
            ranges before the last, so it pays only where cores would otherwise idle, e.g. on
            the one large tensor that finishes last (``DeltaSubscriber`` decides).

    Returns:
        (idx int64[M] ascending flat positions, new_bits uint16[M]).

    Raises:
        DeltaCorruptError: if the blob is truncated, malformed, or inconsistent with the base
            (positions out of range, wrong counts). Nothing is returned in that case, and counts
            read from the blob are checked against n and the blob's size before they size any
            array (scratch memory stays within a small multiple of the tensor's and blob's size).
    """
    base = np.ascontiguousarray(base_bits).reshape(-1)
    n = base.shape[0]
    mv = memoryview(blob).cast("B")
    if len(mv) < _HEADER.size:
        raise _corrupt(f"expected at least {_HEADER.size} header bytes, found {len(mv)}")
    n_rows, rice_n = _HEADER.unpack_from(mv, 0)
    if n_rows > kernels.N_CLASSES or _HEADER.size + rice_n > len(mv):
        raise _corrupt(f"header says {n_rows} classes and {rice_n} Rice bytes; blob has {len(mv)}")
    rice = np.frombuffer(mv, np.uint8, count=rice_n, offset=_HEADER.size)
    frame = mv[_HEADER.size + rice_n :]
    max_out = _TABLE.itemsize * n_rows + 3 * n
    try:
        declared = zstandard.frame_content_size(frame)  # -1: not in the frame header
        if declared > max_out:  # a damaged header: refuse before allocating what it declares
            raise _corrupt(f"value stream declares {declared} bytes, at most {max_out} possible")
        body = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max_out)
    except zstandard.ZstdError as e:
        raise _corrupt(f"value stream is not a valid zstd frame ({e})") from e
    t_n = _TABLE.itemsize * n_rows
    if len(body) < t_n:
        raise _corrupt(f"expected a {t_n}-byte class table, found {len(body)} bytes")
    table = np.frombuffer(body, _TABLE, count=n_rows)
    cls = table["cls"].astype(np.int64)
    if n_rows and (np.any(np.diff(cls) <= 0)):
        raise _corrupt("class table not strictly ascending")
    if np.any((table["mode"] != MODE_CHANGED) & (table["mode"] != MODE_UNCHANGED)):
        raise _corrupt("unknown class mode")
    if np.any(table["k"] > 63) or np.any(table["n_coded"] > n) or np.any(table["n_changed"] > n):
        raise _corrupt(f"class table entries out of range for a tensor of {n} elements")
    if np.any((table["mode"] == MODE_CHANGED) & (table["n_coded"] != table["n_changed"])):
        raise _corrupt("class with coded changes disagrees with its change count")
    m = int(table["n_changed"].sum())
    if m > n:
        raise _corrupt(f"{m} changes declared for a tensor of {n} elements")
    _check_counts(table, n, rice_n)
    zb = np.frombuffer(body, np.uint8, count=min(m, len(body) - t_n), offset=t_n)
    if zb.shape[0] != m:
        raise _corrupt(f"expected {m} value bytes, found {zb.shape[0]}")
    n_esc = int(np.count_nonzero(zb == 255))
    if len(body) != t_n + m + 2 * n_esc:
        raise _corrupt(f"value stream has {len(body)} bytes, expected {t_n + m + 2 * n_esc}")
    z = zb.astype(np.int64)
    z[zb == 255] = np.frombuffer(body, "<u2", count=n_esc, offset=t_n + m)
    zz = z + 1
    dkeys = (((zz >> 1) ^ -(zz & 1)) & 0xFFFF).astype(np.uint16)
    n_coded = table["n_coded"].astype(np.int64)
    n_changed = table["n_changed"].astype(np.int64)
    gaps, status = kernels.rice_decode(rice, n_coded, table["k"].astype(np.uint8))
    if status:
        why = {1: "truncated", 2: "has trailing bits", 3: "holds an oversized gap"}[status]
        raise _corrupt(f"position stream {why}")
    mode = np.zeros(kernels.N_CLASSES, np.uint8)
    rstart = np.zeros(kernels.N_CLASSES, np.int64)
    rend = np.zeros(kernels.N_CLASSES, np.int64)
    vstart = np.zeros(kernels.N_CLASSES, np.int64)
    vend = np.zeros(kernels.N_CLASSES, np.int64)
    mode[cls] = table["mode"]
    rend[cls] = np.cumsum(n_coded)
    rstart[cls] = rend[cls] - n_coded
    vend[cls] = np.cumsum(n_changed)
    vstart[cls] = vend[cls] - n_changed
    # ranks: running sum of (gap + 1) restarted at each class
    running = np.concatenate([[0], np.cumsum(gaps + 1)])
    ranks = running[1:] - 1 - np.repeat(running[rstart[cls]], n_coded)
    out_idx = np.empty(m, np.int64)
    out_new = np.empty(m, np.uint16)
    chunks = _chunks(n, threads)
    # where each chunk starts: elements of each class before it, hence the rank and value
    # cursors and the output slot (a class's ranks ascend, so a binary search finds them)
    before = np.zeros((len(chunks) + 1, kernels.N_CLASSES), np.int64)
    counted = _map(lambda se: kernels.class_counts(base, *se), chunks[:-1])
    if counted:
        before[1:-1] = np.cumsum(counted, axis=0)
    before[-1] = np.iinfo(np.int64).max  # past the end: every coded rank is below it
    ptr = np.repeat(rstart[None, :], len(before), axis=0)
    for c in cls:
        ptr[:, c] += np.searchsorted(ranks[rstart[c] : rend[c]], before[:, c])
    passed = ptr - rstart
    done = np.where(
        mode == MODE_CHANGED, passed, np.where(mode == MODE_UNCHANGED, before - passed, 0)
    )
    done[-1] = vend - vstart  # at the end every class has given all its values
    vptr = vstart + done
    q_at = done.sum(axis=1)
    if np.any(np.diff(q_at) < 0) or np.any(np.diff(vptr, axis=0) < 0) or q_at[-1] != m:
        raise _corrupt("positions do not fit the base: ranks beyond their class")

    def run(k):
        (start, stop) = chunks[k]
        q, p, v = kernels.locate_apply(
            base,
            start,
            stop,
            before[k],
            ptr[k],
            vptr[k],
            int(q_at[k]),
            int(q_at[k + 1]),
            mode,
            rend,
            ranks,
            vptr[k + 1],
            dkeys,
            out_idx,
            out_new,
        )
        return q == q_at[k + 1] and np.array_equal(p, ptr[k + 1]) and np.array_equal(v, vptr[k + 1])

    if not all(_map(run, range(len(chunks)))):
        raise _corrupt(
            f"positions do not fit the base: {m} changes declared; "
            "the blob was made from another base or is damaged"
        )
    return out_idx, out_new


_POOL: ThreadPoolExecutor | None = None


def _chunks(n: int, threads: int) -> list[tuple[int, int]]:
    """``threads`` [start, stop) ranges covering n elements (fewer if n is smaller)."""
    k = max(1, min(threads, n))
    bounds = np.linspace(0, n, k + 1).astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _map(fn, items) -> list:
    """``fn`` over items: inline for one, else on the module's threads (the kernels release
    the GIL)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(os.cpu_count() or 1, "deltasync-decode-chunk")
    return list(_POOL.map(fn, items))
