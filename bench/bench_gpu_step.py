"""The trainer's work on one GPU at real models' shapes, without vLLM: the generating policy's
recomputation, the GRPO step, and what one step publishes.

Per model shape (configs written here, random weights at the config's init scale; nothing is
downloaded), one step's worth of Wordle episodes (``--episodes`` of ``--tokens`` tokens each, a
``--trained`` share of positions scored, as in a Wordle episode where ~89% of the positions are
prompt and tool text):

- **recompute**: ``trainer.loop.generating_policy.batch_log_probs`` (the code that scores stale
  samples under their generating version) over the step's episodes, on a bf16 copy of the model
  (a version's weights are bf16 bits from the bucket);
- **step**: forward, backward and fused AdamW over fp32 master weights with bf16 autocast (the
  trainer's ``--autocast true``), in micro-batches of ``--micro`` episodes; the loss sums the
  scored positions' log-probabilities (the LM head runs only on them, as TRL's fused head does),
  with gradient checkpointing off and on;
- **publish**: after one step at ``--lr``, the bf16 rounding of the master diffed against the bits
  before it on the GPU (``deltasync.snapshot.diff_on_device``) and encoded by the codec: changed
  elements, bytes, bytes per changed element. Random weights are not pretrained ones, so the
  density is a property of these weights' magnitudes, not a forecast for a pretrained model.

With ``--lora RANK`` the model carries a PEFT LoRA adapter of that rank (alpha 2 x rank, on the
seven projections the trainer's ``--adapter lora`` wraps, ``trainer.settings.AdapterSettings``):
the step trains and publishes only the adapter (as an adapter run does); the recomputation is
not measured for it.

Times are the median of ``--repeats`` after one warm-up, with CUDA synchronised. Without CUDA
(``--smoke``, CI) the same code runs on the CPU at a tiny shape. Writes
``bench/results/gpu_step.json``.

Run: ``python bench/bench_gpu_step.py`` on a CUDA machine (about 2 minutes on an H200);
``--smoke``: a 2-layer model, 4 episodes of 64 tokens, seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from bench_codec import QWEN3_06B
from report import parse_with_smoke, save, smoke_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("shared", ""):
    sys.path.insert(0, os.path.join(REPO, sub))

# Shapes from the models' published config.json files (HuggingFaceTB/SmolLM2-135M-Instruct,
# Qwen/Qwen3-0.6B as bench_codec.py has it, Qwen/Qwen3-1.7B).
SHAPES = {
    "smollm2-135m": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-0.6b": ("qwen3", QWEN3_06B),
    "qwen3-1.7b": ("qwen3", {**QWEN3_06B, "hidden_size": 2048, "intermediate_size": 6144}),
    "tiny": (
        "qwen3",
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ),
}


def build(name: str, device: str) -> torch.nn.Module:
    """A causal LM of ``SHAPES[name]`` with random fp32 weights, built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kind, kw = SHAPES[name]
    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    )
    config = config_cls(**kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return model_cls(config).float()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def episodes(vocab: int, n: int, tokens: int, trained: float, seed: int = 0):
    """``n`` random episodes of ``tokens`` ids and the positions scored (bool, position 0 never)."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, tokens) for _ in range(n)]
    wanted = [(rng.random(tokens) < trained) & (np.arange(tokens) > 0) for _ in range(n)]
    return ids, wanted


def step_fn(model, opt, ids, wanted, micro: int, device: str):
    """One GRPO-shaped step: micro-batches of forward (bf16 autocast) and backward, then AdamW."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    batches = []
    for k in range(0, len(ids), micro):
        x = torch.as_tensor(np.stack(ids[k : k + micro]), device=device)
        w = torch.as_tensor(np.stack(wanted[k : k + micro]), device=device)
        sign = torch.where(torch.arange(x.shape[0], device=device) % 2 == 0, 1.0, -1.0)
        batches.append((x, w, sign))
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    def step():
        for x, w, sign in batches:
            with autocast:
                hidden = decoder(input_ids=x).last_hidden_state[:, :-1]
                scored = w[:, 1:]
                logits = head(hidden[scored]).float()
            lp = torch.log_softmax(logits, -1).gather(1, x[:, 1:][scored][:, None])[:, 0]
            rows = torch.nonzero(scored)[:, 0]
            (-(lp * sign[rows]).sum() / scored.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def publish(model, before: dict, device: str) -> dict:
    """Changed elements and the codec's bytes of the master's bf16 bits against ``before`` (the
    bits of the parameters published, by name)."""
    from deltasync import codec
    from deltasync.snapshot import diff_on_device

    changed = total = size = 0
    t_diff = t_encode = 0.0
    for name, p in model.named_parameters():
        if name not in before:
            continue
        base = before[name]
        host_base = base.cpu().numpy().view(np.uint16).copy()  # diff_on_device advances base
        sync(device)
        t0 = time.perf_counter()
        change = diff_on_device(base, p)
        t1 = time.perf_counter()
        size += len(codec.encode(change, host_base)) if change.n_changed else 0
        t_encode += time.perf_counter() - t1
        t_diff += t1 - t0
        changed += change.n_changed
        total += p.numel()
    return {
        "elements": total,
        "changed": changed,
        "density": changed / total,
        "bytes": size,
        "bytes_per_changed": size / max(changed, 1),
        "diff_s": t_diff,
        "encode_s": t_encode,
    }


def with_lora(model, rank: int):
    """``model`` wrapped in a PEFT LoRA adapter of ``rank`` (alpha 2 x rank, no dropout, no bias)
    on the projections the trainer's adapter runs wrap."""
    from peft import LoraConfig, get_peft_model

    from trainer.settings import AdapterSettings

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=AdapterSettings().modules(),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def bench_model(name: str, args, device: str) -> dict:
    from deltasync.snapshot import device_bits
    from trainer.loop.generating_policy import batch_log_probs

    model = build(name, device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.lora:
        model = with_lora(model, args.lora)
    ids, wanted = episodes(
        model.config.vocab_size, args.episodes, args.tokens, args.trained, seed=1
    )
    tokens = args.episodes * args.tokens
    trained = [p for p in model.parameters() if p.requires_grad]
    row = {
        "parameters": n_params,
        "trained_parameters": sum(p.numel() for p in trained),
        "lora_rank": args.lora,
        "tokens": tokens,
        "scored": int(sum(w.sum() for w in wanted)),
        "recompute_s": None,
    }
    if not args.lora:
        frozen = [build(name, device).to(torch.bfloat16).eval()]
        row["recompute_s"] = timed(
            lambda: batch_log_probs(frozen[0], ids, wanted), device, args.repeats
        )
        frozen.clear()

    opt = torch.optim.AdamW(trained, lr=args.lr, fused=device == "cuda")
    model.train()
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        fn = step_fn(model, opt, ids, wanted, args.micro, device)
        key = "step_checkpointing" if checkpointing else "step"
        row[f"{key}_s"] = timed(fn, device, args.repeats)
        if device == "cuda":
            row[f"{key}_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    model.gradient_checkpointing_disable()

    before = {n: device_bits(p).clone() for n, p in model.named_parameters() if p.requires_grad}
    step_fn(model, opt, ids, wanted, args.micro, device)()
    sync(device)
    row["publish"] = publish(model, before, device)
    row["tokens_per_s"] = tokens / row["step_s"]
    pub = row["publish"]
    recompute = "-" if row["recompute_s"] is None else f"{row['recompute_s']:.3f} s"
    print(
        f"{name:13s} {n_params / 1e6:7.1f} M (trained {row['trained_parameters'] / 1e6:.1f} M) "
        f"{tokens} tokens: recompute {recompute}, "
        f"step {row['step_s']:.3f} s ({row['tokens_per_s']:,.0f} tok/s), with checkpointing "
        f"{row['step_checkpointing_s']:.3f} s; lr {args.lr:g}: {pub['density']:.2%} changed, "
        f"{pub['bytes'] / 1e6:.3f} MB, {pub['bytes_per_changed']:.2f} B/changed "
        f"(diff {pub['diff_s']:.3f} s, encode {pub['encode_s']:.2f} s)",
        flush=True,
    )
    del model, opt, before
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-0.6b", "qwen3-1.7b"])
    p.add_argument("--episodes", type=int, default=64, help="episodes a step")
    p.add_argument("--tokens", type=int, default=1024, help="tokens an episode")
    p.add_argument("--trained", type=float, default=0.11, help="share of positions scored")
    p.add_argument("--micro", type=int, default=8, help="episodes a forward/backward")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full weights)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls (median) after a warm-up")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "gpu_step.json"))
    smoke = dict(
        models=["tiny"], episodes=4, tokens=64, micro=2, repeats=1, out=smoke_path("gpu_step.json")
    )
    args = parse_with_smoke(p, smoke)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for the CPU path, or on a GPU machine")
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "smoke")},
        "models": {name: bench_model(name, args, device) for name in args.models},
    }
    save(args.out, results)


if __name__ == "__main__":
    main()
