"""Following a bucket's event feed (``deltasync.hub_events``) against the local Hub
(tools/local_hub), a separate process on 127.0.0.1, with the real huggingface_hub client.

What a user would check: a follower with the feed sees a manifest change within about a second
of the write; idle, it makes (almost) no resolver requests where polling makes many (counted at
the server); the dashboard's reader reads only the files the feed says changed; a feed that is not
available (403, 404) leaves the follower polling; after the Hub is killed and restarted, the feed
is followed again and changes arrive through it.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("hf_xet")

from dashboard.data import BucketReader  # noqa: E402
from deltasync.follow import Follower  # noqa: E402
from deltasync.hub_events import follow_changes  # noqa: E402
from deltasync.manifest import MANIFEST_PATH  # noqa: E402
from deltasync.store import Store  # noqa: E402
from tools.local_hub.process import HubProcess  # noqa: E402


@pytest.fixture
def hub(tmp_path):
    h = HubProcess(tmp_path / "hub").start()
    from huggingface_hub import HfApi

    HfApi(endpoint=h.url, token=h.tokens["me-write"]).create_bucket(
        "me/run", private=True, exist_ok=True
    )
    yield h
    h.stop(kill=True)


def store(hub, token: str, prefix: str = "run/a") -> Store:
    return Store(f"hf://buckets/me/{prefix}", endpoint=hub.url, token=token, retries=2)


class Watcher:
    """A manifest follower wired as ``SyncLoop`` wires it: a ``Follower`` polling on a thread,
    its ``feed`` waking it (None: polling only). ``seen`` records (clock time, manifest tag) of
    each poll that found a new manifest."""

    def __init__(self, s: Store, feed: bool = True, **follower_kw):
        self.store = s
        self.follower = Follower(s, **follower_kw)
        self.stop, self.wake = threading.Event(), threading.Event()
        self.polls = 0
        self.seen: list[tuple[float, bytes]] = []
        if feed:
            self.follower.feed = follow_changes(s, [MANIFEST_PATH], self.wake.set, owner=self)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        last = None
        while not self.stop.is_set():
            self.wake.clear()
            self.polls += 1
            try:
                data = self.store.read_bytes(MANIFEST_PATH)
            except Exception:  # missing yet, or the Hub is down: poll again later
                data = None
            if data is not None and data != last:
                self.seen.append((time.monotonic(), data))
                last = data
            self.follower.failed = data is None and last is not None
            self.wake.wait(self.follower.wait_s())

    def close(self):
        self.stop.set()
        self.wake.set()
        self.thread.join(10)
        if self.follower.feed is not None:
            self.follower.feed.close()

    def wait_live(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.follower.feed is not None and self.follower.feed.live:
                return True
            time.sleep(0.05)
        return False

    def wait_seen(self, data: bytes, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, d in self.seen:
                if d == data:
                    return t
            time.sleep(0.02)
        return None


def test_a_follower_sees_a_manifest_change_within_a_second(hub):
    writer = store(hub, hub.tokens["me-write"])
    writer.write_bytes(MANIFEST_PATH, b'{"v": 0}')
    # polling alone would take up to 30 s here: only the feed can make it in time
    w = Watcher(store(hub, hub.tokens["me-read"]), poll_interval_s=30.0)
    try:
        assert w.wait_live(10)
        assert w.wait_seen(b'{"v": 0}', 5) is not None
        for v in range(1, 4):
            data = b'{"v": %d}' % v
            writer.write_bytes(MANIFEST_PATH, data)
            written = time.monotonic()
            seen = w.wait_seen(data, 5)
            assert seen is not None and seen - written < 1.0, (v, seen and seen - written)
        writer.write_bytes("replicas/r0.json", b"{}")  # not the manifest: no poll
        polls = w.polls
        time.sleep(1.0)
        assert w.polls == polls
    finally:
        w.close()


def test_idle_with_the_feed_costs_almost_no_resolver_requests(hub):
    writer = store(hub, hub.tokens["me-write"])
    writer.write_bytes(MANIFEST_PATH, b'{"v": 0}')
    tokens = {name: hub.new_token("read", name=name) for name in ("idle-feed", "idle-poll")}
    feed = Watcher(store(hub, tokens["idle-feed"]), poll_interval_s=0.5, max_poll_interval_s=1)
    poll = Watcher(
        store(hub, tokens["idle-poll"]), feed=False, poll_interval_s=0.5, max_poll_interval_s=1
    )
    try:
        assert feed.wait_live(10)
        time.sleep(1.0)  # the reconcile poll after ``ready``
        since = time.time()
        time.sleep(8.0)
        counts = hub.requests(since)
    finally:
        feed.close()
        poll.close()
    fed = counts.get("idle-feed", {}).get("resolver", 0)
    polled = counts.get("idle-poll", {}).get("resolver", 0)
    assert fed == 0 and polled >= 6, counts


def test_the_dashboard_reads_only_what_the_feed_says_changed(hub):
    import numpy as np

    from deltasync.publisher import DeltaPublisher

    rng = np.random.default_rng(0)
    bits = {"model.embed_tokens.weight": rng.integers(0x3C00, 0x3E00, (64, 32), dtype=np.uint16)}
    pub = DeltaPublisher(store(hub, hub.tokens["me-write"]))
    pub.publish(bits.items(), step=0)
    pub.flush()
    token = hub.new_token("read", name="dash")
    reader = BucketReader(
        "hf://buckets/me/run/a", store=store(hub, token), min_interval_s=0.2, max_interval_s=1
    )
    try:
        reader.read()  # opens the store and starts the feed
        deadline = time.monotonic() + 10
        while not (reader.feed is not None and reader.feed.live) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.feed is not None and reader.feed.live
        reader.read()  # the reconcile read after ``ready``
        assert reader.next_read_delay_s() >= 60  # idle: a safety read a minute later
        since = time.time()
        view = reader.read()  # nothing changed: no request at all
        assert view.stats.stat_calls == 0, view.stats
        bits["model.embed_tokens.weight"][0, :4] += 1
        pub.publish(bits.items(), step=1)
        pub.flush()
        assert reader.wait_for_change(5)
        assert reader.next_read_delay_s() == reader.min_interval_s
        view = reader.read()
        assert view.trainer_version == 1
        counts = hub.requests(since)["dash"]
        assert counts["resolver"] <= 2 and counts["api"] == 0, counts  # the manifest only
    finally:
        reader.close()
        pub.close()


@pytest.mark.parametrize("refused", ["403", "404"])
def test_a_feed_that_is_not_available_leaves_polling(hub, refused):
    writer = store(hub, hub.tokens["me-write"])
    writer.write_bytes(MANIFEST_PATH, b'{"v": 0}')
    if refused == "403":  # a token scoped to another bucket
        elsewhere = hub.new_token("fine-grained", {"bucket:me/other": "read"}, name="elsewhere")
        feed = follow_changes(store(hub, elsewhere), [MANIFEST_PATH])
    else:  # no such bucket (as a Hub without the route would answer)
        feed = follow_changes(store(hub, hub.tokens["me-read"], "ghost/a"), [MANIFEST_PATH])
    assert feed is not None
    deadline = time.monotonic() + 10
    while feed.unavailable is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert feed.unavailable is not None and refused in feed.unavailable
    assert not feed.live
    w = Watcher(store(hub, hub.tokens["me-read"]), feed=False, poll_interval_s=0.2)
    w.follower.feed = feed  # not live: the follower keeps its polling interval
    try:
        assert w.follower.wait_s() == w.follower.delay_s
        writer.write_bytes(MANIFEST_PATH, b'{"v": 1}')
        assert w.wait_seen(b'{"v": 1}', 5) is not None
    finally:
        w.close()


def test_following_resumes_after_the_hub_is_killed_and_restarted(hub):
    writer = store(hub, hub.tokens["me-write"])
    writer.write_bytes(MANIFEST_PATH, b'{"v": 0}')
    w = Watcher(store(hub, hub.tokens["me-read"]), poll_interval_s=0.5, max_poll_interval_s=2)
    try:
        assert w.wait_live(10)
        assert w.follower.wait_s() >= 60
        hub.stop(kill=True)
        deadline = time.monotonic() + 5
        while w.follower.feed.live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not w.follower.feed.live  # the stream dropped: polling again meanwhile
        assert w.follower.wait_s() <= 2
        hub.start()
        assert w.wait_live(40)  # BucketFollower reconnects after 10 s, then 20 s
        assert w.follower.feed.sessions >= 2
        changes = w.follower.feed.changes_seen
        writer.write_bytes(MANIFEST_PATH, b'{"v": 1}')
        written = time.monotonic()
        seen = w.wait_seen(b'{"v": 1}', 5)
        assert seen is not None and seen - written < 1.5
        assert w.follower.feed.changes_seen > changes  # it came through the feed
    finally:
        w.close()
