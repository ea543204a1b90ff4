"""Codec benchmark on realistic RL deltas (`make bench`; results in bench/results/codec.json).

A Qwen3-0.6B-shaped model (random init, fp32 master weights, published as bf16) takes real AdamW
steps at RL learning rates with gradients of a real causal-LM loss on local text (Python's own
source files, byte tokens; random init, not a pretrained checkpoint: the base-value distribution
of a trained model differs). Each step's bf16 delta is coded by our codec and by the published
baselines, side by side:
  - ours: ulp-expclass-rice/1 (deltasync.codec), positions conditioned on the base exponent
  - TRL v1: int32 flat indices + bf16 absolute values (6 B per change, uncompressed)
  - TRL v3: uint16 gaps (uint32 for a tensor with a gap >= 65536) + bf16 absolute values
  - gaps+zstd: a base-blind coder (varint gaps + ulp-diff bytes, zstd), the NeMo-RL/PULSE family
  - zstd of the full bf16 snapshot (level 1)
Times are also given as multiples of one plain `torch.ne` pass over the same tensors (which uses
every core): the diff (what the training loop waits for; serial and on one thread per core, as the
publisher runs it) and the encode (class ranks, Rice and zstd coding; on the publisher's background
thread).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zstandard
from report import parse_with_smoke, save, smoke_path
from tqdm import tqdm

from deltasync import codec
from deltasync.bf16 import order_key, to_bf16_bits

QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
# --smoke: the same architecture at a small vocabulary and width (seconds, not minutes)
SMOKE_SHAPE = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=384,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
)


def text_tokens(n: int, seed: int) -> torch.Tensor:
    """n byte-level tokens from the Python standard library's source files (always present)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = b"".join(open(f, "rb").read() for f in files[:200])
    start = np.random.default_rng(seed).integers(0, len(data) - n)
    return torch.tensor(list(data[start : start + n]), dtype=torch.long)


def bits_of(model) -> dict[str, np.ndarray]:
    return {n: to_bf16_bits(p).copy() for n, p in model.named_parameters()}


def trl_v3_bytes(idx: np.ndarray) -> int:
    gaps = np.diff(idx, prepend=0)
    return len(idx) * (2 if (gaps < 65536).all() else 4) + 2 * len(idx)


def gap_zstd(idx, old, new, level=1) -> bytes:
    """Base-blind coder: LEB128 varint gaps + zigzag ulp diffs (varint), each zstd'd."""
    gaps = np.diff(idx, prepend=-1) - 1
    d = (order_key(new).astype(np.int32) - order_key(old)).astype(np.int64)
    d = ((d + 0x8000) & 0xFFFF) - 0x8000
    z = ((d << 1) ^ (d >> 63)).astype(np.uint64)

    def varint(a):
        out = []
        a = a.astype(np.uint64)
        while True:
            b = (a & np.uint64(0x7F)).astype(np.uint8)
            a = a >> np.uint64(7)
            more = a > 0
            out.append(np.where(more, b | 0x80, b))
            if not more.any():
                break
        lens = np.zeros(len(out[0]), np.int64)
        for i in range(len(out)):
            lens += 1 if i == 0 else (out[i - 1] & 0x80) > 0
        # interleave byte i of each number while it has one
        stack = np.stack(out, 1)
        keep = np.arange(stack.shape[1])[None, :] < lens[:, None]
        return stack[keep].tobytes()

    c = zstandard.ZstdCompressor(level=level)
    return c.compress(varint(gaps)) + c.compress(varint(z))


