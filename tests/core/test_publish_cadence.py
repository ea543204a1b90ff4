"""The publish cadence follows the token's request budget (``deltasync.cadence``).

On a simulated clock, a store whose requests are counted (``Store.requests``, as the Hub counts
them) and a fake filesystem that can answer 429 with a ``Retry-After``: at a fast step the
publisher's requests in every fixed 5-minute window stay under its target and k rises; when the
steps slow down k falls back; a follower still reconstructs every published version bit for bit;
a 429 waits its ``Retry-After``, raises k and is no error nor outage; without the adaptive mode
every call publishes as before. Print the figures with ``-s``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np
import pytest

from deltasync.cadence import HUB_PLANS, HubPlanError, PublishCadence, plan_limits
from deltasync.follow import Follower
from deltasync.hub_store import HubThrottled
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.store import Store

RETRY_AFTER_S = 0.2


class ThrottlingFs:
    """An fsspec filesystem around a real one that answers 429 (``Retry-After``
    :data:`RETRY_AFTER_S`) to every call while ``throttled`` is set."""

    def __init__(self, fs):
        self._fs = fs
        self.throttled = threading.Event()
        self.throttles = 0

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if not callable(attr) or name == "invalidate_cache":
            return attr

        def call(*args, **kwargs):
            if self.throttled.is_set():
                self.throttles += 1
                raise HubThrottled(f"{name}: HTTP 429 (simulated)", retry_after_s=RETRY_AFTER_S)
            return attr(*args, **kwargs)

        return call


def counted_store(waits: list) -> tuple[str, Store, ThrottlingFs]:
    uri = f"memory://cadence-{uuid.uuid4().hex[:8]}"
    store = Store(uri, retries=2, backoff_s=0.0, sleep=waits.append)
    store.fs = ThrottlingFs(store.fs)
    return uri, store, store.fs


def assert_bits(follower: Follower, bits: dict) -> None:
    for n, b in bits.items():
        assert np.array_equal(follower.held.tensors[n], b), n


def adaptive_publisher(store, plan="200") -> tuple[DeltaPublisher, list[float]]:
    cfg = PublisherConfig(adaptive_cadence=True, hub_plan=plan, anchor_every=1000, keep_anchors=5)
    pub = DeltaPublisher(store, config=cfg)
    pub.retry_s = (0.01, 0.05)
    t = [0.0]
    pub.cadence.clock = lambda: t[0]
    return pub, t


def test_fast_steps_raise_k_under_the_target_and_slow_steps_lower_it_bit_for_bit(trainer):
    waits: list[float] = []
    uri, store, _ = counted_store(waits)
    pub, t = adaptive_publisher(store)  # a token of 200 API requests per 5 minutes
    limit, target = 200, 0.8 * 200
    follower = Follower(uri)
    windows, window_start, published = [], 0, 0

    def step(i: int, step_s: float) -> None:
        nonlocal window_start, published
        trainer.step()
        if pub.offer(trainer.named(), step=i) is not None:
            pub.flush()
            published += 1
            follower.poll()
            assert_bits(follower, trainer.bits())  # every published version, bit for bit
        t[0] += step_s
        if t[0] // 300 > len(windows):  # the Hub's fixed 5-minute windows
            api = store.requests.api
            windows.append(api - window_start)
            window_start = api

    for i in range(900):  # 15 simulated minutes at 1 s a step
        step(i, 1.0)
    fast_k = pub.publish_every
    fast_published = published
    for i in range(900, 960):  # then 60 steps of 60 s
        step(i, 60.0)
    pub.close()
    summary = pub.cadence.summary()
    print(
        f"\nAPI requests per 5-min window: {windows} (limit {limit}, target {target:.0f}); "
        f"k at 1 s/step {fast_k}, at 60 s/step {pub.publish_every}; {fast_published} of 900 "
        f"fast steps published; k over the run {pub.cadence.ks}"
    )
    # every call published would be ~6 requests a step here: 1,800 per window
    assert fast_k > 5
    assert all(w <= limit for w in windows)  # not one window over the limit
    assert all(w <= target * 1.05 for w in windows[1:3])  # the fast windows after learning
    assert pub.publish_every == 1 and summary["publish_every"]["last"] == 1  # fell back
    assert summary["publish_every"]["max"] == max(pub.cadence.ks) == fast_k
    ks = pub.cadence.ks  # hysteresis: up while fast, then down, never back and forth
    top = ks.index(max(ks))
    assert ks[: top + 1] == sorted(ks[: top + 1]) and ks[top:] == sorted(ks[top:], reverse=True)
    assert summary["throttles"] == 0 and waits == []  # never rate limited
    assert follower.held.version == pub.newest_published
    versions = [v.version for v in pub.published]
    assert versions == list(range(len(versions)))  # versions number the publishes, not steps


def test_a_429_waits_its_retry_after_raises_k_and_is_no_error(trainer, caplog):
    waits: list[float] = []
    uri, store, fs = counted_store(waits)
    pub, _ = adaptive_publisher(store, plan="free")
    outages = []
    pub.on_outage = outages.append
    follower = Follower(uri)
    for i in range(3):
        trainer.step()
        assert pub.offer(trainer.named(), step=i) == i  # no evidence yet: k = 1
        pub.flush()
    assert pub.publish_every == 1
    caplog.set_level(logging.INFO, logger="deltasync.publisher")
    fs.throttled.set()
    trainer.step()
    assert pub.offer(trainer.named(), step=3) == 3  # returns at once
    deadline = time.monotonic() + 10
    while pub.rate_limited == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.rate_limited >= 1
    assert pub.publish_every == 2  # k doubled
    assert pub.outage is None and outages == []  # a cadence change, not an outage
    assert waits and set(waits) == {RETRY_AFTER_S}  # the store waited the server's Retry-After
    fs.throttled.clear()
    published = []
    for i in range(4, 8):  # every 2nd sync is published now
        trainer.step()
        published.append(pub.offer(trainer.named(), step=i))
    pub.flush(timeout=10)  # raises nothing
    assert [v is not None for v in published] == [False, True, False, True]
    assert follower.poll().version == pub.newest_published
    assert_bits(follower, trainer.bits())
    for v in pub.manifest.versions:  # every committed delta's base is committed
        assert v.base_version is None or v.base_version in {
            w.version for w in pub.manifest.versions
        }
    pub.close()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "deltasync.publisher" and "rate limited" in r.getMessage()
    ]
    assert len(lines) == 1 and "waiting 0.2s" in lines[0] and "every 2 sync" in lines[0]
    assert any("publish cadence: every 2 sync(s), was 1" in r.getMessage() for r in caplog.records)
    assert pub.cadence.summary()["throttles"] >= 1


def test_a_fixed_cadence_publishes_every_call_as_before(trainer, tmp_path):
    pub = DeltaPublisher(str(tmp_path / "bucket"))  # a local folder: no request limit
    assert pub.cadence is None and pub.publish_every == 1
    for i in range(5):
        trainer.step()
        assert pub.offer(trainer.named(), step=i) == i
        pub.flush()
    pub.close()
    assert [v.version for v in pub.published] == [0, 1, 2, 3, 4]
    assert PublisherConfig().adaptive_cadence is None  # default: on for hf:// buckets only


def test_hub_plans_and_a_bad_plan():
    assert plan_limits("free") == (1000, 5000) and plan_limits("PRO") == (2500, 12000)
    assert plan_limits(1500) == (1500, None) and set(HUB_PLANS) >= {"free", "pro"}
    with pytest.raises(HubPlanError, match=r"expected one of.*found 'gold'.*--hub-plan"):
        PublisherConfig(hub_plan="gold")
    with pytest.raises(ValueError, match="found '0'"):
        PublisherConfig(hub_plan="0")


def test_the_cadence_keeps_to_its_bounds_and_holds_after_a_429():
    t, api = [0.0], [0]
    cad = PublishCadence(lambda: (api[0], 0), "100", floor=2, ceiling=8, clock=lambda: t[0])
    for _ in range(200):  # 10 requests a publish at one sync a second: far over
        if cad.due():
            api[0] += 10
        t[0] += 1
    assert cad.k == 8  # the ceiling
    cad.throttled(5.0)
    assert cad.k == 8 and cad.throttles == 1
    for _ in range(100):  # slow now, but within the hold after the 429: k stays
        if cad.due():
            api[0] += 10
        t[0] += 2
    assert cad.k == 8
    for _ in range(40):  # past the hold: down to the floor, never below
        if cad.due():
            api[0] += 10
        t[0] += 60
    assert cad.k == 2
