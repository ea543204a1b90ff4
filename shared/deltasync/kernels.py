"""Numba kernels of the delta codec: the diff pass, the class-rank pass, the Rice bit coder, and
the decoder's locate pass. All work on flat ``np.uint16`` bf16 bit arrays, one tensor at a time.

The exponent class of an element is the 8-bit biased exponent of its BASE value,
``(bits >> 7) & 0xFF``; the receiver knows it because it holds the base. See docs/PROTOCOL.md.
Kernels release the GIL (``nogil``) so tensors can be coded on several threads.
"""

from __future__ import annotations

import numba as nb
import numpy as np

N_CLASSES = 256
QMAX = 32  # unary quotient cap of the Rice code; a gap with q >= QMAX is escaped
LEN_BITS = 7  # width of the bit-length field of an escaped gap (0..64)

_U8 = np.uint64(8)
_FF = np.uint64(0xFF)


CHUNK = 1 << 20  # elements per diff_rank_chunk call: bounds the scratch buffers


@nb.njit(cache=True, nogil=True)
def diff_chunk(base, new, start, stop, out_idx, out_old, out_new, m):
    """Append, from slot ``m`` on, the flat index and the old and new bits of each position of
    ``[start, stop)`` where base and new bits (uint16) differ. The out arrays need
    ``m + stop - start`` slots. Returns the new ``m``."""
    for i in range(start, stop):
        b = base[i]
        x = new[i]
        if b != x:
            out_idx[m] = i
            out_old[m] = b
            out_new[m] = x
            m += 1
    return m


def diff(base: np.ndarray, new: np.ndarray):
    """Changes between base and new bits (flat, C-contiguous uint16[n] each): (idx int64[M]
    ascending, old uint16[M], new uint16[M]). One read of each input; nothing else."""
    n = base.shape[0]
    dtypes = (np.int64, np.uint16, np.uint16)
    cap = min(n, max(CHUNK, n >> 5))  # room for 3% density before the first growth
    outs = [np.empty(cap, dt) for dt in dtypes]
    m = 0
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        if cap - m < stop - start:  # grow (amortised doubling), never beyond n
            cap = min(n, max(2 * cap, m + stop - start))
            grown = [np.empty(cap, dt) for dt in dtypes]
            for g, o in zip(grown, outs, strict=True):
                g[:m] = o[:m]
            outs = grown
        m = diff_chunk(base, new, start, stop, *outs, m)
    return tuple(o[:m] for o in outs)


@nb.njit(cache=True, nogil=True)
def rank_changes(classes, idx):
    """Exponent class and in-class rank of each changed position.

    Args:
        classes: uint8[n] exponent class of every base element (``(bits >> 7) & 0xFF``).
        idx: int64[M] changed flat positions, ascending.

    Returns:
        (cls uint8[M], rank int64[M], counts int64[256]): the class of each change, its rank
        among the elements of its class (0-based, flat order), and per-class totals. Counting
        goes through four interleaved counters, which breaks the store-to-load chain on runs of
        one class.
    """
    n = classes.shape[0]
    m = idx.shape[0]
    counts4 = np.zeros((4, N_CLASSES), np.int64)
    out_cls = np.empty(m, np.uint8)
    out_rank = np.empty(m, np.int64)
    prev = 0
    for j in range(m):
        i = idx[j]
        for t in range(prev, i):
            counts4[t & 3, classes[t]] += 1
        c = classes[i]
        out_cls[j] = c
        out_rank[j] = counts4[0, c] + counts4[1, c] + counts4[2, c] + counts4[3, c]
        counts4[i & 3, c] += 1
        prev = i + 1
    for t in range(prev, n):
        counts4[t & 3, classes[t]] += 1
    return out_cls, out_rank, counts4.sum(axis=0)


@nb.njit(cache=True, nogil=True)
def group_by_class(cls, rank, old, new):
    """Counting sort of M changes by class (stable). Returns (starts int64[257], ranks int64[M],
    z uint16[M]): class c's changes are ``[starts[c], starts[c+1])``, ranks ascending, and z is
    each change's value code: zigzag(order_key(new) - order_key(old) as int16) - 1."""
    m = cls.shape[0]
    starts = np.zeros(N_CLASSES + 1, np.int64)
    for j in range(m):
        starts[cls[j] + 1] += 1
    for c in range(N_CLASSES):
        starts[c + 1] += starts[c]
    fill = starts[:N_CLASSES].copy()
    ranks = np.empty(m, np.int64)
    z = np.empty(m, np.uint16)
    for j in range(m):
        c = cls[j]
        o = fill[c]
        fill[c] = o + 1
        ranks[o] = rank[j]
        b = np.int64(old[j])
        x = np.int64(new[j])
        kb = (b ^ 0xFFFF) if (b & 0x8000) else (b ^ 0x8000)
        kx = (x ^ 0xFFFF) if (x & 0x8000) else (x ^ 0x8000)
        d = ((kx - kb + 0x8000) & 0xFFFF) - 0x8000
        z[o] = (((d << 1) ^ (d >> 15)) & 0xFFFF) - 1
    return starts, ranks, z


