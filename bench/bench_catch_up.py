"""Catch-up against lag: what a replica k versions behind pays to reach the newest version, by the
delta chain and by an anchor (`make bench`; bench/results/catch_up.json; docs/BENCHMARKS.md section 12 (catch-up against lag)).

Two runs, each at its own model and its own per-version change density:
  - ``local``: the local model's shapes (Qwen3, 2 layers, hidden 192, two untied 5,056 x 192
    embeddings, 2.68 M parameters; synthetic weights, normal std 0.02, norms 1) at 16% of the
    elements changed per version, as in `make train` (lr 2e-4; BENCHMARKS.md section 6 (the main job));
  - ``pretrained``: SmolLM2-135M-Instruct (30 layers, 134.5 M parameters, tied embeddings), its
    real bf16 weights when `make model` has converted it (``--model-dir``; else synthetic at its
    shapes), at 0.2% per version, as its GRPO run at lr 1e-6 (BENCHMARKS.md section 11 (a real pretrained chat model)).
fp32 master weights start within half an ulp of the bf16 weights (a trainer's master weights sit
off the bf16 grid) and take optimizer-like steps (``bench_shapes.py``'s: every nonzero element
moves by ``lr * u``, ``u ~ N(0, 1)`` clipped to [-1, 1]), lr bisected on a sample so that the
target share of bf16 elements changes. Exact zeros stay put: SmolLM2's 4-bit source left 1% of
its embedding at 0, which any step would move (a density floor of 0.2% by themselves), while its
real run changed 0.11-0.14% of the embedding per version.

A ``DeltaPublisher`` on a local folder publishes v0..vN (``--versions``) with anchors only at v0
and vN. A replica (``DeltaSubscriber``) walks v0 -> vN one delta at a time and a fresh one syncs
to vN (the anchor), each step timed (fetch + digest check + parse + decode + verify, 2 cores).
For k = 1..32:
  - bytes: the delta chain from N-k (the manifest's bytes of the k deltas) against the anchor at N,
    and the path ``DeltaSubscriber.plan`` takes (asserted to be the cheaper in bytes);
  - seconds: the measured local seconds of the path's steps (a chain from N-k is the walk's last
    k steps), plus a modeled download on two links (bytes / bandwidth + requests x latency, one
    GET per payload file; ``LINKS``, assumed);
  - anchor intervals A (and the interval the default ``PublisherConfig`` rule gives): N's newest
    anchor lies j versions back, j uniform over 0..A-1; ``keep_anchors=2`` keeps the versions from
    the anchor before it, so a replica more than j + A + 1 behind has no chain left. Per A: the
    mean bytes and seconds of the path plan() takes from N-k and from nothing, and the
    publisher's anchor bytes per version.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from report import parse_with_smoke, save, smoke_path

from deltasync.manifest import Manifest
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.subscriber import DeltaSubscriber, HeldWeights

# hidden, intermediate, layers, q heads, kv heads, head_dim, vocab, tied (config.json; the local
# model's from trainer/task/wordle/model.py, its vocabulary from its 2.68 M parameters)
MODELS = {
    "local": (192, 384, 2, 4, 2, 64, 5056, False),
    "smollm2": (576, 1536, 30, 9, 3, 64, 49152, True),
}
# per density: share of elements changed per version, and the model of the run it stands for
DENSITIES = {"local": (0.16, "local"), "pretrained": (0.002, "smollm2")}
KS = (1, 2, 4, 8, 16, 32)
INTERVALS = (5, 10, 20, 40, 100, 200)
# Assumed links (no published figure found): a Hugging Face Space reading a Hub bucket, and a
# slower one (another cloud or region). Latency: per GET, to the first byte.
LINKS = {
    "space": dict(bytes_per_s=100e6, s_per_request=0.05),
    "slow": dict(bytes_per_s=10e6, s_per_request=0.15),
}


def synthetic(model: str, layers: int) -> dict[str, torch.Tensor]:
    """Random bf16 weights at ``model``'s shapes (its first ``layers`` layers)."""
    h, inter, _, nq, nkv, hd, vocab, tied = MODELS[model]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (nq * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nq * hd),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if model == "local":  # Qwen3's per-head norms
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    g = torch.Generator().manual_seed(0)
    return {
        n: (torch.randn(s, generator=g) * 0.02 if len(s) > 1 else torch.ones(s)).bfloat16()
        for n, s in shapes.items()
    }


