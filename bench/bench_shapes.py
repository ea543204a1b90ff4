"""Encode, decode and apply at real model shapes (Qwen3-0.6B, Qwen3-8B), on the CPU and, where a
CUDA GPU is present, the trainer's diff on the GPU (`make bench`; docs/BENCHMARKS.md, docs/SCALE.md).

Weights are synthetic bf16 (normal, std 0.02, norms near 1) at the true shapes of each model's
config (huggingface.co/Qwen/Qwen3-0.6B and Qwen3-8B, config.json). The update is optimizer-like:
fp32 master weights move by lr * u with u ~ N(0, 1) clipped to [-1, 1] (the per-element size of an
Adam step is about lr); lr is bisected on the first layer until 1% of the bf16 elements change.
A sample (the embedding and `--layers` decoder layers) is measured at full size; layers are scaled
by the model's layer count (every layer has the same shapes) and an untied LM head, which has the
embedding's shape, counts as a second embedding.

Per model: diff (host numba; GPU: diff on the device, only changes copied back, vs the whole
tensor copied to the host first), encode (per tensor, summed: one core's time), payload bytes,
and the replica's decode + patch + verify through ``DeltaSubscriber.decode_into`` with 1, 2 and all
threads. Results: bench/results/shapes.json (figures per the whole model).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import numpy as np
import torch
from report import parse_with_smoke, save, smoke_path

from deltasync import codec
from deltasync.bf16 import to_bf16_bits
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.snapshot import device_bits, diff_on_device
from deltasync.subscriber import DeltaSubscriber, HeldWeights

# (hidden, intermediate, layers, q heads, kv heads, head_dim, vocab, tied): each config.json
MODELS = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
    # the local model's (trainer/task/wordle/model.py; bench_catch_up.py's "local"): --smoke's
    "local": (192, 384, 2, 4, 2, 64, 5056, False),
}


def shapes(model: str, sample_layers: int) -> tuple[dict[str, tuple], dict[str, int]]:
    """The sampled tensors' shapes, and how many of each the whole model has."""
    h, inter, layers, nq, nkv, hd, vocab, tied = MODELS[model]
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(sample_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (nq * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nq * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    count = {n: layers // sample_layers if ".layers." in n else 1 for n in out}
    count["model.embed_tokens.weight"] = 1 if tied else 2
    return out, count


def step(master: torch.Tensor, lr: float, seed: int) -> torch.Tensor:
    # a stream apart from the weights' own (seed 0): the same draws would scale the weights
    g = torch.Generator(device=master.device).manual_seed(1_000_003 + seed)
    u = torch.randn(master.shape, generator=g, device=master.device).clamp_(-1, 1)
    return master + lr * u


def calibrate(master: torch.Tensor, target=0.01) -> float:
    """The lr at which ``target`` of the bf16 elements change (bisection on a log scale)."""
    base = master.to(torch.bfloat16)
    lo, hi = 1e-7, 1e-2
    for _ in range(30):
        lr = (lo * hi) ** 0.5
        dens = (step(master, lr, 0).to(torch.bfloat16) != base).float().mean().item()
        lo, hi = (lr, hi) if dens < target else (lo, lr)
    return (lo * hi) ** 0.5


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def scaled(per: dict[str, float], count: dict[str, int]) -> float:
    """Sum over the sampled tensors, each counted as often as the whole model has it."""
    return sum(v * count[n] for n, v in per.items())


def bench_model(model: str, sample_layers: int, threads: list[int], device: str | None) -> dict:
    specs, count = shapes(model, sample_layers)
    g = torch.Generator().manual_seed(0)

    def master(s):
        return torch.randn(s, generator=g) * 0.02 if len(s) > 1 else 1 + 0.05 * torch.randn(s)

    lr = calibrate(master(specs["model.layers.0.mlp.up_proj.weight"]))
    base, new = {}, {}
    for n, s in specs.items():  # one fp32 master at a time: the 8B embedding is 2.5 GB
        m = master(s)
        base[n], new[n] = to_bf16_bits(m).copy(), to_bf16_bits(step(m, lr, 1)).copy()
        del m
    warm = base["model.norm.weight"]  # compile the kernels outside the timings
    codec.decode(codec.encode(codec.diff(warm, new["model.norm.weight"]), warm), warm)
    diff_s, enc_s, dec_s, nbytes, changed = {}, {}, {}, {}, {}
    for n in specs:
        ch, diff_s[n] = timed(codec.diff, base[n], new[n])
        blob, enc_s[n] = timed(codec.encode, ch, base[n])
        _, dec_s[n] = timed(codec.decode, blob, base[n])
        nbytes[n], changed[n] = len(blob), ch.n_changed
    total = scaled({n: float(np.prod(s)) for n, s in specs.items()}, count)
    out = {
        "params": int(total),
        "sample": f"embedding + {sample_layers} decoder layers, scaled to the whole model",
        "lr": lr,
        "density": scaled(changed, count) / total,
        "delta_bytes": int(scaled(nbytes, count)),
        "bytes_per_change": scaled(nbytes, count) / scaled(changed, count),
        "anchor_bytes": int(2 * total),
        "cpu_diff_s": scaled(diff_s, count),
        "cpu_encode_s_one_core": scaled(enc_s, count),
        "cpu_decode_s_one_core": scaled(dec_s, count),
    }
    out["replica_apply_s"] = replica_apply(base, new, threads, count)
    if device:
        out["gpu"] = gpu_diff(base, new, device, count)
    return out


def replica_apply(base, new, threads, count) -> dict[str, float]:
    """Decode + patch + verify of the sampled delta through DeltaSubscriber.decode_into, by threads."""
    with tempfile.TemporaryDirectory() as d:
        cfg = PublisherConfig(anchor_every=1000, encode_threads=os.cpu_count() or 2)
        with DeltaPublisher(d, config=cfg) as pub:
            pub.publish(list(base.items()))
            pub.flush()
            pub.publish(list(new.items()))
        res = {}
        for k in threads:
            sub = DeltaSubscriber(d, decode_threads=k)
            manifest = sub.read_manifest()
            anchor, delta = sub.plan(None, manifest).steps
            held = HeldWeights()
            sub.decode_into(sub.fetch(anchor), held, manifest)
            fetched = sub.fetch(delta)
            best = float("inf")
            for _ in range(2):  # undo and repeat; keep the best of two
                tensors = {n: a.copy() for n, a in held.tensors.items()}
                digests = dict(held.digests)
                _, s = timed(sub.decode_into, fetched, held, manifest)
                best = min(best, s)
                held.tensors, held.digests, held.version = tensors, digests, anchor.version
            res[str(k)] = best
            sub.close()
        # the sample's wall time, scaled by the whole model's elements over the sample's
        whole = scaled({n: a.size for n, a in base.items()}, count)
        return {k: v * whole / sum(a.size for a in base.values()) for k, v in res.items()}


def gpu_diff(base, new, device, count) -> dict:
    """The trainer's diff with bf16 weights on the GPU: on the device (changes only cross) vs
    the whole tensor copied to the host and diffed there."""

    def on_gpu(bits):
        return torch.from_numpy(bits.view(np.int16)).to(device).view(torch.bfloat16)

    dev = {n: on_gpu(a) for n, a in base.items()}
    nxt = {n: on_gpu(a) for n, a in new.items()}
    held = {n: device_bits(m).clone() for n, m in dev.items()}
    for n in list(held)[:2]:  # warm-up (kernels, allocator)
        diff_on_device(held[n].clone(), nxt[n])
    on_dev, via_host, crossed, patch = {}, {}, {}, {}
    for n in dev:
        torch.cuda.synchronize()
        t0 = time.perf_counter()  # without a device copy: the new version to the host snapshot
        codec.diff(base[n], to_bf16_bits(nxt[n]))
        via_host[n] = time.perf_counter() - t0
        torch.cuda.synchronize()
        ch, on_dev[n] = timed(diff_on_device, held[n], nxt[n])
        crossed[n] = 12 * ch.n_changed
        # the replica's in-place apply of the same change: positions and bits up, one scatter
        weights = device_bits(dev[n])  # a view: dev[n] becomes the new version
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        idx = torch.from_numpy(ch.idx).to(device, non_blocking=True)
        weights[idx] = torch.from_numpy(ch.new_bits.view(np.int16)).to(device, non_blocking=True)
        torch.cuda.synchronize()
        patch[n] = time.perf_counter() - t0
        assert torch.equal(weights, held[n]), f"{n}: patched weights differ from the trainer's"
    return {
        "device": torch.cuda.get_device_name(),
        "diff_on_device_s": scaled(on_dev, count),
        "copy_to_host_then_diff_s": scaled(via_host, count),
        "bytes_to_host_on_device": int(scaled(crossed, count)),
        "patch_in_place_s": scaled(patch, count),
        "bytes_to_host_via_host": int(2 * scaled({n: m.numel() for n, m in dev.items()}, count)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    p.add_argument(
        "--layers", default="28,8", help="decoder layers measured, per model (0.6B: all of them)"
    )
    p.add_argument("--out", default="bench/results/shapes.json")
    a = parse_with_smoke(p, dict(models="local", layers="2", out=smoke_path("shapes.json")))
    cores = os.cpu_count() or 1
    threads = sorted({1, 2, cores})
    device = "cuda" if torch.cuda.is_available() else None
    res = {"machine": f"{platform.processor() or platform.machine()}, {cores} cores", "models": {}}
    for m, layers in zip(a.models.split(","), a.layers.split(","), strict=True):
        r = bench_model(m, int(layers), threads, device)
        res["models"][m] = r
        ap = r["replica_apply_s"]
        line = (
            f"{m}: {r['params'] / 1e9:.2f} B params, density {r['density']:.4f}, delta "
            f"{r['delta_bytes'] / 1e6:.1f} MB ({r['bytes_per_change']:.2f} B/change), diff "
            f"{r['cpu_diff_s']:.2f} s, encode {r['cpu_encode_s_one_core']:.2f} s/core, decode "
            f"{r['cpu_decode_s_one_core']:.2f} s/core, replica apply "
            + ", ".join(f"{k} thr {v:.2f} s" for k, v in ap.items())
            + f" (x{ap['1'] / ap['2']:.2f} at 2)"
        )
        if "gpu" in r:
            gr = r["gpu"]
            line += (
                f"; GPU diff {gr['diff_on_device_s']:.3f} s on device vs "
                f"{gr['copy_to_host_then_diff_s']:.3f} s via host, in-place patch "
                f"{gr['patch_in_place_s']:.3f} s"
            )
        print(line, flush=True)
    save(a.out, res)


if __name__ == "__main__":
    main()
