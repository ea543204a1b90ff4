"""The delta codec (deltasync.codec): lossless round trips on arbitrary bf16 bits, densities from 0
to 100%, special values, shapes from 0-d to large; golden bytes of a tiny blob; corrupt blobs."""

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from deltasync import codec
from deltasync.bf16 import from_order_key, order_key
from deltasync.errors import DeltaCorruptError

SPECIALS = np.array(
    [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x3F80, 0xBF80],
    np.uint16,
)  # +0, -0, +inf, -inf, NaNs with payloads, subnormals, +-1


def roundtrip(base: np.ndarray, new: np.ndarray) -> bytes:
    change = codec.diff(base, new)
    blob = codec.encode(change, base)
    idx, values = codec.decode(blob, base)
    out = base.copy().reshape(-1)
    out[idx] = values
    assert np.array_equal(out.reshape(base.shape).view(np.uint16), new)  # bit for bit
    assert np.array_equal(idx, np.flatnonzero(base.reshape(-1) != new.reshape(-1)))
    return blob


@settings(max_examples=200, deadline=None)
@given(
    base=hnp.arrays(np.uint16, hnp.array_shapes(min_dims=0, max_dims=3, max_side=40)),
    data=st.data(),
)
def test_roundtrip_arbitrary_bits(base, data):
    mask = data.draw(hnp.arrays(np.bool_, base.shape))
    repl = data.draw(hnp.arrays(np.uint16, base.shape))
    new = np.where(mask, repl, base).astype(np.uint16)
    roundtrip(base, new)


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(0, 5000),
    density=st.sampled_from([0.0, 1e-4, 0.01, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_ulp_steps_at_densities(n, density, seed):
    rng = np.random.default_rng(seed)
    base = from_order_key(rng.integers(0x8000 - 3000, 0x8000 + 3000, n).astype(np.uint16))
    base[: min(n, len(SPECIALS))] = SPECIALS[: min(n, len(SPECIALS))]
    step = rng.choice(np.array([-2, -1, 1, 1, 3], np.int64), n)
    keys = (order_key(base).astype(np.int64) + step) & 0xFFFF
    new = np.where(rng.random(n) < density, from_order_key(keys.astype(np.uint16)), base)
    roundtrip(base, new.astype(np.uint16))


def test_special_values_both_ways():
    base = np.repeat(SPECIALS, len(SPECIALS))
    new = np.tile(SPECIALS, len(SPECIALS))
    roundtrip(base, new)
    roundtrip(new, base)


@pytest.mark.parametrize("density", [0.0, 0.001, 0.01, 0.2, 0.6, 1.0])
def test_large_tensor(density):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(1_000_003) * 0.02).astype(np.float32)
    base = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncated bf16 bits
    new = base.copy()
    sel = rng.random(base.size) < density
    new[sel] = from_order_key(order_key(base[sel]) + np.uint16(1))
    blob = roundtrip(base.reshape(1000003, 1), new.reshape(1000003, 1))
    if density == 0.01:  # conditional coding beats the ~1.23 B/change floor of blind coders
        assert len(blob) / sel.sum() < 1.23


def test_zero_d_and_single_element():
    for shape in [(), (1,), (1, 1)]:
        base = np.full(shape, 0x3F80, np.uint16)
        roundtrip(base, np.full(shape, 0x3F81, np.uint16))
        roundtrip(base, base.copy())


def test_diff_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="shape"):
        codec.diff(np.zeros(3, np.uint16), np.zeros(4, np.uint16))
    with pytest.raises(ValueError, match="uint16"):
        codec.diff(np.zeros(3, np.float32), np.zeros(3, np.float32))


# --- golden bytes ------------------------------------------------------------------------------
# base: +1.0, +2.0, -0.0, 0.5, 3 subnormals; new: 2.0 -> next up, -0.0 -> +0.0, 0.5 -> NaN(0x7FC1)
GOLDEN_BASE = np.array([0x3F80, 0x4000, 0x8000, 0x3F00, 0x0001, 0x0002, 0x0003], np.uint16)
GOLDEN_NEW = np.array([0x3F80, 0x4001, 0x0000, 0x7FC1, 0x0001, 0x0002, 0x0003], np.uint16)
# header: 3 table rows, 1 byte of Rice bits
GOLDEN_HEADER = bytes.fromhex("030000000100000000000000")
# classes 0 (4 elements: -0.0 and 3 subnormals; 1 change, rank 0), 126 (0.5; complement),
# 128 (2.0; complement): Rice bits, LSB first: "0" (class 0, gap 0, k=0) -> 0x00
GOLDEN_RICE = bytes.fromhex("00")
GOLDEN_BODY = bytes.fromhex(
    "00"
    "01"
    "00"
    "0100000000000000"
    "0100000000000000"  # class 0: changed ranks, k=0, 1, 1
    "7e"
    "02"
    "00"
    "0000000000000000"
    "0100000000000000"  # class 126: all changed, 0 coded
    "80"
    "02"
    "00"
    "0000000000000000"
    "0100000000000000"  # class 128: all changed, 0 coded
    "01"  # class 0 value: -0.0 -> +0.0 is +1 in order keys -> zigzag 2 -> minus one: 1
    "ff"  # class 126: 0x3F00 -> 0x7FC1 is +0x40C1 in keys -> zigzag 0x8182 - 1: escaped
    "01"  # class 128: +1 ulp
    "8181"  # the escaped value, uint16 little-endian
)


