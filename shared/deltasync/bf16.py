"""bf16 bit-level helpers on numpy uint16 arrays (no torch needed).

A bf16 value is handled as its 16 raw bits in a ``np.uint16`` array, so NaN payloads, +-inf,
-0.0 and subnormals survive every step bit for bit. ``to_bf16_bits`` / ``from_bf16_bits`` are the
only places that touch torch, and import it lazily.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

BF16 = "BF16"  # dtype name in safetensors headers and model fingerprints


def order_key(bits: np.ndarray) -> np.ndarray:
    """Map bf16 bit patterns (uint16[...]) to uint16 keys whose unsigned order is the float order.

    Positive values get the sign bit set, negative values are bit-inverted (the classic
    sign-magnitude to two's-complement trick). Bijective, so -0.0 and +0.0 stay distinct.
    """
    bits = bits.astype(np.uint16, copy=False)
    neg = (bits & np.uint16(0x8000)) != 0
    return np.where(neg, bits ^ np.uint16(0xFFFF), bits ^ np.uint16(0x8000)).astype(np.uint16)


def from_order_key(keys: np.ndarray) -> np.ndarray:
    """Inverse of :func:`order_key`: uint16 keys back to bf16 bit patterns."""
    keys = keys.astype(np.uint16, copy=False)
    pos = (keys & np.uint16(0x8000)) != 0
    return np.where(pos, keys ^ np.uint16(0x8000), keys ^ np.uint16(0xFFFF)).astype(np.uint16)


def digest(bits: np.ndarray) -> str:
    """xxh3-64 (xxhash library) of the little-endian bytes of a bf16 tensor, as 16 hex digits."""
    a = np.ascontiguousarray(bits)
    if a.dtype.byteorder == ">":
        a = a.byteswap()
    return xxhash.xxh3_64_hexdigest(memoryview(a.reshape(-1).view(np.uint8)))


def bytes_digest(data: bytes | bytearray | memoryview) -> str:
    """xxh3-64 of a byte string, as 16 hex digits (used for payload files and blobs)."""
    return xxhash.xxh3_64_hexdigest(data)


def to_bf16_bits(tensor: Any) -> np.ndarray:
    """Convert a tensor to its bf16 bits as a C-contiguous ``np.uint16`` array of the same shape.

    Accepts a ``np.uint16`` array (taken as bf16 bits, returned as is) or a torch tensor of any
    floating dtype on any device (cast with round-to-nearest-even, moved to CPU).

    Raises:
        TypeError: for numpy arrays of another dtype (bf16 has no numpy dtype; pass bits).
    """
    if isinstance(tensor, np.ndarray):
        if tensor.dtype != np.uint16:
            raise TypeError(
                f"expected bf16 bits as a np.uint16 array, found dtype {tensor.dtype}; "
                "pass a torch tensor or `torch_tensor.view(torch.int16).numpy().view(np.uint16)`"
            )
        return tensor if tensor.flags.c_contiguous else tensor.copy(order="C")
    import torch  # lazy: the light layers never import torch

    t = tensor.detach()
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    t = t.to("cpu").contiguous()
    return t.view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> Any:
    """Wrap bf16 bits (``np.uint16``) as a ``torch.bfloat16`` tensor sharing the memory."""
    import torch

    bits = bits if bits.flags.c_contiguous else bits.copy(order="C")
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
