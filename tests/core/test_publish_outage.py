"""No store outage ends a run (``DeltaPublisher.outage``).

A store whose filesystem fails on command (:class:`FlakyFs`, switched by events) stands in for a
Hub outage: while it is down, training's ``publish()`` calls keep returning, the versions fold
into the newest, and once the store answers again the newest goes as an anchor, so a follower
that held a version from before the outage reaches the one after it bit for bit, every committed
delta's base is committed and nothing committed before is lost. A part upload or a manifest
commit that fails (once: the store's retry; more: the publisher's re-publish, also when the
manifest landed and only the answer was lost) loses nothing. Refused credentials still stop
publishing with the store's clear error; ``close()`` gives up on a lasting outage with a message
naming what was and was not committed. On ``hf://`` a 429 waits its ``Retry-After`` (seconds,
an HTTP date, or the ``RateLimit`` reset; capped) and then succeeds, and hf_xet's own retries are
bounded unless the user set them. The trainer's step line says when the store is down and when
it is back. Print the figures with ``-s``.
"""

from __future__ import annotations

import email.utils
import os
import statistics
import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from deltasync.errors import StoreAuthError, StoreError, StoreRateLimitError
from deltasync.follow import Follower
from deltasync.hub_store import XET_RETRY_ENV, XET_RETRY_MAX_DURATION, HubThrottled
from deltasync.manifest import WRITER_PATH
from deltasync.publisher import DeltaPublisher, PublisherConfig, PublishOutage
from deltasync.store import Store

RETRIES = 2  # the store's attempts per call in these tests: an outage outlasts them at once


class FlakyFs:
    """An fsspec filesystem that fails on command, around a real one.

    While ``down`` is set every call fails (``ConnectionError``, or a 429 with ``kind="429"``:
    transient, so the store retries, then gives up); while ``refuse`` is set every call is
    refused (``PermissionError``: credentials). :meth:`fail_writes` fails the next writes of a
    path, optionally after the write landed (an answer lost on the way back).
    """

    WRITES = {"pipe_file": 0, "put_file": 1, "rm_file": 0}  # method -> index of the remote path

    def __init__(self, fs, kind: str = "network"):
        self._fs = fs
        self.kind = kind
        self.down = threading.Event()
        self.refuse = threading.Event()
        self.failed = 0  # calls failed by fail_writes
        self._fail: tuple[str, int, bool] | None = None
        self._lock = threading.Lock()

    def fail_writes(self, text: str, n: int, landed: bool = False) -> None:
        """Fail the next ``n`` writes whose path contains ``text``; ``landed``: after writing."""
        self._fail = (text, n, landed)

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if not callable(attr) or name == "invalidate_cache":
            return attr

        def call(*args, **kwargs):
            if self.refuse.is_set():
                raise PermissionError(f"{name}: 403 Forbidden (simulated)")
            if self.down.is_set():
                if self.kind == "429":
                    raise HubThrottled(f"{name}: HTTP 429 (simulated)", retry_after_s=3.0)
                raise ConnectionError(f"{name}: connection refused (simulated outage)")
            landed = self._should_fail(name, args)
            if landed is False:
                raise ConnectionError(f"{name}: connection reset (simulated)")
            out = attr(*args, **kwargs)
            if landed:
                raise ConnectionError(f"{name}: answer lost after the write (simulated)")
            return out

        return call

    def _should_fail(self, name: str, args) -> bool | None:
        """None: let the call through; False: fail before it; True: fail after it."""
        if name not in self.WRITES or self._fail is None:
            return None
        text, n, landed = self._fail
        with self._lock:
            if n <= 0 or text not in str(args[self.WRITES[name]]):
                return None
            self._fail = (text, n - 1, landed)
            self.failed += 1
        return landed


def flaky_store(uri: str, kind: str = "network") -> tuple[Store, FlakyFs]:
    """A store on ``uri`` whose filesystem is a :class:`FlakyFs` (no waits between retries); a
    reader opening ``uri`` itself is not behind it."""
    store = Store(uri, retries=RETRIES, backoff_s=0.0, sleep=lambda s: None)
    store.fs = FlakyFs(store.fs, kind)
    return store, store.fs