def test_golden_blob_encodes_to_pinned_layout():
    blob = codec.encode(codec.diff(GOLDEN_BASE, GOLDEN_NEW), GOLDEN_BASE)
    assert blob[:12] == GOLDEN_HEADER
    assert blob[12:13] == GOLDEN_RICE
    assert zstandard.ZstdDecompressor().decompress(blob[13:]) == GOLDEN_BODY


def test_golden_blob_decodes():
    blob = GOLDEN_HEADER + GOLDEN_RICE + zstandard.ZstdCompressor(level=1).compress(GOLDEN_BODY)
    idx, values = codec.decode(blob, GOLDEN_BASE)
    assert idx.tolist() == np.flatnonzero(GOLDEN_BASE != GOLDEN_NEW).tolist()
    assert values.tolist() == GOLDEN_NEW[idx].tolist()


# --- corrupt blobs -----------------------------------------------------------------------------
def _blob():
    rng = np.random.default_rng(3)
    base = rng.integers(0, 2**16, 20000).astype(np.uint16)
    new = base.copy()
    sel = rng.random(base.size) < 0.05
    new[sel] ^= np.uint16(1)
    return base, codec.encode(codec.diff(base, new), base)


@pytest.mark.parametrize("cut", [0, 5, 12, 13, 40, -1])
def test_truncated_blob_raises(cut):
    base, blob = _blob()
    with pytest.raises(DeltaCorruptError):
        codec.decode(blob[:cut] if cut >= 0 else blob[:-1], base)


def test_garbage_and_flipped_bits_raise():
    base, blob = _blob()
    rng = np.random.default_rng(4)
    with pytest.raises(DeltaCorruptError):
        codec.decode(rng.integers(0, 256, len(blob)).astype(np.uint8).tobytes(), base)
    bad = bytearray(blob)
    bad[20] ^= 0xFF  # inside the Rice position stream
    with pytest.raises(DeltaCorruptError):
        codec.decode(bytes(bad), base)


def test_blob_against_other_base_raises():
    base, blob = _blob()
    with pytest.raises(DeltaCorruptError):
        codec.decode(blob, base[:10000])  # positions beyond the tensor
    with pytest.raises(DeltaCorruptError):
        codec.decode(blob, np.zeros_like(base))  # another base: ranks do not fit


def test_oversized_positions_raise():
    base = np.full(4, 0x3F80, np.uint16)
    # class 127 (1.0): one changed rank with gap 9 (k=4: q=0 -> bit 0, r=9 -> 1001), tensor has 4
    body = bytes.fromhex("7f01040100000000000000010000000000000001")
    rice = bytes([0b10010])
    blob = bytes.fromhex("010000000100000000000000") + rice
    blob += zstandard.ZstdCompressor().compress(body)
    with pytest.raises(DeltaCorruptError, match="do not fit"):
        codec.decode(blob, base)


def test_a_frame_declaring_more_than_the_tensor_holds_is_refused_before_allocating():
    base = np.full(4, 0x3F80, np.uint16)
    rice = bytes([0b10010])
    blob = bytes.fromhex("010000000100000000000000") + rice
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 24))
    assert zstandard.frame_content_size(bomb) == 1 << 24  # a 16 MiB body for a 4-element tensor
    with pytest.raises(DeltaCorruptError, match="declares 16777216 bytes"):
        codec.decode(blob + bomb, base)


def _decode_or_error(blob, base, threads):
    try:
        return codec.decode(blob, base, threads=threads)
    except DeltaCorruptError:
        return "refused"


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 3000),
    density=st.sampled_from([1e-3, 0.05, 0.6, 1.0]),
    threads=st.integers(2, 9),
    flip=st.integers(-1, 10_000),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_tensor_decoded_in_ranges_equals_one_pass(n, density, threads, flip, seed):
    """The pass over the base split into ranges on threads (large tensors) gives exactly the
    one-pass result, and refuses exactly the damaged blobs one pass refuses."""
    rng = np.random.default_rng(seed)
    base = from_order_key(rng.integers(0x8000 - 300, 0x8000 + 300, n).astype(np.uint16))
    base[: min(n, len(SPECIALS))] = SPECIALS[: min(n, len(SPECIALS))]
    new = np.where(rng.random(n) < density, rng.integers(0, 2**16, n), base).astype(np.uint16)
    blob = bytearray(codec.encode(codec.diff(base, new), base))
    if flip >= 0:  # a damaged byte somewhere (header, positions or values)
        blob[flip % len(blob)] ^= 1 + flip % 255
    one, split = (
        _decode_or_error(bytes(blob), base, 1),
        _decode_or_error(bytes(blob), base, threads),
    )
    if isinstance(one, str) or isinstance(split, str):
        assert one == split
    else:
        assert np.array_equal(one[0], split[0]) and np.array_equal(one[1], split[1])
