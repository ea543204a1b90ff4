"""The GRPO step's forward and backward on CPU: TRL's tree attention through our CPU stand-in
(``trainer.loop.trl_compat``) against the per-segment slice writes it replaced.

A row like a ``make train`` step's: the local model's shape (Qwen3, hidden 192, 2 layers, 4 heads,
2 KV heads, head_dim 64, vocabulary 5,056; random weights), GRPO groups of 8 episodes that share a
120-token prompt and branch at different depths, packed by TRL's own ``TreeRow`` into one row of
at most 24,576 unique tokens (``token_budget``), about 20% of completion tokens trained. The loss
is the sum of the trained tokens' log-probabilities through TRL's fused LM head (compact branch).

Prints per variant and thread count: forward and backward seconds (median of 3 after one
warm-up), and checks that log-probabilities and every gradient are bit-identical between the two
variants. Writes ``bench/results/step.json``.

Run: ``.venv/bin/python bench/bench_step.py`` (about 1 minute on 2 cores; ``--smoke``: a row of
2,048 tokens, one thread, one timed step, a few seconds).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
from report import parse_with_smoke, save, smoke_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TOKEN_BUDGET = 24576
GROUP = 8
PROMPT_TOKENS = 120


class SliceWrites:
    """The stand-in before round 3, session 3: each segment's output written into a slice of a
    preallocated tensor (whose backward fills a zero tensor of the whole row per segment)."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, **_):
        out = torch.empty_like(q)
        h, hkv = q.shape[1], k.shape[1]
        for i in range(cu_q.numel() - 1):
            qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            if qe == qs:
                continue
            qi = q[qs:qe].transpose(0, 1)
            ki = k[ks:ke].transpose(0, 1).repeat_interleave(h // hkv, dim=0)
            vi = v[ks:ke].transpose(0, 1).repeat_interleave(h // hkv, dim=0)
            lq, lk = qe - qs, ke - ks
            mask = torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
            o = torch.nn.functional.scaled_dot_product_attention(
                qi.float(), ki.float(), vi.float(), attn_mask=mask, scale=softmax_scale
            )
            out[qs:qe] = o.transpose(0, 1).to(q.dtype)
        return out


def packed_row(vocab: int, seed: int = 0, token_budget: int = TOKEN_BUDGET) -> dict:
    """One row of GRPO groups packed by TRL's ``TreeRow`` up to ``token_budget`` tokens."""
    from trl.experimental.async_grpo.packing import TreeRow

    rng = random.Random(seed)
    row, group = TreeRow(), 0
    while True:
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
        shared = [rng.randrange(vocab) for _ in range(400)]
        for _ in range(GROUP):
            depth = rng.choice([0, 20, 60, 120])  # where the episode leaves its group's path
            length = rng.randint(150, 420)
            completion = shared[:depth] + [rng.randrange(vocab) for _ in range(length - depth)]
            sample = {
                "input_ids": torch.tensor(prompt + completion),
                "completion_mask": torch.tensor(
                    [0] * PROMPT_TOKENS + [int(rng.random() < 0.2) for _ in completion]
                ),
                "old_log_probs": torch.zeros(PROMPT_TOKENS + length),
                "advantage": 0.1,
                "group_id": group,
            }
            if not row.fits(sample, token_budget):
                return {"row": row.pack(), "samples": len(row.samples)}
            row.add(sample)
        group += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--token-budget", type=int, default=TOKEN_BUDGET, help="tokens in the row")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=3, help="timed steps (median) after a warm-up")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "step.json"))
    smoke = dict(token_budget=2048, threads=[1], repeats=1, out=smoke_path("step.json"))
    args = parse_with_smoke(p, smoke)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.experimental.async_grpo import packing
    from trl.trainer.utils import add_fused_lm_head

    from trainer.loop import trl_compat

    trl_compat.apply()
    packing.register_tree_attention()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=5056,
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    )
    config._attn_implementation = packing.TREE_ATTENTION
    model = Qwen3ForCausalLM(config)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    packed = packed_row(config.vocab_size - 64, token_budget=args.token_budget)
    p = packed["row"]
    segments = p["tree_cu_seqlens_q"].numel() - 1
    print(
        f"row: {p['input_ids'].numel()} tokens, {segments} segments, {packed['samples']} "
        f"episodes, {p['token_index'].numel()} trained targets"
    )
    tree = {
        "tree_kv_index": p["tree_kv_index"],
        "tree_cu_seqlens_q": p["tree_cu_seqlens_q"],
        "tree_cu_seqlens_k": p["tree_cu_seqlens_k"],
        "tree_max_seqlen_q": int(p["tree_max_seqlens"][0]),
        "tree_max_seqlen_k": int(p["tree_max_seqlens"][1]),
    }

    def step():
        model.zero_grad()
        t0 = time.perf_counter()
        out = model(
            input_ids=p["input_ids"][None],
            position_ids=p["position_ids"][None],
            shift_labels=p["shift_labels"][None],
            fused_lm_head=True,
            **tree,
        )
        logps = out.log_probs.flatten()[p["token_index"]]
        t1 = time.perf_counter()
        logps.sum().backward()
        t2 = time.perf_counter()
        grads = [x.grad.clone() for x in model.parameters()]
        return logps.detach(), grads, t1 - t0, t2 - t1

    results, outputs = {}, {}
    for name, kernel in (("slice writes (before)", SliceWrites), ("split + cat", None)):
        packing._flash_attn = (lambda k=kernel: k) if kernel else (lambda: trl_compat._CpuFlashAttn)
        for threads in args.threads:
            torch.set_num_threads(threads)
            outputs[name] = step()  # warm-up
            runs = [step() for _ in range(args.repeats)]
            fwd = statistics.median(r[2] for r in runs)
            bwd = statistics.median(r[3] for r in runs)
            results[f"{name}, {threads} thread(s)"] = {"forward_s": fwd, "backward_s": bwd}
            print(f"{name:22s} {threads} thread(s): forward {fwd:.2f} s, backward {bwd:.2f} s")
    (a_lp, a_grads, *_), (b_lp, b_grads, *_) = outputs.values()
    identical = torch.equal(a_lp, b_lp) and all(
        torch.equal(x, y) for x, y in zip(a_grads, b_grads, strict=True)
    )
    print(f"log-probabilities and gradients bit-identical: {identical}")
    results["bit_identical"] = identical
    results["row"] = {"tokens": p["input_ids"].numel(), "segments": segments}
    save(args.out, results)
    if not identical:
        raise SystemExit("the two stand-ins disagree")


if __name__ == "__main__":
    main()
