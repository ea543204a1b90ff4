"""Apply-path planning without vLLM: fused reload groups (q/k/v, gate/up, weight+bias), the tied
lm_head refresh, the apply-path choice and start-up refusals, the staging file round trip, the
worker-side fused-shard check, the Space configuration, and that the front and the sync loop
import neither torch nor vLLM."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.apply_plan import (
    ModelInfo,
    UnsupportedModelError,
    choose_apply_path,
    module_key,
    plan_reload,
)
from rollout.config import ConfigError, RolloutConfig
from rollout.staging import IDX, VAL, write_stage
from rollout.worker_apply import StageFileError, check_fused_complete, read_stage

L0 = "model.layers.0"
NAMES = [
    "model.embed_tokens.weight",
    f"{L0}.self_attn.q_proj.weight",
    f"{L0}.self_attn.q_proj.bias",
    f"{L0}.self_attn.k_proj.weight",
    f"{L0}.self_attn.k_proj.bias",
    f"{L0}.self_attn.v_proj.weight",
    f"{L0}.self_attn.v_proj.bias",
    f"{L0}.self_attn.o_proj.weight",
    f"{L0}.self_attn.q_norm.weight",
    f"{L0}.mlp.gate_proj.weight",
    f"{L0}.mlp.up_proj.weight",
    f"{L0}.mlp.down_proj.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def info(**kw) -> ModelInfo:
    d = dict(device="cpu", dtype="torch.bfloat16", quantization=None, moe=False)
    d.update(kw)
    return ModelInfo.from_json(d)


def test_module_key_maps_shards_to_fused_modules():
    assert module_key(f"{L0}.self_attn.k_proj.weight") == f"{L0}.self_attn.qkv_proj"
    assert module_key(f"{L0}.mlp.up_proj.weight") == f"{L0}.mlp.gate_up_proj"
    assert module_key(f"{L0}.self_attn.o_proj.weight") == f"{L0}.self_attn.o_proj"
    assert module_key("lm_head.weight") == "lm_head"


def test_touching_one_shard_reloads_every_shard_and_bias_of_that_layer_only():
    rp = plan_reload([f"{L0}.self_attn.q_proj.weight"], NAMES)
    assert rp.names == [n for n in NAMES[1:7]]  # q/k/v weights and biases of layer 0, in order
    rp = plan_reload([f"{L0}.mlp.up_proj.weight", "model.norm.weight"], NAMES)
    assert rp.names == [
        f"{L0}.mlp.gate_proj.weight",
        f"{L0}.mlp.up_proj.weight",
        "model.norm.weight",
    ]
    assert not rp.refresh_lm_head


def test_tied_embedding_change_refreshes_lm_head():
    names = [n for n in NAMES if n != "lm_head.weight"]
    assert plan_reload(
        ["model.embed_tokens.weight"], names, tie_word_embeddings=True
    ).refresh_lm_head
    assert not plan_reload(["model.norm.weight"], names, tie_word_embeddings=True).refresh_lm_head
    assert not plan_reload(["model.embed_tokens.weight"], NAMES).refresh_lm_head


def test_unknown_tensor_is_refused():
    with pytest.raises(KeyError, match="not in the model"):
        plan_reload(["model.layers.9.mlp.up_proj.weight"], NAMES)


def test_apply_path_choice_and_refusals():
    assert choose_apply_path(info()) == "reload"
    assert choose_apply_path(info(device="cuda")) == "in-place"
    assert choose_apply_path(info(device="cuda"), "reload") == "reload"
    assert choose_apply_path(info(device="cuda", dtype="torch.float32")) == "reload"
    with pytest.raises(UnsupportedModelError, match="CPU build"):
        choose_apply_path(info(), "in-place")
    with pytest.raises(UnsupportedModelError, match="quantized"):
        choose_apply_path(info(device="cuda", quantization="fp8"))
    with pytest.raises(UnsupportedModelError, match="bfloat16 or float32.*ROLLOUT_DTYPE"):
        choose_apply_path(info(device="cuda", dtype="torch.float16"))
    with pytest.raises(UnsupportedModelError, match="MoE"):
        choose_apply_path(info(device="cuda", moe=True))
    with pytest.raises(ValueError, match="auto"):
        choose_apply_path(info(), "fast")


def test_a_model_served_in_float32_takes_the_reload_path_only():
    """Where bf16 is emulated the replica serves float32 (ROLLOUT_DTYPE): accepted at start-up on
    the reload path, on CPU and GPU; the in-place path (whose bit-sum check reads parameters as
    bf16) stays bf16-only, while fp16/fp8 stay refused."""
    f32 = "torch.float32"
    assert choose_apply_path(info(dtype=f32)) == "reload"
    assert choose_apply_path(info(dtype=f32), "reload") == "reload"
    assert choose_apply_path(info(device="cuda", dtype=f32), "reload") == "reload"
    with pytest.raises(UnsupportedModelError, match="'in-place' patches bf16 parameters only"):
        choose_apply_path(info(device="cuda", dtype=f32), "in-place")
    assert choose_apply_path(info(device="cuda"), "in-place") == "in-place"  # bf16: allowed
    with pytest.raises(UnsupportedModelError, match="ROLLOUT_DTYPE"):
        choose_apply_path(info(device="cuda", dtype="torch.float8_e4m3fn"))


def test_every_bf16_value_copied_into_a_float32_parameter_keeps_its_bits():
    """What the reload path does on a float32 replica: vLLM's weight loaders ``copy_`` the bf16
    checkpoint tensors into float32 parameters. All 65,536 bf16 bit patterns (NaN payloads, +-inf,
    -0.0, subnormals) come back as the same bits (the float32's upper half, the lower half zero),
    so a float32 replica serves the version's bits."""
    import torch

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bf16 = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    param = torch.empty(bits.shape, dtype=torch.float32)
    param.copy_(bf16)  # vLLM's default_weight_loader: param.data.copy_(loaded_weight)
    held = param.view(torch.int32).numpy().view(np.uint32)
    assert np.array_equal((held >> 16).astype(np.uint16), bits) and not (held & 0xFFFF).any()
    numbers = ~param.isnan()  # rounding back to bf16 is exact too, but NaN becomes canonical
    back = param.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(back[numbers], bf16.view(torch.int16)[numbers])


def test_worker_refuses_a_reload_missing_a_fused_shard():
    check_fused_complete(NAMES, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    partial = [f"{L0}.self_attn.q_proj.weight", f"{L0}.self_attn.v_proj.weight"]
    with pytest.raises(StageFileError, match="k_proj"):
        check_fused_complete(partial, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})


def test_stage_file_round_trip(tmp_path):
    bits = np.arange(12, dtype=np.uint16).reshape(3, 4) | np.uint16(0x3F00)
    p = str(tmp_path / "dense.safetensors")
    write_stage(p, "dense", 7, dense={"a.weight": bits}, refresh_lm_head=True)
    meta, t = read_stage(p)
    assert meta["version"] == "7" and meta["refresh_lm_head"] == "1"
    assert np.array_equal(
        t["a.weight"].view(__import__("torch").int16).numpy().view(np.uint16), bits
    )
    p2 = str(tmp_path / "sparse.safetensors")
    idx, val = np.array([1, 5], np.int64), np.array([0x3F80, 0xBF80], np.uint16)
    write_stage(p2, "sparse", 8, sparse={"a.weight": ((3, 4), idx, val)})
    meta, t = read_stage(p2)
    assert meta["kind"] == "sparse" and t["a.weight" + IDX].tolist() == [1, 5]
    assert t["a.weight" + VAL].float().tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="kind"):
        write_stage(p2, "sparse", 8, dense={"a": bits})


