"""``Link``: a network link between one unit and the bucket, simulated on a local store, so that the
one-machine stack (``make train NET=spaces``) sees the delays a deployment across the internet has.

Every store request waits the link's latency (requests in parallel wait side by side), and every
byte read or written shares its bandwidth (transfers in parallel queue on one clock). A store with
a link also stops writing its files in place (``Store.local_path`` answers None), so the publisher
takes the upload path it takes on ``hf://``.

Profiles (``NET``; assumptions stated, to be replaced by measurements from a real Space):

- ``local``: no link (the default).
- ``spaces``: 50 ms a request, 100 MB/s: a Space and the trainer's GPU box in the same cloud
  region as the bucket's storage; the per-request figure is the order of one HTTPS round trip
  within a region plus the Hub's resolver, the bandwidth one connection's order there.
- ``slow``: 150 ms a request, 10 MB/s: a trainer or replica on another continent or a home link.
- ``<latency ms>:<MB/s>``: any other, e.g. ``80:25``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_CUSTOM = re.compile(r"(\d+(?:\.\d+)?):(\d+(?:\.\d+)?)")


class LinkProfileError(ValueError):
    """``NET`` names no profile; the message lists them."""


@dataclass
class Link:
    """A simulated link: ``latency_s`` per request and ``bandwidth`` bytes per second.

    Attributes:
        name: the profile's name (for logs).
        latency_s: seconds each request waits before it runs.
        bandwidth: bytes per second, shared by every transfer of this link.
        sleep, clock: ``time.sleep`` and ``time.monotonic`` (a simulated clock in tests).
    """

    name: str
    latency_s: float
    bandwidth: float
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    requests: int = 0
    bytes: int = 0
    _free_at: float = field(default=0.0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def request(self) -> None:
        """Wait one request's latency."""
        with self._lock:
            self.requests += 1
        self.sleep(self.latency_s)

    def transfer(self, nbytes: int) -> None:
        """Move ``nbytes`` over the link: queue behind the transfers in flight, then wait
        ``nbytes / bandwidth`` seconds."""
        with self._lock:
            start = max(self.clock(), self._free_at)
            self._free_at = start + nbytes / self.bandwidth
            self.bytes += nbytes
            done = self._free_at
        wait = done - self.clock()
        if wait > 0:
            self.sleep(wait)


PROFILES = {"spaces": (0.050, 100e6), "slow": (0.150, 10e6)}


def link_for(net: str | None) -> Link | None:
    """The link of profile ``net`` (``NET``): None for ``local`` or an empty value.

    Raises:
        LinkProfileError: ``net`` is neither a profile nor ``<latency ms>:<MB/s>``.
    """
    if net is None or net.strip() in ("", "local"):
        return None
    net = net.strip()
    if net in PROFILES:
        latency_s, bandwidth = PROFILES[net]
        return Link(net, latency_s, bandwidth)
    m = _CUSTOM.fullmatch(net)
    if m is None or float(m.group(2)) <= 0:
        raise LinkProfileError(
            f"NET={net!r}: expected local, {', '.join(PROFILES)}, or <latency ms>:<MB/s> such "
            "as 80:25"
        )
    return Link(net, float(m.group(1)) / 1000, float(m.group(2)) * 1e6)
