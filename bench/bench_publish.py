"""Training-step overhead of publishing, and publish-to-applied lag (`make bench`).

One run of a small Qwen3-shaped causal LM (random init, fp32 master weights, AdamW at lr 1e-5,
real LM loss on Python's own source files as bytes) alternates blocks of steps with publishing
off and on (a DeltaPublisher on a local bucket after every optimizer step), so both arms share
the same process, data, and machine state. A subscriber thread follows the bucket into a CPU
HeldWeights copy in another process, as a replica would, and records when each version is
applied. On a 2-core machine the background encoding and the follower share the cores with the
training compute; on a GPU trainer they run on otherwise idle CPU cores.

Reported: mean step time off/on and the overhead (target < 5%), the time publish() blocks the
loop (the diff), and publish-to-applied lag p50/p95 (manifest commit to verified apply, and
publish() call to verified apply). Results: bench/results/publish.json.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import statistics
import sysconfig
import tempfile
import time

import numpy as np
import torch
from report import parse_with_smoke, save, smoke_path

from deltasync.follow import Follower
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.subscriber import DeltaSubscriber


def tokens(n: int, seed: int) -> torch.Tensor:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:100]
    data = b"".join(open(f, "rb").read() for f in files)
    start = np.random.default_rng(seed).integers(0, len(data) - n)
    return torch.tensor(list(data[start : start + n]), dtype=torch.long)


def follower(uri: str, applied, stop, poll_s: float) -> None:
    """A replica's follow loop in its own process (a replica is another machine): follows the
    bucket into a CPU HeldWeights copy and records when each version is applied."""
    follower = Follower(uri, poll_interval_s=poll_s, max_poll_interval_s=poll_s)
    for pulled in follower.follow(stop):
        for step in pulled.steps if pulled else []:
            applied[step.version] = time.time()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=3, help="off/on block pairs")
    p.add_argument("--steps-per-block", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", default="bench/results/publish.json")
    smoke = dict(layers=1, hidden=64, blocks=1, steps_per_block=2, seq=64)
    a = parse_with_smoke(p, {**smoke, "out": smoke_path("publish.json")})
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=a.hidden // 8,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    n_params = sum(p.numel() for p in model.parameters())
    uri = tempfile.mkdtemp(prefix="bench-publish-")
    pub = DeltaPublisher(uri, config=PublisherConfig(anchor_every=50))
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    applied = manager.dict()
    stop = ctx.Event()
    publish_calls: dict[int, float] = {}
    pub.publish(model.named_parameters(), step=0)
    pub.flush()
    t = ctx.Process(target=follower, args=(uri, applied, stop, 0.05), daemon=True)
    t.start()
    times = {"off": [], "on": []}
    diff_s = []
    step = 0
    for block in range(2 * a.blocks):
        arm = "off" if block % 2 == 0 else "on"
        for _ in range(a.steps_per_block):
            ids = tokens(a.seq, step).unsqueeze(0)
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if arm == "on":
                t1 = time.perf_counter()
                v = pub.publish(model.named_parameters(), step=step)
                publish_calls[v] = time.time()
                diff_s.append(time.perf_counter() - t1)
            times[arm].append(time.perf_counter() - t0)
            step += 1
    pub.close()
    deadline = time.time() + 60
    while time.time() < deadline and max(publish_calls) not in applied:
        time.sleep(0.1)
    stop.set()
    t.join()
    applied = dict(applied)
    manifest = DeltaSubscriber(uri).read_manifest()
    committed = {v.version: v.created_at for v in manifest.versions}
    lag_commit = [
        applied[v] - committed[v] for v in publish_calls if v in applied and v in committed
    ]
    lag_call = [applied[v] - publish_calls[v] for v in publish_calls if v in applied]
    deltas = [v for v in manifest.versions if v.delta is not None]
    off, on = statistics.fmean(times["off"]), statistics.fmean(times["on"])

    def pct(xs, q):
        return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None

    res = dict(
        params=n_params,
        steps_off=len(times["off"]),
        steps_on=len(times["on"]),
        step_s_off=round(off, 4),
        step_s_on=round(on, 4),
        overhead_pct=round(100 * (on / off - 1), 2),
        publish_blocking_s_mean=round(statistics.fmean(diff_s), 4),
        blocking_pct_of_step=round(100 * statistics.fmean(diff_s) / off, 2),
        lag_commit_to_applied_s_p50=pct(lag_commit, 0.5),
        lag_commit_to_applied_s_p95=pct(lag_commit, 0.95),
        lag_publish_to_applied_s_p50=pct(lag_call, 0.5),
        lag_publish_to_applied_s_p95=pct(lag_call, 0.95),
        versions_applied=len([v for v in publish_calls if v in applied]),
        density_mean=round(statistics.fmean([d.density for d in deltas]), 5),
        delta_bytes_mean=round(statistics.fmean([d.delta.bytes for d in deltas])),
        bytes_per_changed=round(
            statistics.fmean([d.delta.bytes / d.changed for d in deltas if d.changed]), 3
        ),
        cpu_count=os.cpu_count(),
    )
    save(a.out, res)
    print("| metric | value |\n|---|---|")
    for k, v in res.items():
        print(f"| {k} | {v} |")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