def load_master(model: str, model_dir: str, layers: int) -> tuple[dict[str, torch.Tensor], str]:
    """fp32 master weights within half an ulp of the bf16 weights, and where those came from."""
    path = os.path.join(model_dir, "model.safetensors")
    if model == "smollm2" and os.path.exists(path):
        from safetensors.torch import load_file

        bf16, source = load_file(path), f"{path} (pretrained)"
    else:
        bf16, source = synthetic(model, layers), f"synthetic at the {model} model's shapes"

    def kept(name: str) -> bool:
        return ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < layers

    torch.manual_seed(1)
    master = {}
    for name in sorted(n for n in bf16 if kept(n)):
        w = bf16[name].float()
        m, e = torch.frexp(w)  # |w| = |m| * 2**e, |m| in [0.5, 1): one bf16 ulp is 2**(e - 8)
        e = e - (m.abs() == 0.5).int()  # a power of two: the ulp below it is half as big
        ulp = torch.where(w == 0, 0.0, torch.ldexp(torch.ones_like(w), e - 8))
        master[name] = w + (torch.rand_like(w) - 0.5) * 0.99 * ulp
        assert torch.equal(master[name].bfloat16(), bf16[name]), name
    return master, source


def step(master: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """One optimizer-like step in place: every nonzero element moves by ``lr * u``,
    u ~ N(0, 1) clipped to [-1, 1]."""
    torch.manual_seed(1_000_003 + seed)
    for w in master.values():
        u = torch.randn_like(w).clamp_(-1, 1)
        w.add_(u.masked_fill_(w == 0, 0.0), alpha=lr)


def calibrate(master: dict[str, torch.Tensor], target: float) -> float:
    """The lr at which ``target`` of the bf16 elements change in one step (bisection on a log
    scale over a sample: layer 0 and the first 4,096 embedding rows)."""
    sample = {n: w[:4096].clone() for n, w in master.items() if "layers.0." in n or "embed" in n}
    base = {n: w.bfloat16() for n, w in sample.items()}
    total = sum(w.numel() for w in sample.values())
    lo, hi = 1e-8, 1e-2
    for _ in range(24):
        lr = (lo * hi) ** 0.5
        moved = {n: w.clone() for n, w in sample.items()}
        step(moved, lr, 0)
        changed = sum(int((moved[n].bfloat16() != base[n]).sum()) for n in sample)
        lo, hi = (lr, hi) if changed / total < target else (lo, lr)
    return (lo * hi) ** 0.5


def publish_run(uri: str, master: dict, lr: float, versions: int) -> list:
    """v0..v``versions``; anchors only at v0 and at the last version. The manifest's entries."""
    cfg = PublisherConfig(anchor_every=versions, anchor_replay_fraction=1e9, keep_anchors=2)
    with DeltaPublisher(uri, config=cfg) as pub:
        for v in range(versions + 1):
            if v:
                pub.flush()  # one version at a time: nothing coalesced
            pub.publish(master.items(), step=v)
            if v < versions:
                step(master, lr, v)  # while the last version encodes on the publisher's thread
        pub.flush()
        return pub.manifest.versions


def replica_times(uri: str, repeats: int) -> dict:
    """Seconds (fetch + digest check + parse + decode + verify, 2 cores) of each delta on the
    walk v0 -> vN, and of a fresh replica's sync to vN (the anchor at vN): per step the fastest
    of ``repeats`` runs (the machine is shared). The walk and the fresh sync end on the same bits.
    """
    sub = DeltaSubscriber(uri)
    manifest = sub.read_manifest()
    top = manifest.latest.version

    def run(plan, held: HeldWeights) -> float:
        t0 = time.perf_counter()
        for s in plan.steps:
            sub.decode_into(sub.fetch(s), held, manifest)
        return time.perf_counter() - t0

    anchor0_s, anchor_s, delta_s = [], [], []
    for _ in range(repeats):
        walked = HeldWeights()
        anchor0_s.append(run(sub.plan(None, manifest, target=0), walked))
        walk = []
        for v in range(1, top + 1):
            plan = sub.plan(v - 1, manifest, target=v)
            assert [s.kind for s in plan.steps] == ["delta"], plan
            walk.append(run(plan, walked))
        delta_s.append(walk)
        fresh = HeldWeights()
        t0 = time.perf_counter()
        steps = sub.sync(fresh)  # reads the manifest, plans from nothing, loads the anchor at vN
        anchor_s.append(time.perf_counter() - t0)
        assert [s.kind for s, _ in steps] == ["anchor"] and fresh.version == walked.version
        assert all(np.array_equal(fresh.tensors[n], a) for n, a in walked.tensors.items())
    sub.close()
    return dict(
        anchor_s=min(anchor_s),
        anchor0_s=min(anchor0_s),
        delta_s=[min(runs) for runs in zip(*delta_s, strict=True)],
        delta_s_runs=delta_s,
    )


def newest(x: list, n: int) -> float:
    """Sum of the newest ``n`` of the measured per-delta figures ``x``, repeated when ``n`` is
    longer than the run (the steps are stationary)."""
    whole, rest = divmod(n, len(x))
    return whole * sum(x) + (sum(x[len(x) - rest :]) if rest else 0)


def seconds(local_s: float, nbytes: int, requests: int, link: dict) -> float:
    """Measured local seconds plus the modeled download on ``link``."""
    return local_s + nbytes / link["bytes_per_s"] + requests * link["s_per_request"]


def plan_check(uri: str, ks, delta_bytes: list[int], anchor_bytes: int) -> dict[int, str]:
    """The path ``DeltaSubscriber.plan`` takes from N-k, asserted to be the cheaper in bytes."""
    sub = DeltaSubscriber(uri)
    manifest = sub.read_manifest()
    top = manifest.latest.version
    chosen = {}
    for k in ks:
        plan = sub.plan(top - k, manifest)
        chain = newest(delta_bytes, k)
        kind = "anchor" if plan.steps[0].kind == "anchor" else "chain"
        assert plan.bytes == min(chain, anchor_bytes), (k, plan.bytes, chain, anchor_bytes)
        chosen[k] = kind
    sub.close()
    return chosen


def default_interval(delta_bytes: list[int], anchor_bytes: int, cfg: PublisherConfig) -> int:
    """Versions between anchors under ``cfg``'s rule (``DeltaPublisher._diff``: anchor when
    ``anchor_every`` versions passed or the deltas committed since the last anchor exceed
    ``anchor_replay_fraction`` of an anchor), with the measured delta sizes in a loop."""
    since, replay = 0, 0
    for i in range(10 * cfg.anchor_every):
        since += 1
        if since >= cfg.anchor_every or replay > cfg.anchor_replay_fraction * anchor_bytes:
            return since
        replay += delta_bytes[i % len(delta_bytes)]
    return since


def interval_costs(A: int, r: dict, ks) -> dict:
    """Mean over N's place in the anchor cycle (j = 0..A-1 versions after its newest anchor) of
    what plan() downloads and the seconds it takes, for a replica k behind and a new one; the
    manifest every replica reads whole after each version; the publisher's anchor bytes."""
    d, ds = r["delta_bytes"], r["delta_s"]
    a, a_s, a_parts = r["anchor_bytes"], r["anchor_s"], r["anchor_parts"]

    def cost(link, nbytes, requests, local_s):
        return nbytes if link is None else seconds(local_s, nbytes, requests, link)

    out = {}
    for link_name, link in [("bytes", None), *LINKS.items()]:
        row = {}
        for k in (*ks, "new"):
            taken = []
            for j in range(A):
                anchored = cost(link, a + newest(d, j), a_parts + j, a_s + newest(ds, j))
                if k == "new" or k > j + A + 1:  # nothing held, or its chain was dropped
                    taken.append(anchored)
                else:  # plan() compares bytes, not seconds
                    chain = cost(link, newest(d, k), k, newest(ds, k))
                    taken.append(anchored if a + newest(d, j) < newest(d, k) else chain)
            row[k] = statistics.mean(taken)
        out[link_name] = row
    retained = statistics.mean(A + j + 1 for j in range(A))  # from the anchor before N's newest
    out["manifest_bytes"] = r["manifest_fixed_bytes"] + retained * r["manifest_entry_bytes"]
    out["publisher_anchor_bytes_per_version"] = a / A
    return out


def manifest_sizes(uri: str) -> dict:
    """The manifest's bytes without versions (the model fingerprint) and per version entry."""
    with open(os.path.join(uri, "manifest.json"), "rb") as f:
        data = f.read()
    manifest = Manifest.from_json(data)
    fixed = len(manifest.model_copy(update={"versions": []}).to_json())
    return dict(
        manifest_bytes=len(data),
        manifest_fixed_bytes=fixed,
        manifest_entry_bytes=(len(data) - fixed) / len(manifest.versions),
    )


def measure(name: str, args) -> dict:
    target, model = DENSITIES[name]
    model = model if args.model == "auto" else args.model
    layers = MODELS[model][2] if args.layers is None else args.layers
    master, source = load_master(model, args.model_dir, layers)
    elements = sum(w.numel() for w in master.values())
    t0 = time.perf_counter()
    lr = calibrate(master, target)
    print(f"[{name}] {source}: {elements / 1e6:.1f} M elements; lr {lr:.3g} for {target:.1%}")
    uri = tempfile.mkdtemp(prefix="deltasync-catch-up-") + "/bucket"
    entries = publish_run(uri, master, lr, args.versions)
    del master
    t1 = time.perf_counter()
    deltas = [e for e in entries if e.delta is not None]
    last = entries[-1]  # the anchor at N, and a delta

    def median(key, of=deltas[:-1]):
        return statistics.median(e.timings_s[key] for e in of)

    r = dict(
        model=model,
        source=source,
        elements=elements,
        lr=lr,
        target_density=target,
        density=statistics.mean(e.density for e in deltas),
        bytes_per_changed=sum(e.delta.bytes for e in deltas) / sum(e.changed for e in deltas),
        delta_bytes=[e.delta.bytes for e in deltas],
        anchor_bytes=last.anchor.bytes,
        anchor_parts=len(last.anchor.files),
        **manifest_sizes(uri),
        versions=len(entries),
        publish_diff_s_median=median("diff_s"),
        publish_diff_s_with_anchor=last.timings_s["diff_s"],  # + the copy the anchor is cut from
        publish_write_s_median=median("write_upload_s"),
        publish_write_s_with_anchor=last.timings_s["write_upload_s"],
        encode_s_median=median("encode_s", deltas),
    )
    r |= replica_times(uri, args.repeats)
    r["plan"] = plan_check(uri, args.ks, r["delta_bytes"], r["anchor_bytes"])
    r["default_interval"] = default_interval(r["delta_bytes"], r["anchor_bytes"], PublisherConfig())
    intervals = sorted({*args.intervals, r["default_interval"]})
    r["intervals"] = {A: interval_costs(A, r, args.ks) for A in intervals}
    r["publish_s"], r["replica_s"] = t1 - t0, time.perf_counter() - t1
    return r


def report(name: str, r: dict, ks) -> None:
    d, ds, a, a_s = r["delta_bytes"], r["delta_s"], r["anchor_bytes"], r["anchor_s"]
    mean_d, mean_ds = statistics.mean(d), statistics.mean(ds)
    even = {"bytes": a / mean_d}  # k from which the anchor at N costs less than the chain
    for link_name, link in LINKS.items():
        per_delta = seconds(mean_ds, mean_d, 1, link)
        even[link_name] = seconds(a_s, a, r["anchor_parts"], link) / per_delta
    print(
        f"\n### {name}: {r['source']}, {r['elements'] / 1e6:.1f} M elements; density "
        f"{r['density']:.2%} per version (lr {r['lr']:.3g}), {r['bytes_per_changed']:.3f} B per "
        f"changed element; delta {mean_d / 1e6:.3f} MB = {mean_d / a:.3%} of the "
        f"{a / 1e6:.1f} MB anchor\n"
        f"replica, local: delta {statistics.median(ds):.3f} s (median), anchor {a_s:.3f} s; "
        f"publisher: diff {r['publish_diff_s_median']:.3f} s ({r['publish_diff_s_with_anchor']:.3f}"
        f" s with the anchor's copy), write {r['publish_write_s_median']:.3f} s "
        f"({r['publish_write_s_with_anchor']:.3f} s with the anchor)\n"
        f"the anchor at N is cheaper from k = {even['bytes']:.1f} by bytes, "
        f"{even['space']:.1f} by seconds on the Space link, {even['slow']:.1f} on the slow one; "
        f"took {r['publish_s']:.0f} s to publish, {r['replica_s']:.0f} s to replay\n"
    )
    head = (
        "| k | chain MB | anchor MB | local s chain / anchor | Space s chain / anchor "
        "| slow s chain / anchor | cheaper (bytes) | plan() | cheaper (s, Space / slow) |"
    )
    print(head + "\n" + "|---" * 9 + "|")
    for k in ks:
        chain, chain_s = newest(d, k), newest(ds, k)
        cells = [f"{chain / 1e6:.2f}", f"{a / 1e6:.1f}", f"{chain_s:.3f} / {a_s:.3f}"]
        faster = []
        for link in LINKS.values():
            c = seconds(chain_s, chain, k, link)
            an = seconds(a_s, a, r["anchor_parts"], link)
            cells.append(f"{c:.2f} / {an:.2f}")
            faster.append("chain" if c <= an else "anchor")
        cells += ["chain" if chain <= a else "anchor", r["plan"][k], " / ".join(faster)]
        print(f"| {k} | " + " | ".join(cells) + " |")
    print(
        f"\nAnchor every A versions, keep_anchors=2 (the default rule gives A = "
        f"{r['default_interval']} here): mean MB that plan() downloads (seconds on the Space link)"
    )
    head = (
        "| A | publisher: anchor MB per version (x delta) | manifest KB | new replica | "
        + " | ".join(f"k={k}" for k in ks)
    )
    print(head + " |\n" + "|---" * (4 + len(ks)) + "|")
    for A, c in r["intervals"].items():
        per_v = c["publisher_anchor_bytes_per_version"]
        cells = [f"{per_v / 1e6:.2f} (x{per_v / mean_d:.1f})", f"{c['manifest_bytes'] / 1e3:.0f}"]
        for k in ("new", *ks):
            cells.append(f"{c['bytes'][k] / 1e6:.2f} ({c['space'][k]:.1f} s)")
        mark = " (default)" if A == r["default_interval"] else ""
        print(f"| {A}{mark} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default="runs/models/smollm2-135m-instruct")
    p.add_argument("--model", default="auto", help="auto (each density's own), local, smollm2")
    p.add_argument("--layers", type=int, default=None, help="decoder layers kept (default all)")
    p.add_argument("--versions", type=int, default=40, help="N: versions after v0")
    p.add_argument("--densities", default=",".join(DENSITIES), help=f"of {list(DENSITIES)}")
    p.add_argument("--repeats", type=int, default=2, help="replica timings: fastest of")
    p.add_argument("--ks", default=",".join(map(str, KS)))
    p.add_argument("--intervals", default=",".join(map(str, INTERVALS)))
    p.add_argument("--out", default="bench/results/catch_up.json")
    smoke = dict(versions=4, layers=1, repeats=1, ks="1,2,4", intervals="2,4")
    a = parse_with_smoke(p, {**smoke, "out": smoke_path("catch_up.json")})
    a.ks = [int(k) for k in a.ks.split(",")]
    a.intervals = [int(i) for i in a.intervals.split(",")]
    if max(a.ks) > a.versions:
        raise ValueError(f"--versions {a.versions} must cover the largest k, {max(a.ks)}")
    t0 = time.perf_counter()
    res = {"links": LINKS, "ks": a.ks}
    for name in a.densities.split(","):
        res[name] = measure(name, a)
        report(name, res[name], a.ks)
    res["wall_s"] = time.perf_counter() - t0
    save(a.out, res)
    print(f"\nwall {res['wall_s']:.0f} s; wrote {a.out}")


if __name__ == "__main__":
    main()
