"""The full-weights check's cost on a real vLLM replica (`make bench`; docs/BENCHMARKS.md).

``SyncLoop.check_served`` reads every checkpoint tensor back from what the engine computes with
(each linear weight through its own kernel: the identity through ``quant_method.apply``; norms and
embeddings as they are) and compares its bf16 digest with the version's verified digest. No pause:
generation goes on. Measured here: the read-back's seconds per check (median of ``--repeats``)
next to one full reload of every tensor (what a repair costs, paused), on a model folder served by
vLLM in the dtype the replica would choose (``ROLLOUT_DTYPE=auto``).

The read-back's work is the identity matmuls, 2 * K^2 * N flops per linear weight [N, K]: the
figure at Qwen3-8B's shapes (bench_shapes.MODELS) is this machine's measured rate scaled by the
flops, and, for a GPU, the flops at an assumed 400 TFLOP/s (bf16, ~40% of an H100/H200's dense
peak). Results: bench/results/served_check.json.

Defaults: the tiny test model (`--model PATH` for a model folder, e.g.
runs/models/smollm2-135m-instruct from `make model`). `--smoke`: the tiny model, one check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from report import parse_with_smoke, save, smoke_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))
sys.path.insert(0, os.path.join(REPO, "spaces", "vllm-rollout"))

GPU_FLOPS = 400e12  # assumed bf16 matmul rate of a GPU for the estimate (flop/s)


def readback_flops(hidden, inter, layers, q_heads, kv_heads, head_dim, vocab, tied) -> float:
    """Flops of reading every linear weight back through the identity: sum of 2 * K^2 * N."""
    q, kv = q_heads * head_dim, kv_heads * head_dim
    per_layer = (
        2 * hidden**2 * (q + 2 * kv)  # qkv_proj
        + 2 * q**2 * hidden  # o_proj
        + 2 * hidden**2 * 2 * inter  # gate_up_proj
        + 2 * inter**2 * hidden  # down_proj
    )
    head = 0 if tied else 2 * hidden**2 * vocab
    return float(layers * per_layer + head)


def model_shape(folder: str) -> tuple:
    import json

    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        heads,
        c.get("num_key_value_heads", heads),
        head_dim,
        c["vocab_size"],
        bool(c.get("tie_word_embeddings", False)),
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="a model folder, or 'tiny' (made locally)")
    p.add_argument("--repeats", type=int, default=5, help="checks measured (median reported)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "served_check.json"))
    args = parse_with_smoke(
        p, {"repeats": 1, "out": smoke_path("bench/results/served_check.json")}, argv
    )

    from bench_shapes import MODELS

    from deltasync.bf16 import to_bf16_bits
    from deltasync.publisher import DeltaPublisher
    from rollout.engine import VLLMControl
    from rollout.launch import served_dtype, start_vllm, stop_process, wait_healthy
    from rollout.staging import write_stage
    from rollout.sync_loop import SyncLoop
    from trainer.local.ports import free_port
    from trainer.task.char_model import checkpoint_tensors, make_char_qwen3

    root = tempfile.mkdtemp(prefix="bench-check-")
    tiny = args.model == "tiny"
    model = make_char_qwen3(os.path.join(root, "tiny")) if tiny else os.path.abspath(args.model)
    bits = {n: to_bf16_bits(t).copy() for n, t in checkpoint_tensors(model).items()}
    bucket = os.path.join(root, "bucket")
    with DeltaPublisher(bucket) as pub:
        pub.publish(list(bits.items()), step=0)
        pub.flush()
    dtype, why = served_dtype("auto")
    port = free_port()
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    proc = start_vllm(
        model,
        port,
        os.path.join(root, "vllm.log"),
        env=env,
        max_model_len=512,
        extra_args=["--enforce-eager", "--distributed-executor-backend", "uni"],
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 900)
        control = VLLMControl(url)
        loop = SyncLoop(bucket, control, "bench", stage_dir=os.path.join(root, "stage"))
        loop.connect()
        loop.poll_once()
        checks = [loop.check_served() for _ in range(args.repeats)]
        assert all(c is not None and c["mismatched"] == [] for c in checks), checks
        path = os.path.join(root, "full.safetensors")
        write_stage(path, "dense", 0, dense=bits)
        t0 = time.perf_counter()
        control.pause("keep")
        control.apply(path, "reload")
        control.resume()
        reload_s = time.perf_counter() - t0
        loop.stop()
        control.close()
    finally:
        stop_process(proc)
    read_s = statistics.median(c["read_s"] for c in checks)
    flops = readback_flops(*model_shape(model))
    flops_8b = readback_flops(*MODELS["qwen3-8b"])
    n_params = sum(a.size for a in bits.values())
    out = {
        "model": args.model,
        "parameters": n_params,
        "tensors": checks[0]["tensors"],
        "dtype": dtype,
        "dtype_reason": why,
        "check_read_s_median": round(read_s, 4),
        "check_read_s_all": [c["read_s"] for c in checks],
        "full_reload_paused_s": round(reload_s, 4),
        "readback_gflop": round(flops / 1e9, 2),
        "measured_gflop_per_s": round(flops / 1e9 / read_s, 1),
        "qwen3_8b_readback_tflop": round(flops_8b / 1e12, 1),
        "qwen3_8b_est_s_this_cpu": round(read_s * flops_8b / flops, 1),
        "qwen3_8b_est_s_gpu_400tflops": round(flops_8b / GPU_FLOPS, 3),
        "cpu": os.cpu_count(),
    }
    print(
        f"check {args.model}: {out['tensors']} tensors, {n_params / 1e6:.1f} M params, {dtype}: "
        f"read-back {read_s:.3f}s median ({out['measured_gflop_per_s']} GFLOP/s), full reload "
        f"{reload_s:.3f}s paused; Qwen3-8B: {out['qwen3_8b_readback_tflop']} TFLOP -> "
        f"~{out['qwen3_8b_est_s_this_cpu']}s here, ~{out['qwen3_8b_est_s_gpu_400tflops']}s on a GPU"
    )
    save(args.out, out)
    return out


if __name__ == "__main__":
    main()
