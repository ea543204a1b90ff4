"""``ChangeEncoder``: the publisher's encoding of each version's changes, and the exponent
classes of the base version that the encoding ranks positions by.

``codec.encode`` ranks each changed position within the exponent class of its BASE value. The
encoder keeps those classes (uint8 per element, a byte instead of re-deriving them from 2-byte
bits) for the version it last handled and moves them forward with each version's new bits, so the
trainer's diff never computes ranks. Only the publisher's background thread uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from . import codec

Map = Callable[[Callable, Iterable], Iterator]


class ChangeEncoder:
    """Encodes the changes of consecutive versions, each against the classes of its base.

    Args:
        zstd_level: zstandard level of the value streams (``PublisherConfig.zstd_level``).
        map_fn: a parallel ``map`` (e.g. a thread pool's) that runs one tensor per call.
    """

    def __init__(self, zstd_level: int, map_fn: Map = map):
        self.zstd_level = zstd_level
        self._map = map_fn
        self.classes: dict[str, np.ndarray] = {}  # name -> uint8[n] classes of the last version

    def reset(self, full: dict[str, np.ndarray]) -> None:
        """Start from a whole state (an anchor-only version): ``{name: bf16 bits (np.uint16)}``."""
        self.classes = {n: codec.exponent_classes(a) for n, a in full.items()}

    def encode(self, changes: dict[str, codec.TensorChange]) -> dict[str, bytes]:
        """The blob of each changed tensor against the classes held, which then move to the new
        version. ``changes`` must be against the version handled last (``reset`` or the previous
        ``encode``).

        Returns:
            {name: blob}, names in sorted order.

        Raises:
            KeyError: a name that ``reset`` did not see (not a tensor of the model).
        """
        names = sorted(changes)
        classes, level = self.classes, self.zstd_level

        def one(name: str) -> bytes:
            ch = changes[name]
            blob = codec.encode(ch, classes[name], level)
            classes[name][ch.idx] = codec.exponent_classes(ch.new_bits)
            return blob

        return dict(zip(names, self._map(one, names), strict=True))