def publisher(store: Store) -> tuple[DeltaPublisher, dict[str, threading.Event], list]:
    """A publisher retrying fast, whose outage reports set ``events["started"|"ended"]``."""
    pub = DeltaPublisher(store, config=PublisherConfig(anchor_every=100, keep_anchors=10))
    pub.retry_s = (0.001, 0.01)
    events = {"started": threading.Event(), "ended": threading.Event()}
    reports: list[PublishOutage] = []

    def on_outage(outage: PublishOutage) -> None:
        reports.append(outage)
        events["ended" if outage.ended_at is not None else "started"].set()

    pub.on_outage = on_outage
    return pub, events, reports


def assert_bits(follower: Follower, bits: dict) -> None:
    assert set(follower.held.tensors) == set(bits)
    for n, b in bits.items():
        assert np.array_equal(follower.held.tensors[n], b), n


def assert_chain(pub: DeltaPublisher) -> set[int]:
    """Every committed delta's base is committed; returns the committed versions."""
    versions = {v.version for v in pub.manifest.versions}
    for v in pub.manifest.versions:
        assert v.base_version is None or v.base_version in versions, (v.version, v.base_version)
    return versions


def uri() -> str:
    return f"memory://outage-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------------- outage
# a 429 is no outage: it changes the cadence (tests/core/test_publish_cadence.py)
@pytest.mark.parametrize("kind", ["network"])
def test_training_goes_on_through_an_outage_and_a_follower_crosses_it_bit_for_bit(trainer, kind):
    where = uri()
    store, fs = flaky_store(where, kind)
    pub, events, reports = publisher(store)
    follower = Follower(where)
    calls_s = []

    def publish(step: int) -> int:
        trainer.step()
        t0 = time.perf_counter()
        version = pub.publish(trainer.named(), step=step)
        calls_s.append(time.perf_counter() - t0)
        return version

    for step in range(3):
        publish(step)
        pub.flush()
    assert follower.poll().version == 2
    assert_bits(follower, trainer.bits())
    before = trainer.bits()
    healthy_s = list(calls_s)

    fs.down.set()  # the store stops answering: longer than its retries, for several steps
    calls_s.clear()
    publish(3)
    assert events["started"].wait(10)  # the thread's first attempt failed after the retries
    for step in range(4, 9):
        assert publish(step) == step  # never raises, never waits for the store
    outage = pub.outage
    assert outage is not None and outage.ended_at is None
    assert (outage.committed, outage.newest, outage.pending) == (2, 8, 6)
    assert outage.failures >= 1
    expected = "StoreRateLimitError" if kind == "429" else "StoreError"
    assert outage.last_error.startswith(expected), outage.last_error
    with pytest.raises(TimeoutError, match="the store is failing"):
        pub.flush(timeout=0.05)
    assert follower.poll() is None  # nothing new committed: the follower stays on v2
    assert follower.held.version == 2
    blocked_s = list(calls_s)

    fs.down.clear()  # the store answers again
    t0 = time.perf_counter()
    pub.flush(timeout=30)
    recovery_s = time.perf_counter() - t0
    assert events["ended"].wait(10) and pub.outage is None
    ended = reports[-1]
    assert ended.ended_at is not None and ended.committed == 8 and ended.pending == 0

    latest = pub.manifest.latest
    assert latest.version == 8 and latest.base_version is None  # the newest, as an anchor
    assert latest.anchor is not None and latest.coalesced >= 5  # v3..v7 folded into it
    versions = assert_chain(pub)
    assert {0, 1, 2} <= versions  # nothing committed before the outage is lost
    assert not versions & {3, 4, 5, 6, 7}
    pulled = follower.poll()
    assert pulled.version == 8 and pulled.plan.from_version == 2
    assert_bits(follower, trainer.bits())
    # the follower really moved (a check that could not fail would prove nothing)
    assert not all(np.array_equal(before[n], b) for n, b in trainer.bits().items())

    publish(9)  # after the outage, deltas chain again on the anchor
    pub.flush()
    assert pub.manifest.latest.base_version == 8
    assert follower.poll().version == 9
    assert_bits(follower, trainer.bits())
    pub.close()
    assert not store.exists(WRITER_PATH)  # a clean close released the lease
    print(
        f"\noutage ({kind}): publish() took {1e3 * max(blocked_s):.2f} ms at most while the "
        f"store was down (median {1e3 * statistics.median(blocked_s):.2f} ms; healthy median "
        f"{1e3 * statistics.median(healthy_s):.2f} ms); {outage.pending} versions pending; "
        f"v8 committed {1e3 * recovery_s:.1f} ms after the store answered; "
        f"{ended.failures} failed attempts"
    )


