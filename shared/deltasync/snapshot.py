"""The publisher's snapshot: the bf16 bits of the last version diffed, the base of the next delta.

The snapshot lives on the host (``np.uint16`` per tensor: the encoder reads exponent classes and
writes anchors from it, and the per-tensor xxh3 digests are taken over it). When the trainer's
weights live on an accelerator, a second copy of the bits stays on that device and the diff runs
there: only the changed positions and their old and new bits cross to the host (12 bytes per
change instead of 2 bytes per element), and the host copy is patched with them. The result is the
same :class:`~deltasync.codec.TensorChange` bit for bit, whichever side diffed (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from . import codec
from .bf16 import digest, to_bf16_bits

DIFF_ON = ("auto", "host", "device")


def _is_torch(t: Any) -> bool:
    return not isinstance(t, np.ndarray) and hasattr(t, "device")


def device_bits(tensor: Any):
    """A torch tensor's bf16 bits as a flat ``torch.int16`` tensor on its own device.

    Casts with round-to-nearest-even (as ``to_bf16_bits`` does on the host), so both sides see
    the same bits. The result may share memory with ``tensor`` when it is bf16 and contiguous.
    """
    import torch  # lazy: importing deltasync never imports torch

    t = tensor.detach()
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    return t.contiguous().view(torch.int16).reshape(-1)


def diff_on_device(base, tensor) -> codec.TensorChange:
    """Diff a tensor against bf16 bits held on its device, and advance those bits to it.

    Args:
        base: flat ``torch.int16`` bits of the previous version, on ``tensor``'s device
            (updated in place to the new bits).
        tensor: the new values, any float dtype, any shape with ``base.numel()`` elements.

    Returns:
        The changes as host arrays (int64 positions ascending, uint16 old and new bits), equal bit
        for bit to ``codec.diff`` of the same bits. Bits are compared as integers, so NaN
        payloads, -0.0 and infinities count as changes exactly when their bits change.

    Raises:
        ValueError: the element counts differ.
    """
    import torch

    new = device_bits(tensor)
    if new.numel() != base.numel():
        raise ValueError(f"shape mismatch: base has {base.numel()} elements, new {new.numel()}")
    idx = torch.nonzero(base != new).reshape(-1)  # ascending, row-major
    old_bits, new_bits = base[idx], new[idx]
    base[idx] = new_bits
    # one copy to the host: 8 + 2 + 2 bytes per change
    host = torch.cat([idx.view(torch.int16), old_bits, new_bits]).cpu().numpy().view(np.uint16)
    m = idx.numel()
    return codec.TensorChange(host[: 4 * m].view(np.int64), host[4 * m : 5 * m], host[5 * m :])


def compose(first: codec.TensorChange, second: codec.TensorChange) -> codec.TensorChange:
    """One tensor's change from version a to c, given a->b (``first``) and b->c (``second``).

    Positions are the union of both; old bits come from ``first`` where it changed them (else
    from ``second``), new bits from ``second`` where it changed them (else from ``first``);
    positions that end where they started are dropped.
    """
    idx = np.union1d(first.idx, second.idx)
    p1, p2 = np.searchsorted(idx, first.idx), np.searchsorted(idx, second.idx)
    old = np.empty(idx.shape[0], np.uint16)
    new = np.empty(idx.shape[0], np.uint16)
    old[p2], old[p1] = second.old_bits, first.old_bits
    new[p1], new[p2] = first.new_bits, second.new_bits
    keep = old != new
    return codec.TensorChange(idx[keep], old[keep], new[keep])


def compose_changes(first: dict, second: dict) -> dict[str, codec.TensorChange]:
    """:func:`compose` per tensor name; tensors with no net change are left out."""
    out = {}
    for name in sorted(set(first) | set(second)):
        a, b = first.get(name), second.get(name)
        ch = b if a is None else a if b is None else compose(a, b)
        if ch.n_changed:
            out[name] = ch
    return out


class Snapshot:
    """The last diffed version's bf16 bits and digests, on the host (and on the device).

    Args:
        diff_on: ``auto`` diffs each tensor where the trainer keeps it (torch tensors on an
            accelerator: on that device; host tensors and numpy bits: numba on the host);
            ``host`` always diffs on the host; ``device`` diffs every torch tensor with torch on
            its own device, the CPU included (what the tests use to check the device path).
        pool_map: a ``map``-like callable that spreads tensors over threads (the kernels
            release the GIL), e.g. ``ThreadPoolExecutor.map``; default: the builtin ``map``.

    Attributes:
        bits: {name: np.uint16 array of the tensor's shape}, the host copy.
        digests: {name: xxh3-64 hex digest of ``bits[name]``}.
        on_device: {name: flat torch.int16 bits on the tensor's device}, tensors diffed there.
    """

    def __init__(self, diff_on: str = "auto", pool_map: Callable | None = None):
        if diff_on not in DIFF_ON:
            raise ValueError(f"diff_on must be one of {DIFF_ON}, found {diff_on!r}")
        self.diff_on = diff_on
        self._map = pool_map or map
        self.bits: dict[str, np.ndarray] = {}
        self.digests: dict[str, str] = {}
        self.on_device: dict[str, Any] = {}

    def _keeps_on_device(self, t: Any) -> bool:
        if self.diff_on == "host" or not _is_torch(t):
            return False
        return self.diff_on == "device" or t.device.type != "cpu"

    def reset(self, named: Iterable[tuple[str, Any]]) -> None:
        """Take every tensor whole (the first version, or after an anchor-only coalesce)."""
        self.bits, self.digests, self.on_device = {}, {}, {}
        for name, t in named:
            self.bits[name] = np.array(to_bf16_bits(t), copy=True)
            if self._keeps_on_device(t):
                self.on_device[name] = device_bits(t).clone()
        self.digests = dict(zip(self.bits, self._map(digest, self.bits.values()), strict=True))

    def diff(self, named: Iterable[tuple[str, Any]]) -> dict[str, codec.TensorChange]:
        """Diff every tensor against the snapshot and advance the snapshot to them.

        Returns {name: TensorChange} for the tensors that changed (others are left out).
        """

        def one(item):  # distinct tensors per thread
            name, t = item
            if name in self.on_device:
                ch = diff_on_device(self.on_device[name], t)
            else:
                ch = codec.diff(self.bits[name], to_bf16_bits(t))
            if not ch.n_changed:
                return name, None, None
            self.bits[name].reshape(-1)[ch.idx] = ch.new_bits
            return name, ch, digest(self.bits[name])

        changes = {}
        for name, ch, dg in self._map(one, list(named)):
            if ch is not None:
                changes[name], self.digests[name] = ch, dg
        return changes

    def advance(self, changes: dict[str, codec.TensorChange]) -> None:
        """Apply changes found elsewhere (e.g. by the ranks that hold the shards).

        Raises:
            KeyError: a change names a tensor the snapshot does not hold.
            ValueError: a change's old bits differ from the snapshot's (it was made from
                another base) or its positions are out of range; nothing changes then.
        """
        for name, ch in changes.items():
            flat = self.bits[name].reshape(-1)
            if ch.n_changed and (ch.idx[0] < 0 or ch.idx[-1] >= flat.shape[0]):
                raise ValueError(f"{name}: positions out of range for {flat.shape[0]} elements")
            if not np.array_equal(flat[ch.idx], ch.old_bits):
                raise ValueError(
                    f"{name}: the change's old bits differ from the published snapshot; it was "
                    "diffed against another base"
                )
        for name, ch in changes.items():
            self.bits[name].reshape(-1)[ch.idx] = ch.new_bits
            self.digests[name] = digest(self.bits[name])

    def copy_bits(self) -> dict[str, np.ndarray]:
        """An immutable copy of every tensor's host bits (an anchor's payload)."""
        return {n: a.copy() for n, a in self.bits.items()}

    @property
    def total(self) -> int:
        return sum(a.size for a in self.bits.values())
