"""LoRA adapter runs on the trainer's side (trainer.loop.adapter, the transfer's adapter mode and
the TRL workarounds they need): the trainer's base digest equals the replica's view of the model
folder (tied and untied embeddings, fp32 and bf16 checkpoints); the transfer publishes only the
adapter's tensors, bit-exact (bf16) to the PEFT state dict, with the adapter in every manifest,
without reading TRL's merged stream; TRL's merge/unmerge round trip is kept from changing the
base; a wrong base or other LoRA settings are refused; the replica's environment."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deltasync.adapter import base_digest_of_folder
from deltasync.bf16 import to_bf16_bits
from deltasync.errors import AdapterMismatchError, ModelMismatchError, WrongBaseModelError
from deltasync.publisher import DeltaPublisher
from deltasync.subscriber import DeltaSubscriber, HeldWeights
from trainer.config import AdapterConfigError, AdapterSettings
from trainer.loop import adapter, trl_compat
from trainer.loop.bucket_transfer import BucketWeightTransfer
from trainer.loop.trained_weights import trained_weights


def base_folder(path, seed=0, tie=False, dtype=torch.float32) -> str:
    """A tiny Qwen3 checkpoint saved by transformers in ``dtype`` (the replica's MODEL folder)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tie,
    )
    Qwen3ForCausalLM(config).to(dtype).save_pretrained(str(path))
    return str(path)


def peft_model(folder: str, settings: AdapterSettings):
    """The model as TRL builds it for an adapter run: the checkpoint in fp32, wrapped by PEFT."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return get_peft_model(base, adapter.lora_config(settings))


def train_adapter(model, seed: int) -> None:
    """Stand-in for an optimizer step: move every adapter tensor (B starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def unread_stream():
    """TRL's merged stream; reading it fails the test (an adapter run must not copy the base)."""
    raise AssertionError("the transfer read TRL's stream of base weights")
    yield  # a generator: raises only when read


LORA = AdapterSettings(kind="lora", rank=4, alpha=8)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_base_digest_equals_the_replicas_view_of_the_folder(tmp_path, tie, dtype):
    folder = base_folder(tmp_path / "base", tie=tie, dtype=dtype)
    model = peft_model(folder, LORA)
    want = base_digest_of_folder(folder)  # what a replica serving the folder computes
    assert adapter.base_digest(model) == want
    info = adapter.adapter_info(LORA, folder)
    assert (info.kind, info.base_digest, info.base_model) == ("lora", want, "base")
    assert info.peft_config["r"] == 4 and info.peft_config["lora_alpha"] == 8
    assert info.peft_config["target_modules"] == sorted(LORA.modules())
    other = base_folder(tmp_path / "other", seed=1, tie=tie, dtype=dtype)
    assert adapter.base_digest(peft_model(other, LORA)) != want


@pytest.mark.parametrize("store", ["memory", "file"])
def test_transfer_publishes_only_the_adapter_bit_exact(tmp_path, store):
    from peft import get_peft_model_state_dict

    uri = f"memory://lora-{uuid.uuid4().hex[:8]}" if store == "memory" else str(tmp_path / "b")
    folder = base_folder(tmp_path / "base")
    model = peft_model(folder, LORA)
    info = adapter.adapter_info(LORA, folder)
    adapter.check_trainer_model(model, info)
    transfer = BucketWeightTransfer(
        DeltaPublisher(uri, run_id="lora", adapter=info),
        adapter_fn=lambda: adapter.adapter_tensors(model),
    )
    transfer.send_weights(unread_stream())  # v0: the initial adapter (B = 0)
    for step in range(1, 3):
        transfer.publisher.flush()  # one version per step (else they may coalesce)
        train_adapter(model, seed=step)
        transfer.send_weights(unread_stream())
    transfer.destroy()

    sub, held = DeltaSubscriber(uri), HeldWeights()
    sub.sync(held)
    manifest = sub.read_manifest()
    want = get_peft_model_state_dict(model)
    assert held.version == 2 and [v.version for v in manifest.versions] == [0, 1, 2]
    assert manifest.adapter == info
    assert set(held.tensors) == set(want)  # adapter keys only: no base weight in the bucket
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in held.tensors)
    for name, t in want.items():
        assert np.array_equal(held.tensors[name], to_bf16_bits(t)), name
    assert manifest.latest.digest == adapter.adapter_digest(model)


def test_a_restart_goes_on_from_the_newest_published_adapter(tmp_path):
    uri = str(tmp_path / "bucket")
    folder = base_folder(tmp_path / "base")
    info = adapter.adapter_info(LORA, folder)
    model = peft_model(folder, LORA)
    publisher = DeltaPublisher(uri, run_id="lora", adapter=info)
    assert adapter.restore_from_bucket(model, publisher) is None  # a new run: nothing to load
    transfer = BucketWeightTransfer(publisher, adapter_fn=lambda: adapter.adapter_tensors(model))
    for step in range(2):
        train_adapter(model, seed=step)
        transfer.send_weights(unread_stream())
        publisher.flush()
    transfer.destroy()

    again = peft_model(folder, LORA)  # the restarted trainer: a fresh adapter (B = 0)
    publisher = DeltaPublisher(uri, run_id="lora", adapter=info)
    assert adapter.restore_from_bucket(again, publisher) == 1
    restored = adapter.adapter_tensors(again)
    for name, t in adapter.adapter_tensors(model).items():
        assert torch.equal(to_bf16_bits_t(restored[name]), to_bf16_bits_t(t)), name
    fewer = peft_model(folder, AdapterSettings(kind="lora", target_modules="q_proj"))
    with pytest.raises(ModelMismatchError, match="different tensors"):
        adapter.restore_from_bucket(fewer, publisher)
    publisher.close()


