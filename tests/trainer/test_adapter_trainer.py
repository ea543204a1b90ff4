"""An adapter run's trainer as ``trainer.loop.grpo.build_trainer`` builds it (TRL's
AsyncGRPOTrainer with ``peft_config``, our bucket transfer injected), driven through TRL's own
weight sync without training: v0 is the initial adapter, later syncs publish the trained adapter
bit-exact, the frozen base stays bit-identical through TRL's sync, the manifest records the
adapter, and the rollout worker requests the adapter's stable name."""

from __future__ import annotations

import numpy as np
import torch

from deltasync.bf16 import to_bf16_bits
from deltasync.publisher import DeltaPublisher
from deltasync.subscriber import DeltaSubscriber, HeldWeights
from trainer.config import TrainConfig
from trainer.loop import adapter, trl_compat
from trainer.loop.grpo import Serving, build_trainer
from trainer.loop.rollouts import Rollouts
from trainer.loop.trained_weights import trained_weights


def wordle_folder(path) -> str:
    """A small untrained Wordle model with its tokenizer and chat template (no warm start)."""
    from trainer.task.wordle import model as wordle_model

    corpus = ["<|im_start|>user\nGuess the word.<|im_end|>\n<|im_start|>assistant\ncrane"] * 4
    tokenizer = wordle_model.build_tokenizer(corpus)
    model = wordle_model.build_model(tokenizer, hidden_size=64, layers=1, init="random")
    return wordle_model.save(model, tokenizer, str(path))


def test_trls_sync_publishes_the_adapter_and_leaves_the_base(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trl_compat.apply()
    folder = wordle_folder(tmp_path / "model")
    cfg = TrainConfig.from_flags(
        adapter="lora",
        lora_rank=4,
        adapter_name="wordle",
        runs_root=str(tmp_path / "runs"),
        max_steps=2,
        per_device_train_batch_size=8,
    )
    uri = str(tmp_path / "bucket")
    info = adapter.adapter_info(cfg.adapter, folder)
    publisher = DeltaPublisher(uri, run_id="lora", adapter=info)
    first = []
    weights = trained_weights(cfg.adapter)
    rollouts = Rollouts(
        "http://127.0.0.1:9",  # never contacted: no rollout in this test
        publisher,
        served_version=lambda: 10**6,
    )
    trainer, transfer, tagger = build_trainer(
        cfg.grpo, cfg.run, weights, folder, cfg.task(), Serving(rollouts, first.append)
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}

    trainer._sync_weight()  # what TRL runs at train begin: v0, the initial adapter
    with torch.no_grad():  # stand-in for a step: B leaves zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.05)
    publisher.flush()
    trainer._sync_weight()  # the merged path TRL takes with an injected transfer: v1
    transfer.destroy()

    assert first == [0] and transfer.last_version == 1
    assert tagger.inner._loop_kwargs["model_name"] == "wordle"  # the replica's stable name
    assert tagger.inner._loop_kwargs["lora_name"] is None
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name]), name  # no merge/unmerge rounding
    held, sub = HeldWeights(), DeltaSubscriber(uri)
    sub.sync(held)
    manifest = sub.read_manifest()
    assert manifest.adapter == info and held.version == 1
    want = adapter.adapter_tensors(model)
    assert set(held.tensors) == set(want) and all(".lora_" in n for n in want)
    for name, t in want.items():
        assert np.array_equal(held.tensors[name], to_bf16_bits(t)), name
    assert manifest.latest.digest == adapter.adapter_digest(model)