@nb.njit(cache=True, nogil=True)
def rice_cost(gaps, k):
    """Exact bits of the Rice code of gaps (int64[m] >= 0) with parameter k."""
    total = 0
    for j in range(gaps.shape[0]):
        g = gaps[j]
        q = g >> k
        if q < QMAX:
            total += q + 1 + k
        else:
            n = 0
            while g > 0:
                g >>= 1
                n += 1
            total += QMAX + LEN_BITS + n
    return total


@nb.njit(cache=True, nogil=True)
def _bit_length(g):
    n = 0
    while g > 0:
        g >>= np.uint64(1)
        n += 1
    return n


@nb.njit(cache=True, nogil=True)
def _put(out, st, value, nbits):
    # st = [acc, nacc, pos] as uint64; nbits <= 32 and nacc < 8 on entry, so acc never overflows
    if nbits == 0:
        return
    mask = (np.uint64(1) << np.uint64(nbits)) - np.uint64(1)
    acc = st[0] | ((np.uint64(value) & mask) << st[1])
    nacc = st[1] + np.uint64(nbits)
    pos = st[2]
    while nacc >= _U8:
        out[pos] = np.uint8(acc & _FF)
        acc >>= _U8
        nacc -= _U8
        pos += np.uint64(1)
    st[0] = acc
    st[1] = nacc
    st[2] = pos


@nb.njit(cache=True, nogil=True)
def _put_wide(out, st, value, nbits):
    if nbits > 32:
        _put(out, st, value & np.uint64(0xFFFFFFFF), 32)
        _put(out, st, value >> np.uint64(32), nbits - 32)
    else:
        _put(out, st, value, nbits)


@nb.njit(cache=True, nogil=True)
def rice_bits(gaps, ks):
    """Exact bit count of :func:`rice_encode` for gaps (uint64[M]) with parameters ks (uint8[M])."""
    total = 0
    for j in range(gaps.shape[0]):
        g = gaps[j]
        k = ks[j]
        q = g >> np.uint64(k)
        if q < QMAX:
            total += int(q) + 1 + k
        else:
            total += QMAX + LEN_BITS + _bit_length(g)
    return total