@pytest.mark.parametrize(
    "target, fails, landed",
    [
        ("deltas/", 1, False),  # one part upload fails: the store's retry
        ("deltas/", RETRIES, False),  # past the store's retries: re-published as an anchor
        ("manifest.json", RETRIES, False),  # the commit fails: re-published as an anchor
        ("manifest.json", RETRIES, True),  # the commit landed, its answer was lost
    ],
    ids=["part-once", "part-past-retries", "commit", "commit-landed"],
)
def test_a_failed_write_is_retried_or_republished_and_nothing_is_lost(
    trainer, target, fails, landed
):
    where = uri()
    store, fs = flaky_store(where)
    pub, events, _ = publisher(store)
    follower = Follower(where)
    for step in range(2):
        trainer.step()
        pub.publish(trainer.named(), step=step)
        pub.flush()
    assert follower.poll().version == 1

    fs.fail_writes(target, fails, landed)
    trainer.step()
    assert pub.publish(trainer.named(), step=2) == 2
    pub.flush(timeout=30)
    assert fs.failed == fails
    entry = pub.manifest.latest
    republished = fails >= RETRIES
    assert entry.version == 2  # the same version: nothing newer was queued meanwhile
    assert entry.base_version == (None if republished else 1)
    assert events["started"].is_set() == events["ended"].is_set() == republished
    trainer.step()
    pub.publish(trainer.named(), step=3)
    pub.flush()
    assert pub.manifest.latest.base_version == 2
    assert assert_chain(pub) == {0, 1, 2, 3}  # every version committed, none lost
    assert follower.poll().version == 3
    assert_bits(follower, trainer.bits())
    pub.close()


def test_an_idle_lease_renewal_rides_out_an_outage_without_breaking_the_chain(trainer):
    store, fs = flaky_store(uri())
    pub = DeltaPublisher(store, config=PublisherConfig(lease_s=0.3))  # renewed every 0.1 s
    events = {"started": threading.Event(), "ended": threading.Event()}
    reports: list[PublishOutage] = []
    pub.on_outage = lambda o: (
        reports.append(o),
        events["ended" if o.ended_at else "started"].set(),
    )
    pub.publish(trainer.named(), step=0)
    pub.flush()
    fs.down.set()
    assert events["started"].wait(10)  # a renewal failed: reported, not raised
    assert reports[0].pending == 0 and reports[0].committed == 0
    fs.down.clear()
    assert events["ended"].wait(10)  # the next renewal went through
    trainer.step()
    pub.publish(trainer.named(), step=1)
    pub.flush()
    assert pub.manifest.latest.base_version == 0  # nothing failed to publish: still a delta
    pub.close()


def test_refused_credentials_still_stop_publishing_with_a_clear_error(trainer):
    store, fs = flaky_store(uri())
    pub, events, _ = publisher(store)
    pub.publish(trainer.named(), step=0)
    pub.flush()
    fs.refuse.set()
    trainer.step()
    pub.publish(trainer.named(), step=1)  # queued: the refusal comes on the thread
    with pytest.raises(StoreAuthError, match="refused.*HF_TOKEN"):
        pub.flush()
    assert pub.outage is None and not events["started"].is_set()  # not an outage to wait out
    with pytest.raises(StoreAuthError, match="HF_TOKEN"):
        pub.publish(trainer.named(), step=2)
    with pytest.raises(StoreAuthError):
        pub.close()
    assert pub.manifest.latest.version == 0


