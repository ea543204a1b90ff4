"""Helpers of the LoRA replica tests: a trainer stand-in that publishes versions of a LoRA adapter
for the tiny model (PEFT keys, bf16), a PEFT folder written independently of the replica, and a
fake engine that loads adapter folders the way vLLM's runtime routes do."""

from __future__ import annotations

import json
import os

import numpy as np

from deltasync.adapter import base_digest_of_folder
from deltasync.bf16 import from_bf16_bits, to_bf16_bits
from deltasync.manifest import MANIFEST_PATH, AdapterInfo
from deltasync.publisher import DeltaPublisher, PublisherConfig
from rollout.engine import EngineControlError
from trainer.task.char_model import checkpoint_tensors

from .rollout_helpers import FakeEngine, perturb

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_shapes(model_dir: str, rank: int) -> dict[str, tuple[int, int]]:
    """{PEFT key: shape} of a rank-``rank`` adapter on every projection of the model in
    ``model_dir``: lora_A (r, in), lora_B (out, r)."""
    out = {}
    for name, t in sorted(checkpoint_tensors(model_dir).items()):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in TARGETS:
            continue
        fan_out, fan_in = t.shape
        key = f"base_model.model.{module}.lora_{{}}.weight"
        out[key.format("A")] = (rank, fan_in)
        out[key.format("B")] = (fan_out, rank)
    return out


def peft_config(rank: int, alpha: int, base: str) -> dict:
    """An ``adapter_config.json`` as PEFT writes it for a plain LoRA adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


class LoraTrainer:
    """Publishes versions of a LoRA adapter to a bucket, keeping the bits of every version.

    lora_A and lora_B start from N(0, ``scale``) (B not zero, so the adapter changes the model
    from v0 on); each later version multiplies ``frac`` of the elements of every tensor by
    (1 + N(0, 0.1)).

    Args:
        base_digest: the digest the manifest names (default: the model folder's own).
        publisher: ``PublisherConfig`` arguments.
    """

    def __init__(
        self,
        model_dir: str,
        bucket: str,
        rank: int = 8,
        seed: int = 0,
        base_digest: str | None = None,
        scale: float = 0.1,
        **publisher,
    ):
        import torch

        rng = np.random.default_rng(seed)
        self.bits = {
            n: to_bf16_bits(torch.from_numpy(rng.normal(0, scale, s).astype(np.float32))).copy()
            for n, s in lora_shapes(model_dir, rank).items()
        }
        self.rng = rng
        self.info = AdapterInfo(
            kind="lora",
            peft_config=peft_config(rank, 2 * rank, model_dir),
            base_model=model_dir,
            base_digest=base_digest or base_digest_of_folder(model_dir),
        )
        cfg = PublisherConfig(**{"anchor_replay_fraction": 1e9, **publisher})
        self.pub = DeltaPublisher(bucket, config=cfg, adapter=self.info)
        self.versions: dict[int, dict[str, np.ndarray]] = {}

    def publish(self, frac: float = 0.05) -> int:
        """Publish the next version (v0 as it is, later ones perturbed); returns its number."""
        if self.versions:
            perturb(self.bits, None, self.rng, frac)
        v = self.pub.publish(((n, a) for n, a in self.bits.items()), step=len(self.versions))
        self.pub.flush()
        self.versions[v] = {n: a.copy() for n, a in self.bits.items()}
        return v

    def save_folder(self, version: int, path: str) -> str:
        """Version ``version`` as a PEFT folder, written with safetensors' torch API (not the
        replica's writer)."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(self.info.peft_config, f)
        tensors = {n: from_bf16_bits(a).clone() for n, a in self.versions[version].items()}
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        return path

    def close(self) -> None:
        self.pub.close()


def read_folder_bits(path: str) -> dict[str, np.ndarray]:
    """{key: bf16 bits} of a PEFT folder's ``adapter_model.safetensors``."""
    from safetensors.torch import load_file

    return {
        n: to_bf16_bits(t).copy() for n, t in load_file(f"{path}/adapter_model.safetensors").items()
    }


def set_manifest_base(store_root: str, base_digest: str) -> bytes:
    """Rewrite the run's manifest so that its adapter names another base digest (a run root
    taken over by an adapter of another base model). Returns the manifest's old bytes."""
    path = os.path.join(store_root, MANIFEST_PATH)
    old = open(path, "rb").read()
    doc = json.loads(old)
    doc["adapter"]["base_digest"] = base_digest
    with open(path, "w") as f:
        json.dump(doc, f)
    return old


class FakeLoraEngine(FakeEngine):
    """A fake engine with vLLM's runtime LoRA routes: ``load_lora`` reads the folder (as vLLM
    checks it at load) and refuses a name loaded already; ``unload_lora`` refuses an unknown
    name. ``fail_load`` loads answer an error."""

    def __init__(self):
        super().__init__({})
        self.adapters: dict[str, dict[str, np.ndarray]] = {}
        self.paths: dict[str, str] = {}
        self.fail_load = 0
        self.calls: list[tuple[str, str]] = []

    def lora_adapters(self) -> list[str]:
        return list(self.adapters)

    def load_lora(self, name: str, path: str) -> None:
        self.calls.append(("load", name))
        if self.fail_load:
            self.fail_load -= 1
            raise EngineControlError("POST /v1/load_lora_adapter: expected 2xx, found 500")
        if name in self.adapters:
            raise EngineControlError(f"400: The lora adapter '{name}' has already been loaded")
        self.adapters[name] = read_folder_bits(path)
        self.paths[name] = path

    def unload_lora(self, name: str) -> None:
        self.calls.append(("unload", name))
        if name not in self.adapters:
            raise EngineControlError(f"404: The lora adapter '{name}' cannot be found")
        del self.adapters[name], self.paths[name]