def measure(base: dict, new: dict, base_t: dict, new_t: dict) -> dict:
    names = list(base)
    t = time.perf_counter()
    for n in names:
        torch.ne(base_t[n], new_t[n])
    ne_s = time.perf_counter() - t
    t = time.perf_counter()
    changes = {n: codec.diff(base[n], new[n]) for n in names}
    diff_s = time.perf_counter() - t
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # as the publisher runs it (GIL released)
        t = time.perf_counter()
        list(pool.map(lambda n: codec.diff(base[n], new[n]), names))
        diff_par_s = time.perf_counter() - t
    classes = {n: codec.exponent_classes(base[n]) for n in names}  # the publisher keeps these
    t = time.perf_counter()
    blobs = {n: codec.encode(changes[n], classes[n]) for n in names if changes[n].n_changed}
    enc_s = time.perf_counter() - t
    t = time.perf_counter()
    for n, b in blobs.items():
        idx, vals = codec.decode(b, base[n])
    dec_s = time.perf_counter() - t
    t = time.perf_counter()
    gz = sum(len(gap_zstd(c.idx, c.old_bits, c.new_bits)) for c in changes.values() if c.n_changed)
    gz_s = time.perf_counter() - t
    m = sum(c.n_changed for c in changes.values())
    total = sum(a.size for a in base.values())
    ours = sum(len(b) for b in blobs.values())
    v3 = sum(trl_v3_bytes(c.idx) for c in changes.values() if c.n_changed)
    # exact check: decoding every blob onto the base gives the new bits
    for n, b in blobs.items():
        idx, vals = codec.decode(b, base[n])
        assert np.array_equal(idx, changes[n].idx) and np.array_equal(vals, changes[n].new_bits)
    return dict(
        changed=m,
        total=total,
        density=m / total,
        ours_bytes=ours,
        trl_v1_bytes=6 * m,
        trl_v3_bytes=v3,
        gap_zstd_bytes=gz,
        ours_B_per_change=ours / m,
        trl_v1_B_per_change=6.0,
        trl_v3_B_per_change=v3 / m,
        gap_zstd_B_per_change=gz / m,
        ne_s=ne_s,
        diff_s=diff_s,
        diff_parallel_s=diff_par_s,
        diff_x_ne=diff_s / ne_s,
        diff_parallel_x_ne=diff_par_s / ne_s,
        encode_s=enc_s,
        encode_only_x_ne=enc_s / ne_s,
        diff_encode_s=diff_s + enc_s,
        encode_x_ne=(diff_s + enc_s) / ne_s,
        decode_s=dec_s,
        gap_zstd_encode_s=gz_s,
    )


def snapshot_zstd(bits: dict) -> tuple[int, float]:
    t = time.perf_counter()
    c = zstandard.ZstdCompressor(level=1, threads=-1)
    size = sum(len(c.compress(a.tobytes())) for a in bits.values())
    return size, time.perf_counter() - t


def run(lr: float, args) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    shape = {**QWEN3_06B, **(SMOKE_SHAPE if args.smoke else {}), "num_hidden_layers": args.layers}
    cfg = Qwen3Config(**shape)
    model = Qwen3ForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    prev = bits_of(model)
    steps = []
    for s in tqdm(range(args.steps), desc=f"AdamW lr={lr:g}", file=sys.stdout):
        ids = torch.stack([text_tokens(args.seq, args.seed * 1000 + s * 7 + b) for b in range(2)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cur = bits_of(model)
        tens = {n: torch.from_numpy(a.view(np.int16)) for n, a in prev.items()}
        tens_new = {n: torch.from_numpy(a.view(np.int16)) for n, a in cur.items()}
        r = measure(prev, cur, tens, tens_new)
        r.update(step=s + 1, loss=float(loss.detach()))
        steps.append(r)
        prev = cur
    snap_bytes, snap_s = snapshot_zstd(prev)
    return dict(
        lr=lr,
        steps=steps,
        snapshot_bf16_bytes=sum(a.nbytes for a in prev.values()),
        snapshot_zstd_bytes=snap_bytes,
        snapshot_zstd_s=snap_s,
    )


def table(results: list[dict]) -> str:
    head = (
        "| lr | step | density | ours B/chg | TRL v1 | TRL v3 | gaps+zstd | ours MB | "
        "zstd snapshot MB | ne s | diff s (x ne) | diff 2 threads (x ne) | encode s (x ne) | "
        "decode s |"
    )
    rows = [head, "|---" * 14 + "|"]
    for r in results:
        for s in r["steps"]:
            rows.append(
                f"| {r['lr']:g} | {s['step']} | {100 * s['density']:.3f}% | "
                f"{s['ours_B_per_change']:.3f} | 6.000 | {s['trl_v3_B_per_change']:.3f} | "
                f"{s['gap_zstd_B_per_change']:.3f} | {s['ours_bytes'] / 1e6:.2f} | "
                f"{r['snapshot_zstd_bytes'] / 1e6:.0f} | {s['ne_s']:.3f} | "
                f"{s['diff_s']:.3f} ({s['diff_x_ne']:.1f}) | "
                f"{s['diff_parallel_s']:.3f} ({s['diff_parallel_x_ne']:.1f}) | "
                f"{s['encode_s']:.3f} ({s['encode_only_x_ne']:.1f}) | {s['decode_s']:.3f} |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6])
    p.add_argument("--steps", type=int, default=3, help="AdamW steps per learning rate")
    p.add_argument("--layers", type=int, default=28, help="28 = Qwen3-0.6B")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (batch of 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/codec.json")
    smoke = dict(lrs=[1e-5], steps=1, layers=1, seq=32, out=smoke_path("codec.json"))
    args = parse_with_smoke(p, smoke)
    torch.set_num_threads(os.cpu_count() or 1)
    results = [run(lr, args) for lr in args.lrs]
    meta = dict(args=vars(args), cpu_count=os.cpu_count(), torch=torch.__version__)
    save(args.out, dict(meta=meta, results=results))
    print(table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