def test_close_gives_up_on_a_lasting_outage_and_says_what_was_committed(trainer):
    store, fs = flaky_store(uri())
    pub, events, _ = publisher(store)
    pub.publish(trainer.named(), step=0)
    pub.flush()
    fs.down.set()
    trainer.step()
    pub.publish(trainer.named(), step=1)
    assert events["started"].wait(10)
    pub.close_wait_s = 0.05
    with pytest.raises(StoreError, match=r"v1 not published.*Committed: v0.*close_wait_s"):
        pub.close()
    fs.down.clear()
    assert store.exists(WRITER_PATH)  # the lease is left to expire, not released
    pub.close()  # a second close does nothing more
    assert pub.manifest.latest.version == 0


# ------------------------------------------------------------------------------ hf:// 429
def _hub_store(retries: int, waits: list, max_retry_after_s: float = 120.0) -> Store:
    pytest.importorskip("huggingface_hub")
    return Store(
        "hf://buckets/me/run",
        token="hf_test",
        endpoint="http://hub.invalid",
        retries=retries,
        sleep=waits.append,
        max_retry_after_s=max_retry_after_s,
    )


class _ThrottlingApi:
    """``HfApi.batch_bucket_files`` answering 429 with the given headers, then adding the files."""

    def __init__(self, throttles: list[dict]):
        self.throttles = list(throttles)
        self.added: list[str] = []

    def batch_bucket_files(self, bucket_id, add=None, delete=None):
        httpx2 = pytest.importorskip("httpx2")
        from huggingface_hub.errors import HfHubHTTPError

        if self.throttles:
            url = f"http://hub.invalid/api/buckets/{bucket_id}/batch"
            resp = httpx2.Response(
                429, headers=self.throttles.pop(0), request=httpx2.Request("POST", url)
            )
            raise HfHubHTTPError("429 Too Many Requests", response=resp)
        self.added += [dest for _, dest in add or []]


def test_a_429_on_a_write_waits_its_retry_after_then_succeeds():
    waits: list[float] = []
    store = _hub_store(retries=5, waits=waits, max_retry_after_s=60.0)
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    api = _ThrottlingApi(
        [
            {"Retry-After": "7"},  # seconds
            {"Retry-After": date},  # an HTTP date
            {"RateLimit": '"api";r=0;t=12'},  # the Hub's rate-limit reset
            {"Retry-After": "1000"},  # capped at max_retry_after_s
        ]
    )
    # the fake API is the whole write (batch_bucket_files uploading itself, no kept Xet token)
    store.hub.api, store.hub._checked, store.hub._reuse = api, True, False
    store.write_bytes("a.json", b"1")
    assert api.added == ["a.json"]
    assert waits[0] == 7.0 and 28.0 <= waits[1] <= 30.0 and waits[2:] == [12.0, 60.0]

    waits.clear()
    store = _hub_store(retries=2, waits=waits)
    store.hub.api, store.hub._checked = _ThrottlingApi([{"Retry-After": "3"}] * 2), True
    store.hub._reuse = False
    with pytest.raises(StoreRateLimitError, match="rate limited.*2 times"):
        store.write_bytes("b.json", b"2")  # a publisher waits this out as an outage
    assert waits == [3.0]


def test_hf_xet_retries_are_bounded_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv(XET_RETRY_ENV, raising=False)
    _hub_store(retries=1, waits=[])
    assert os.environ[XET_RETRY_ENV] == XET_RETRY_MAX_DURATION == "30s"
    monkeypatch.setenv(XET_RETRY_ENV, "2m")
    _hub_store(retries=1, waits=[])
    assert os.environ[XET_RETRY_ENV] == "2m"  # the user's own setting is kept


# ------------------------------------------------------------------------- trainer line
def test_the_step_line_says_when_the_store_is_down_and_when_it_is_back(capsys):
    pytest.importorskip("transformers")
    from trainer.loop.metrics import BucketMetricsCallback

    since = time.time() - 12.4
    down = PublishOutage(since=since, failures=3, last_error="StoreError: x", committed=4, newest=9)
    pub = SimpleNamespace(published=[], outage=down)
    cb = BucketMetricsCallback(Store(uri()), "run", pub)
    for step, outage in enumerate([down, None, None], start=1):
        pub.outage = outage
        cb.on_log(None, SimpleNamespace(global_step=step), None, logs={"loss": 0.1, "reward": 0.2})
    cb.flush()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 3
    assert lines[0].endswith("store=down 12s pending=5")
    assert "store=back after <=" in lines[1]
    assert "store=" not in lines[2]
