"""An adapter run followed end to end on ``file://`` and ``memory://``: a PEFT-shaped LoRA adapter
(rank 8 on every projection of a tiny two-layer model, lora_B starting at zero as PEFT makes it)
is published for several steps of small updates as anchors and bf16 deltas; a follower polling
after every version and a replica catching up at the end both hold the trainer's adapter bit for
bit, every manifest names the adapter, and the PEFT folder written from the held tensors loads
with the trainer's bits. Prints the bytes per adapter version and per changed element."""

import json
import os
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deltasync.adapter import base_digest_of, write_peft_folder
from deltasync.follow import Follower
from deltasync.manifest import AdapterInfo
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.subscriber import DeltaSubscriber, HeldWeights

RANK = 8
HIDDEN, KV, FFN, LAYERS = 64, 32, 128, 2
# target module -> (in_features, out_features), as in a Qwen3-style decoder layer
MODULES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, KV),
    "self_attn.v_proj": (HIDDEN, KV),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, FFN),
    "mlp.up_proj": (HIDDEN, FFN),
    "mlp.down_proj": (FFN, HIDDEN),
}


class LoraTrainer:
    """fp32 master weights of a LoRA adapter under PEFT's adapter_model.safetensors keys:
    lora_A (r, in) uniform like PEFT's kaiming init, lora_B (out, r) zeros; each step moves
    every element by ``lr`` times a random sign (an Adam-sized update)."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.master = {}
        for layer in range(LAYERS):
            for module, (fan_in, fan_out) in MODULES.items():
                key = f"base_model.model.model.layers.{layer}.{module}.lora_{{}}.weight"
                bound = 1 / np.sqrt(fan_in)
                a = self.rng.uniform(-bound, bound, (RANK, fan_in))
                self.master[key.format("A")] = a.astype(np.float32)
                self.master[key.format("B")] = np.zeros((fan_out, RANK), np.float32)

    def step(self, lr=1e-4):
        for n, w in self.master.items():
            self.master[n] = (w + lr * np.sign(self.rng.standard_normal(w.shape))).astype(
                np.float32
            )

    def bits(self) -> dict[str, np.ndarray]:
        return {
            n: torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            for n, w in self.master.items()
        }


def adapter_info() -> AdapterInfo:
    g = torch.Generator().manual_seed(3)
    base = {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(FFN, HIDDEN, generator=g)
        for i in range(2)
    }
    return AdapterInfo(
        kind="lora",
        peft_config={
            "peft_type": "LORA",
            "r": RANK,
            "lora_alpha": 16,
            "target_modules": sorted(m.split(".")[1] for m in MODULES),
            "bias": "none",
        },
        base_model="tiny-qwen3",
        base_digest=base_digest_of(base),
    )


@pytest.fixture(params=["memory", "file"])
def run_root(request, tmp_path):
    if request.param == "memory":
        return f"memory://adapter-follow-{uuid.uuid4().hex[:8]}"
    return "file://" + str(tmp_path / "bucket")


def same_bits(held: dict[str, np.ndarray], bits: dict[str, np.ndarray]) -> bool:
    return set(held) == set(bits) and all(np.array_equal(held[n], b) for n, b in bits.items())


def test_adapter_versions_follow_bit_exact(run_root, tmp_path):
    trainer, info = LoraTrainer(), adapter_info()
    cfg = PublisherConfig(anchor_every=4, keep_anchors=3, anchor_replay_fraction=1e9)
    follower = Follower(run_root)
    with DeltaPublisher(run_root, config=cfg, adapter=info) as pub:
        for step in range(10):
            if step:
                trainer.step()
            version = pub.publish(trainer.bits().items(), step=step)
            pub.flush()
            pulled = follower.poll()
            assert pulled.version == version and pulled.manifest.adapter == info
            assert pulled.kind == ("anchor" if step == 0 else "delta")
            assert same_bits(follower.held.tensors, trainer.bits()), f"v{version}"
        entries = pub.manifest.versions
    follower.close()
    # a replica that starts late replays from the newest anchor and lands on the same bits
    late, held = DeltaSubscriber(run_root), HeldWeights()
    steps = late.sync(held)
    assert [s.kind for s, _ in steps] == ["anchor", "delta"]  # anchor v8, delta v9
    assert held.version == 9 and same_bits(held.tensors, trainer.bits())
    assert late.read_manifest().adapter == info
    late.close()
    # the PEFT folder a replica loads holds the trainer's adapter bit for bit
    dst = write_peft_folder(held.tensors, info, str(tmp_path / "policy-v9"))
    loaded = load_file(os.path.join(dst, "adapter_model.safetensors"))
    final = trainer.bits()
    assert set(loaded) == set(final)
    for n, t in loaded.items():
        assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), final[n]), n
    with open(os.path.join(dst, "adapter_config.json")) as f:
        assert json.load(f)["r"] == RANK
    # the figures: bytes per adapter version, per changed element, against a full copy
    deltas = [v for v in entries if v.delta is not None]
    anchors = [v for v in entries if v.anchor is not None]
    assert [v.version for v in anchors] == [0, 4, 8] and len(deltas) == 9
    total = entries[0].total
    delta_bytes = sum(v.delta.bytes for v in deltas)
    changed = sum(v.changed for v in deltas)
    anchor_bytes = anchors[-1].anchor.bytes
    print(
        f"\nadapter {total} elements (rank {RANK}, {LAYERS} layers x {len(MODULES)} modules): "
        f"anchor {anchor_bytes} B; delta {delta_bytes / len(deltas):.0f} B/version, "
        f"density {changed / len(deltas) / total:.1%}, {delta_bytes / changed:.3f} B/changed"
    )
    assert changed > 0 and all(v.delta.bytes < anchor_bytes for v in deltas)
    assert delta_bytes / changed < 2.0  # less than the bf16 value each changed element replaces