def to_bf16_bits_t(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(to_bf16_bits(t).astype(np.int32))


def test_trl_merge_round_trip_no_longer_changes_the_base(tmp_path):
    folder = base_folder(tmp_path / "base")
    model = peft_model(folder, LORA)
    train_adapter(model, seed=1)
    x = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        want = model(input_ids=x).logits
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    other = peft_model(folder, LORA)  # without the patch: what TRL's merged sync does
    train_adapter(other, seed=1)
    other.merge_adapter()
    other.unmerge_adapter()
    drifted = sum(
        int((p != base[n]).sum()) for n, p in other.named_parameters() if "lora_" not in n
    )
    assert drifted > 0  # the rounding the patch avoids

    trl_compat.keep_adapter_unmerged(model)
    model.merge_adapter()
    model.unmerge_adapter()
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name]), name
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, want)  # the adapter still applies
    with pytest.raises(trl_compat.TRLCompatError, match="PeftModel"):
        trl_compat.keep_adapter_unmerged(torch.nn.Linear(2, 2))


def test_a_wrong_base_or_other_lora_settings_are_refused(tmp_path):
    folder = base_folder(tmp_path / "base")
    info = adapter.adapter_info(LORA, folder)
    other_base = peft_model(base_folder(tmp_path / "other", seed=1), LORA)
    with pytest.raises(WrongBaseModelError, match="base digest"):
        adapter.check_trainer_model(other_base, info)
    rank8 = peft_model(folder, AdapterSettings(kind="lora", rank=8, alpha=8))
    with pytest.raises(AdapterMismatchError, match="'r': 4"):
        adapter.check_trainer_model(rank8, info)
    with pytest.raises(AdapterMismatchError, match="full-weight"):
        adapter.check_trainer_model(peft_model(folder, LORA), None)


def test_the_rollout_worker_requests_the_adapter_name():
    """The name lands where TRL's worker builds its rollout loop from (checked against the
    loop's real signature), with no versioned LoRA suffix; a TRL that changed is refused."""
    kwargs = {"model_name": "/runs/cache/warm-start-1", "lora_name": "trl-policy"}
    trainer = SimpleNamespace(rollout_worker=SimpleNamespace(_loop_kwargs=kwargs))
    assert trl_compat.set_request_model(trainer, "policy")
    assert kwargs == {"model_name": "policy", "lora_name": None}
    assert not trl_compat.set_request_model(SimpleNamespace(rollout_worker=None), "policy")
    with pytest.raises(trl_compat.TRLCompatError, match="model_name"):
        trl_compat.set_request_model(SimpleNamespace(rollout_worker=SimpleNamespace()), "p")


@pytest.mark.parametrize("rank, max_rank", [(1, 1), (4, 8), (8, 8), (12, 16), (300, 320)])
def test_the_replica_gets_the_adapter_settings(rank, max_rank):
    lora = trained_weights(AdapterSettings(kind="lora", rank=rank, name="wordle"))
    env = {"ADAPTER": "lora", "ADAPTER_NAME": "wordle", "MAX_LORA_RANK": str(max_rank)}
    assert lora.replica_env() == env
    assert trained_weights(AdapterSettings()).replica_env() == {}  # full weights: as before


def test_adapter_runs_refuse_several_processes():
    with pytest.raises(AdapterConfigError, match="NPROC=1"):
        trained_weights(LORA).check_processes(world=2)
    trained_weights(LORA).check_processes(world=1)
    trained_weights(AdapterSettings()).check_processes(world=2)  # full weights: as before


def test_the_switch_is_one_object_the_run_asks(tmp_path):
    """Full weights and a LoRA adapter answer the same questions: what TRL wraps the model with,
    what the publisher records, what the replicas need, which name rollouts request and what the
    summary says; the adapter's record digests the base from its files (no model is built)."""
    full, lora = trained_weights(AdapterSettings()), trained_weights(LORA)
    assert (full.kind, full.served_name, full.peft_config()) == (None, None, None)
    assert full.publisher_info("any/model") is None
    assert full.summary() == {"adapter": None, "adapter_name": None, "replica_env": {}}
    assert (lora.kind, lora.served_name, lora.peft_config().r) == ("lora", "policy", 4)
    folder = base_folder(tmp_path / "base")
    info = lora.publisher_info(folder)
    assert info.base_digest == base_digest_of_folder(folder)
    assert info.peft_config["r"] == 4 and info.base_model == "base"
    assert lora.summary()["adapter_name"] == "policy"
