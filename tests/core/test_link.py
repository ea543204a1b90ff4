"""``deltasync.link``: the simulated network of the one-machine stack (``NET``): each request
waits the latency, transfers share the bandwidth, a Store with a link sends every read and write
through it (and writes no file in place), and a follower with a forced lag (``SYNC_EVERY``)
pulls every k versions, or once the run has gone quiet."""

from __future__ import annotations

import threading

import pytest
import torch

from deltasync.follow import Follower
from deltasync.link import PROFILES, Link, LinkProfileError, link_for
from deltasync.publisher import DeltaPublisher
from deltasync.store import Store


class Clock:
    """A simulated clock: ``sleep`` advances it (thread-safe)."""

    def __init__(self):
        self.now, self._lock = 0.0, threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        with self._lock:
            self.now += max(0.0, s)


def test_a_transfer_of_known_size_takes_latency_plus_size_over_bandwidth():
    clock = Clock()
    link = Link("t", latency_s=0.05, bandwidth=10e6, sleep=clock.sleep, clock=clock)
    link.request()
    link.transfer(1_000_000)  # 1 MB at 10 MB/s
    assert clock.now == pytest.approx(0.05 + 0.1)
    link.transfer(3_000_000)  # queued after the first: the link is busy until then
    assert clock.now == pytest.approx(0.45)
    assert (link.requests, link.bytes) == (1, 4_000_000)


def test_transfers_in_parallel_share_the_bandwidth():
    """Two 1 MB transfers started together at 10 MB/s: the second ends at 0.2 s, not 0.1 s."""
    clock = Clock()
    link = Link("t", latency_s=0.0, bandwidth=10e6, sleep=lambda s: None, clock=clock)
    ends = []
    link.transfer(1_000_000)
    ends.append(link._free_at)
    link.transfer(1_000_000)  # issued at the same simulated instant
    ends.append(link._free_at)
    assert ends == pytest.approx([0.1, 0.2])


def test_profiles_and_custom_links_are_parsed_and_others_refused():
    assert link_for(None) is None and link_for("local") is None and link_for(" ") is None
    spaces = link_for("spaces")
    assert (spaces.latency_s, spaces.bandwidth) == PROFILES["spaces"]
    custom = link_for("80:25")
    assert (custom.latency_s, custom.bandwidth) == (0.08, 25e6)
    for bad in ("fast", "80", "80:0", "a:b"):
        with pytest.raises(LinkProfileError, match="expected local, spaces, slow"):
            link_for(bad)


def test_a_store_with_a_link_sends_reads_and_writes_through_it(tmp_path):
    clock = Clock()
    link = Link("t", latency_s=0.05, bandwidth=10e6, sleep=clock.sleep, clock=clock)
    store = Store(str(tmp_path / "b"), link=link)
    assert store.local_path("x") is None  # no writing in place: the upload path, as on hf://
    store.write_bytes("a.bin", b"\0" * 2_000_000)
    assert clock.now == pytest.approx(0.2 + 0.05)
    assert store.read_bytes("a.bin") == b"\0" * 2_000_000
    assert clock.now == pytest.approx(2 * (0.2 + 0.05))
    assert (link.requests, link.bytes) == (2, 4_000_000)


def test_the_publisher_uploads_through_the_link(tmp_path):
    link = Link("t", latency_s=0.0, bandwidth=1e12)
    store = Store(str(tmp_path / "b"), link=link)
    pub = DeltaPublisher(store, run_id="net")
    pub.publish([("w", torch.randn(64, 64))], step=0)
    pub.close()
    assert link.bytes >= 64 * 64 * 2  # the anchor's bf16 bytes went over the link
    assert (tmp_path / "b" / "manifest.json").exists()


def test_a_forced_lag_pulls_every_k_versions_or_when_the_run_goes_quiet(tmp_path):
    uri = str(tmp_path / "b")
    pub = DeltaPublisher(uri, run_id="lag")
    w = torch.zeros(16, 16)
    clock = Clock()
    follower = Follower(uri, sync_every=3, idle_sync_s=30.0, clock=clock)
    held = []
    for v in range(8):
        w[v % 16, 0] += 1.0
        pub.publish([("w", w)], step=v)
        pub.flush()
        clock.sleep(1.0)
        follower.poll()
        held.append(follower.held.version)
    # v0 at once (nothing held), then a pull whenever 3 versions had gathered
    assert held == [0, 0, 0, 3, 3, 3, 6, 6]
    clock.sleep(31.0)  # no new version for 30 s: the replica catches up
    follower.poll()
    assert follower.held.version == 7
    pub.close()
    with pytest.raises(ValueError, match="sync_every"):
        Follower(uri, sync_every=0)