@nb.njit(cache=True, nogil=True)
def rice_encode(gaps, ks):
    """Golomb-Rice code gaps (uint64[M]) with per-gap parameters ks (uint8[M], 0..63).

    A gap g with q = g >> k < QMAX is q one-bits, a zero-bit, then the k low bits of g.
    Otherwise: QMAX one-bits, g's bit length L in LEN_BITS bits, then g in L bits.
    Bits are appended LSB-first; the last byte is zero-padded. Returns uint8[ceil(bits/8)].
    """
    nbits = rice_bits(gaps, ks)
    out = np.zeros((nbits + 7) // 8, np.uint8)
    st = np.zeros(3, np.uint64)
    for j in range(gaps.shape[0]):
        g = gaps[j]
        k = ks[j]
        q = g >> np.uint64(k)
        if q < QMAX:
            _put(out, st, (np.uint64(1) << q) - np.uint64(1), int(q) + 1)
            _put_wide(out, st, g, k)
        else:
            _put(out, st, np.uint64(0xFFFFFFFF), QMAX)
            L = _bit_length(g)
            _put(out, st, np.uint64(L), LEN_BITS)
            _put_wide(out, st, g, L)
    if st[1] > 0:
        out[st[2]] = np.uint8(st[0] & _FF)
    return out


@nb.njit(cache=True, nogil=True)
def rice_decode(buf, counts, ks):
    """Decode ``counts[c]`` gaps with parameter ``ks[c]`` for each group c, in order.

    Returns (gaps int64[sum(counts)], status): status 0 on success, 1 if the stream is truncated,
    2 if bytes or non-zero padding bits remain after the last gap, 3 if a gap overflows int63.
    Counts that the stream cannot hold (a gap takes at least k + 1 bits), or negative ones, are
    status 1 with no gaps, found before ``gaps`` is allocated.
    """
    avail = buf.shape[0] * 8
    need = 0
    total = 0
    for c in range(counts.shape[0]):
        if counts[c] < 0 or counts[c] > avail:
            return np.zeros(0, np.int64), 1
        need += counts[c] * (int(ks[c]) + 1)
        total += counts[c]
        if need > avail:
            return np.zeros(0, np.int64), 1
    gaps = np.zeros(total, np.int64)
    nbytes = buf.shape[0]
    bitpos = 0
    o = 0
    for c in range(counts.shape[0]):
        k = int(ks[c])
        for _ in range(counts[c]):
            # unary quotient
            q = 0
            while q < QMAX:
                if bitpos >= nbytes * 8:
                    return gaps, 1
                bit = (buf[bitpos >> 3] >> (bitpos & 7)) & 1
                bitpos += 1
                if bit == 0:
                    break
                q += 1
            if q < QMAX:
                nb_ = k
            else:
                if bitpos + LEN_BITS > nbytes * 8:
                    return gaps, 1
                nb_ = 0
                for t in range(LEN_BITS):
                    nb_ |= ((buf[(bitpos + t) >> 3] >> ((bitpos + t) & 7)) & 1) << t
                bitpos += LEN_BITS
                if nb_ > 63:
                    return gaps, 3
            if bitpos + nb_ > nbytes * 8:
                return gaps, 1
            v = 0
            for t in range(nb_):
                v |= int((buf[(bitpos + t) >> 3] >> ((bitpos + t) & 7)) & 1) << t
            bitpos += nb_
            if q < QMAX:
                if k > 0 and q > ((1 << (62 - k)) - 1):
                    return gaps, 3
                v = (q << k) | v
            gaps[o] = v
            o += 1
    if (bitpos + 7) // 8 != nbytes:
        return gaps, 2
    if bitpos & 7:
        if buf[nbytes - 1] >> (bitpos & 7) != 0:
            return gaps, 2
    return gaps, 0


@nb.njit(cache=True, nogil=True)
def class_counts(base, start, stop):
    """Elements of each exponent class among ``base[start:stop]`` (uint16 bits): int64[256].
    Four interleaved counters break the store-to-load chain on runs of one class."""
    c4 = np.zeros((4, N_CLASSES), np.int64)
    i = start
    while i + 4 <= stop:
        c4[0, (base[i] >> 7) & 0xFF] += 1
        c4[1, (base[i + 1] >> 7) & 0xFF] += 1
        c4[2, (base[i + 2] >> 7) & 0xFF] += 1
        c4[3, (base[i + 3] >> 7) & 0xFF] += 1
        i += 4
    while i < stop:
        c4[0, (base[i] >> 7) & 0xFF] += 1
        i += 1
    return c4[0] + c4[1] + c4[2] + c4[3]


@nb.njit(cache=True, nogil=True)
def locate_apply(
    base,
    start,
    stop,
    counts0,
    ptr0,
    vptr0,
    q,
    q_end,
    mode,
    rend,
    ranks,
    vend,
    dkeys,
    out_idx,
    out_new,
):
    """The decoder pass over base bits ``base[start:stop]`` (uint16).

    For each class c (mode[c]: 0 = no change, 1 = ``ranks[..rend[c]]`` are the changed ranks,
    2 = they are the UNCHANGED ranks) finds the changed elements, and for each writes its flat
    index to out_idx (ascending, from slot ``q`` on, below ``q_end``) and its new bits,
    ``key^-1(key(base) + dkeys[v])``, to out_new, taking v from ``vptr[c]`` up to ``vend[c]`` in
    rank order. The cursors at the range's beginning: ``counts0[c]`` elements of class c lie
    before ``start``, ``ptr0[c]`` is the first of c's coded ranks not below that count,
    ``vptr0[c]`` its next value.
    Returns (q, ptr, vptr) after the range; q == -1 means more changes than ``q_end`` allows,
    -2 that a class ran out of values.
    """
    counts, ptr, vptr = counts0.copy(), ptr0.copy(), vptr0.copy()  # local: no aliasing
    for i in range(np.uint64(start), np.uint64(stop)):  # unsigned: no negative-index checks
        b = base[i]
        c = (b >> 7) & 0xFF
        md = mode[c]
        if md != 0:
            r = counts[c]
            j = ptr[c]
            hit = j < rend[c] and ranks[j] == r
            if hit:
                ptr[c] = j + 1
            if hit == (md == 1):
                if q >= q_end:
                    return -1, ptr, vptr
                v = vptr[c]
                if v >= vend[c]:
                    return -2, ptr, vptr
                vptr[c] = v + 1
                key = (b ^ 0xFFFF) if (b & 0x8000) else (b ^ 0x8000)
                key = (key + dkeys[v]) & 0xFFFF
                nb_ = (key ^ 0x8000) if (key & 0x8000) else (key ^ 0xFFFF)
                out_idx[q] = i
                out_new[q] = nb_
                q += 1
        counts[c] += 1
    return q, ptr, vptr
