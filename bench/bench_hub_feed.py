"""Polling vs following the bucket's event feed: Hub requests and publish -> seen lag.

Against the local Hub (tools/local_hub, a child process on 127.0.0.1, no simulated link: the
``NET`` link of ``deltasync.link`` applies to local stores only), for each publish period T:
1 publisher (``DeltaPublisher`` on small random bf16 tensors) publishing every T seconds, 2
replicas (a ``deltasync.follow.Follower`` on a thread, wired as ``rollout.sync_loop.SyncLoop``
wires it: ``follow(stop, wake, wait_s)``, the feed's signal setting ``wake``) and 1 dashboard
(``dashboard.data.BucketReader``, read on a 1 s page tick when ``next_read_delay_s`` says, as
``dashboard.ui.SharedReader`` does with ``REFRESH_S=2``), first polling only, then with the feed.
Each component has its own token; requests are counted by the Hub per token and class and scaled
to 5 minutes. Lag: seconds from the publisher's ``flush`` returning (``manifest.json``
committed) to the component first holding (replica) or showing (dashboard) that version.

    .venv/bin/python bench/bench_hub_feed.py                     # T = 10 s and 1 s, 75 s each
    .venv/bin/python bench/bench_hub_feed.py --periods 10 --seconds 40
    .venv/bin/python bench/bench_hub_feed.py --smoke             # T = 1 s, 3 s each
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from report import parse_with_smoke

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deltasync.follow import Follower  # noqa: E402
from deltasync.hub_events import follow_changes  # noqa: E402
from deltasync.manifest import MANIFEST_PATH  # noqa: E402
from deltasync.publisher import DeltaPublisher, PublisherConfig  # noqa: E402
from deltasync.store import Store  # noqa: E402

SHAPES = {"model.embed_tokens.weight": (512, 64), "lm_head.weight": (512, 64)}


def _store(hub, bucket: str, token: str) -> Store:
    return Store(f"hf://buckets/me/{bucket}", endpoint=hub.url, token=token)


class Replica:
    """A replica's follow loop (SyncLoop's wiring, no engine): ``seen[version]`` = unix time."""

    def __init__(self, store: Store, feed: bool):
        self.follower = Follower(store, poll_interval_s=1.0)
        self.stop, self.wake = threading.Event(), threading.Event()
        self.seen: dict[int, float] = {}
        if feed:
            self.follower.feed = follow_changes(store, [MANIFEST_PATH], self.wake.set)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for pulled in self.follower.follow(self.stop, self.wake, self.follower.wait_s):
            if pulled is not None:
                self.seen.setdefault(pulled.version, time.time())

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        self.thread.join(30)
        if self.follower.feed is not None:
            self.follower.feed.close()


class Dashboard:
    """A dashboard page ticking every ``tick_s``: reads when ``next_read_delay_s`` says."""

    def __init__(self, store: Store, feed: bool, tick_s: float = 1.0):
        from dashboard.data import BucketReader

        self.reader = BucketReader(store.uri, store=store, follow_events=feed)
        self.tick_s = tick_s
        self.stop = threading.Event()
        self.seen: dict[int, float] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last = float("-inf")
        while not self.stop.is_set():
            now = time.monotonic()
            if now - last >= max(self.tick_s, self.reader.next_read_delay_s()):
                view = self.reader.read()
                last = now
                if view.trainer_version is not None:
                    self.seen.setdefault(view.trainer_version, time.time())
            self.stop.wait(self.tick_s)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.reader.close()


def run_one(hub, mode: str, period_s: float, seconds: float) -> dict:
    """One configuration; per component ``(api, resolver)`` per 5 minutes and lags (s)."""
    tag = f"{mode}-{period_s:g}"
    bucket = f"run/{tag}"
    names = ["publisher", "replica-0", "replica-1", "dashboard"]
    tokens = {
        n: hub.new_token("write" if n == "publisher" else "read", name=f"{tag}-{n}") for n in names
    }
    rng = np.random.default_rng(0)
    bits = {n: rng.integers(0x3C00, 0x3E00, s, dtype=np.uint16) for n, s in SHAPES.items()}
    pub = DeltaPublisher(
        _store(hub, bucket, tokens["publisher"]), config=PublisherConfig(anchor_every=10)
    )
    committed: dict[int, float] = {}
    v = pub.publish(bits.items(), step=0)
    pub.flush()
    committed[v] = time.time()
    feed = mode == "feed"
    since = time.time()
    units = {
        "replica-0": Replica(_store(hub, bucket, tokens["replica-0"]), feed),
        "replica-1": Replica(_store(hub, bucket, tokens["replica-1"]), feed),
        "dashboard": Dashboard(_store(hub, bucket, tokens["dashboard"]), feed),
    }
    start = time.monotonic()
    step = 1
    while time.monotonic() - start < seconds:
        next_at = start + step * period_s
        time.sleep(max(0.0, next_at - time.monotonic()))
        for a in bits.values():
            flat = a.reshape(-1)
            flat[rng.choice(flat.size, flat.size // 100, replace=False)] += 1
        v = pub.publish(bits.items(), step=step)
        pub.flush()
        committed[v] = time.time()
        step += 1
    time.sleep(min(period_s, 6.0))  # let the last version arrive
    elapsed = time.time() - since
    for u in units.values():
        u.close()
    counts = hub.requests(since)
    pub.close()
    out = {"versions": len(committed)}
    for n in names:
        c = counts.get(f"{tag}-{n}", {})
        scale = 300.0 / elapsed
        lags = []
        if n in units:
            seen = units[n].seen
            lags = [seen[v] - t for v, t in committed.items() if v in seen and v > 0]
        out[n] = (c.get("api", 0) * scale, c.get("resolver", 0) * scale, lags)
    return out


@contextlib.contextmanager
def local_hub():
    """A local Hub (free-tier limits on) in a temporary folder, with the private bucket me/run
    whose sub-folders the configurations use; killed on exit."""
    from huggingface_hub import HfApi

    from tools.local_hub.process import HubProcess

    with tempfile.TemporaryDirectory() as tmp:
        hub = HubProcess(Path(tmp) / "hub").start()
        try:
            HfApi(endpoint=hub.url, token=hub.tokens["me-write"]).create_bucket(
                "me/run", private=True, exist_ok=True
            )
            yield hub
        finally:
            hub.stop(kill=True)


def _pct(xs: list[float], q: float) -> str:
    return f"{np.percentile(xs, q):.2f}" if xs else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--periods", default="10,1", help="publish periods T (s), comma-separated")
    parser.add_argument("--seconds", type=float, default=75.0, help="seconds per configuration")
    args = parse_with_smoke(parser, dict(periods="1", seconds=3.0))
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with local_hub() as hub:
        for period in [float(p) for p in args.periods.split(",")]:
            for mode in ("polling", "feed"):
                t0 = time.monotonic()
                r = run_one(hub, mode, period, args.seconds)
                print(f"T={period:g}s {mode}: {time.monotonic() - t0:.0f}s", file=sys.stderr)
                rows.append((period, mode, r))
    print(f"\n{args.seconds:.0f} s per configuration, local Hub, requests scaled to 5 minutes\n")
    print(
        "| T (s) | mode | component | API / 5 min | resolver / 5 min | lag p50 (s) | lag p95 (s) |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for period, mode, r in rows:
        for n in ("publisher", "replica-0", "replica-1", "dashboard"):
            api, res, lags = r[n]
            print(
                f"| {period:g} | {mode} | {n} | {api:.0f} | {res:.0f} | {_pct(lags, 50)} | "
                f"{_pct(lags, 95)} |"
            )


if __name__ == "__main__":
    main()
