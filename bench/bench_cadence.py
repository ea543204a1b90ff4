"""The publish cadence against the Hub's free-tier limits: a trainer syncing every T seconds.

Against the local Hub (tools/local_hub, free-tier limits on: 1,000 API / 5,000 resolver requests
per token per 5 minutes), for each sync period T: a ``DeltaPublisher`` on an ``hf://`` bucket
(adaptive cadence on by default, ``--hub-plan free``) offered every sync (``offer``: TRL's
weight sync), small random bf16 tensors with 1% of their elements changed per sync; 8 replicas
following the event feed (``bench_hub_feed.Replica``) and a dashboard (``bench_hub_feed.Dashboard``),
each with its own token. Reported per T: requests per 5 minutes per component counted at the
Hub, 429s waited out by the publisher (never an error), the cadence k over the run, lag from the
optimizer step a version carries to each replica holding it (p50, p95), bytes and density per
version, and a fresh follower bit-exact with the last published version.

    .venv/bin/python bench/bench_cadence.py                      # T = 1, 0.5, 0.25 s, 600 s each
    .venv/bin/python bench/bench_cadence.py --periods 1 --seconds 180
    .venv/bin/python bench/bench_cadence.py --smoke              # T = 1 s, 8 s
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
from bench_hub_feed import SHAPES, Dashboard, Replica, _pct, _store, local_hub
from report import parse_with_smoke

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deltasync.publisher import DeltaPublisher  # noqa: E402
from deltasync.subscriber import DeltaSubscriber, HeldWeights  # noqa: E402

REPLICAS = 8


def run_one(hub, period_s: float, seconds: float) -> dict:
    """One sync period: the figures of the module docstring."""
    tag = f"cadence-{period_s:g}"
    bucket = f"run/{tag}"
    names = ["publisher", *[f"replica-{i}" for i in range(REPLICAS)], "dashboard"]
    tokens = {
        n: hub.new_token("write" if n == "publisher" else "read", name=f"{tag}-{n}") for n in names
    }
    rng = np.random.default_rng(0)
    bits = {n: rng.integers(0x3C00, 0x3E00, s, dtype=np.uint16) for n, s in SHAPES.items()}
    pub = DeltaPublisher(_store(hub, bucket, tokens["publisher"]))
    stepped: dict[int, float] = {}  # version -> time of the optimizer step it carries
    truth: dict[int, dict] = {}
    since = time.time()
    stepped[pub.offer(bits.items(), step=0)] = time.time()
    pub.flush()
    units = {n: Replica(_store(hub, bucket, tokens[n]), feed=True) for n in names[1:-1]}
    units["dashboard"] = Dashboard(_store(hub, bucket, tokens["dashboard"]), feed=True)
    ks, start, step = [], time.monotonic(), 1
    while time.monotonic() - start < seconds:
        time.sleep(max(0.0, start + step * period_s - time.monotonic()))
        for a in bits.values():
            flat = a.reshape(-1)
            flat[rng.choice(flat.size, flat.size // 100, replace=False)] += 1
        v = pub.offer(bits.items(), step=step)
        if v is not None:
            stepped[v] = time.time()
            truth[v] = {n: a.copy() for n, a in bits.items()}
        ks.append(pub.publish_every)
        step += 1
    pub.flush()
    time.sleep(6.0)  # let the last version arrive
    elapsed = time.time() - since
    for u in units.values():
        u.close()
    counts = hub.requests(since)
    entries = [e for e in pub.published if e.delta is not None]
    last = max(truth)
    held = HeldWeights()
    DeltaSubscriber(_store(hub, bucket, tokens["replica-0"])).sync(held)
    exact = held.version == last and all(
        np.array_equal(held.tensors[n].reshape(-1).view(np.uint16), a.reshape(-1))
        for n, a in truth[last].items()
    )
    out = {
        "syncs": step,
        "versions": len(stepped),
        "k_last": ks[-1] if ks else 1,
        "k_max": max(ks, default=1),
        "rate_limited": pub.rate_limited,
        "delta_bytes_mean": float(np.mean([sum(f.bytes for f in e.delta.files) for e in entries]))
        if entries
        else 0.0,
        "density_mean": float(np.mean([e.changed / e.total for e in entries])) if entries else 0.0,
        "bit_exact": bool(exact),
        "seen_last": sum(last in units[n].seen for n in names[1:-1]),
    }
    pub.close()
    lags = [
        units[n].seen[v] - t
        for n in names[1:-1]
        for v, t in stepped.items()
        if v in units[n].seen and v > 0
    ]
    scale = 300.0 / elapsed
    for n in ("publisher", "replica-0", "dashboard"):
        c = counts.get(f"{tag}-{n}", {})
        out[n] = (c.get("api", 0) * scale, c.get("resolver", 0) * scale)
    out["lag_p50"], out["lag_p95"] = _pct(lags, 50), _pct(lags, 95)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--periods", default="1,0.5,0.25", help="sync periods T (s), comma-separated"
    )
    parser.add_argument("--seconds", type=float, default=600.0, help="seconds per period")
    args = parse_with_smoke(parser, dict(periods="1", seconds=8.0))
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with local_hub() as hub:
        for period in [float(p) for p in args.periods.split(",")]:
            rows.append((period, run_one(hub, period, args.seconds)))
    print(f"\n{args.seconds:.0f} s per period, local Hub (free tier), requests per 5 minutes\n")
    print(
        "| T (s) | syncs | versions | k last (max) | 429s | publisher API / res | each replica "
        "API / res | dashboard API / res | lag p50 / p95 (s) | delta bytes | density | "
        "bit-exact | replicas at the last |"
    )
    print("|" + "---|" * 13)
    for period, r in rows:
        p, rep, d = r["publisher"], r["replica-0"], r["dashboard"]
        print(
            f"| {period:g} | {r['syncs']} | {r['versions']} | {r['k_last']} ({r['k_max']}) | "
            f"{r['rate_limited']} | {p[0]:.0f} / {p[1]:.0f} | {rep[0]:.0f} / {rep[1]:.0f} | "
            f"{d[0]:.0f} / {d[1]:.0f} | {r['lag_p50']} / {r['lag_p95']} | "
            f"{r['delta_bytes_mean']:.0f} | {r['density_mean']:.4f} | {r['bit_exact']} | "
            f"{r['seen_last']}/{REPLICAS} |"
        )


if __name__ == "__main__":
    main()