def test_config_from_env_reads_everything_and_hides_the_token():
    cfg = RolloutConfig.from_env(
        {
            "BUCKET": "hf://buckets/me/run",
            "MODEL": "Qwen/Qwen3-0.6B",
            "CONTROL_TOKEN": "s3cret",
            "POLL_INTERVAL_S": "0.5",
            "SPACE_ID": "me/rollout",
            "VLLM_EXTRA_ARGS": "--enforce-eager --max-num-seqs 4",
        }
    )
    assert cfg.bucket == "hf://buckets/me/run" and cfg.poll_interval_s == 0.5
    assert cfg.replica_id == "me--rollout" and cfg.port == 7860
    assert cfg.vllm_extra_args == ("--enforce-eager", "--max-num-seqs", "4")
    assert "s3cret" not in repr(cfg)
    with pytest.raises(ConfigError, match="bucket URI in BUCKET"):
        RolloutConfig.from_env({"MODEL": "m"})
    with pytest.raises(ConfigError, match="POLL_INTERVAL_S"):
        RolloutConfig.from_env({"BUCKET": "b", "MODEL": "m", "POLL_INTERVAL_S": "soon"})


def test_front_and_sync_loop_import_neither_torch_nor_vllm():
    import subprocess
    import sys

    from .conftest import SPACE_DIR

    code = (
        "import sys; import rollout.launch, rollout.server, rollout.sync_loop, rollout.extension; "
        "print('torch' in sys.modules, 'vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=SPACE_DIR, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False"]
