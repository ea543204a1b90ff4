"""Helpers of the rollout tests: a trainer stand-in that publishes perturbed versions of the tiny
model, payload corruption, a fake engine for tests without vLLM, and greedy generation."""

from __future__ import annotations

import os
import shutil

import httpx
import numpy as np

from deltasync.bf16 import from_bf16_bits, to_bf16_bits
from deltasync.publisher import DeltaPublisher, PublisherConfig
from rollout.apply_plan import DEFAULT_PACKED_MODULES
from rollout.engine import EngineControlError
from trainer.task.char_model import checkpoint_tensors

# Tensors changed in each delta version (None: all). Versions 1-2 touch one shard of a fused
# parameter only (q_proj, then k_proj; up_proj, then gate_proj), so a reload that forgot the
# other shards would leave garbage in them.
EDITS: list[list[str] | None] = [
    ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"],
    [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.norm.weight",
    ],
    [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ],
    None,
]


def perturb(bits: dict[str, np.ndarray], names, rng: np.random.Generator, frac=0.05) -> None:
    """Multiply a random ``frac`` of the elements of ``names`` by (1 + N(0, 0.1)), in bf16, in
    place (what a few large optimizer steps would do)."""
    import torch

    for n in names if names is not None else list(bits):
        if n not in bits:
            continue
        t = from_bf16_bits(bits[n]).float().reshape(-1)
        k = max(1, int(frac * t.numel()))
        idx = torch.from_numpy(rng.choice(t.numel(), k, replace=False))
        t[idx] *= 1 + 0.1 * torch.from_numpy(rng.standard_normal(k).astype(np.float32))
        bits[n] = to_bf16_bits(t.reshape(bits[n].shape)).copy()


class Trainer:
    """Publishes versions of the tiny model to a bucket, keeping the bits of every version."""

    def __init__(
        self, model_dir: str, bucket: str, anchor_every: int = 100, seed: int = 0, signer=None
    ):
        self.model_dir = model_dir
        self.bits = {n: to_bf16_bits(t).copy() for n, t in checkpoint_tensors(model_dir).items()}
        cfg = PublisherConfig(anchor_every=anchor_every)
        self.pub = DeltaPublisher(bucket, config=cfg, signer=signer)
        self.rng = np.random.default_rng(seed)
        self.versions: dict[int, dict[str, np.ndarray]] = {}

    def publish(self, names=None, perturb_first: bool = True) -> int:
        if perturb_first and self.versions:
            perturb(self.bits, names, self.rng)
        v = self.pub.publish(((n, a) for n, a in self.bits.items()), step=len(self.versions))
        self.pub.flush()
        self.versions[v] = {n: a.copy() for n, a in self.bits.items()}
        return v

    def publish_many(self, k: int) -> int:
        """Publish v0 (if not yet) and ``k`` deltas following EDITS; returns the newest version."""
        if not self.versions:
            self.publish()
        v = max(self.versions)
        for _ in range(k):
            v = self.publish(EDITS[(len(self.versions) - 1) % len(EDITS)])
        return v

    def save_checkpoint(self, version: int, path: str) -> str:
        """The bf16 checkpoint of ``version`` as a model folder (config and tokenizer copied)."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        for fn in os.listdir(self.model_dir):
            if not fn.endswith(".safetensors"):
                shutil.copy(os.path.join(self.model_dir, fn), path)
        tensors = {n: from_bf16_bits(a).clone() for n, a in self.versions[version].items()}
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path

    def close(self) -> None:
        self.pub.close()


def corrupt_payload(store_root: str, rel_path: str, offset_from_end: int = 20) -> None:
    """Flip bytes near the end of a committed payload file (inside the data, not the header)."""
    p = os.path.join(store_root, rel_path)
    data = bytearray(open(p, "rb").read())
    for i in range(1, 9):
        data[-offset_from_end - i] ^= 0xFF
    with open(p, "wb") as f:
        f.write(bytes(data))


class FakeEngine:
    """An engine that keeps the served weights as bf16 bits in a dict and applies staging files
    the way the worker extension does (dense reload or sparse patches, fused shards checked)."""

    def __init__(self, names_shapes: dict[str, tuple], device="cpu", tied=False):
        self.weights = {n: np.zeros(s, np.uint16) for n, s in names_shapes.items()}
        self.device, self.tied = device, tied
        self.paused = False
        self.version: str | None = None
        self.applies: list[tuple[str, list[str]]] = []
        self.fail_next = 0
        self.fail_pause = 0  # pauses that answer an error (nothing applied)
        self.fail_set_version = 0  # version records that answer an error (weights applied)
        self.fail_resume = 0  # resumes that answer an error (still paused)
        self.fail_reset = 0  # prefix cache resets that answer an error
        self.readbacks = 0  # full-weights checks read
        self.pauses = 0

    def describe(self) -> dict:
        return {
            "device": self.device,
            "dtype": "torch.bfloat16",
            "quantization": None,
            "moe": False,
            "tie_word_embeddings": self.tied,
            "packed_modules_mapping": DEFAULT_PACKED_MODULES,
            "architecture": "Fake",
        }

    def apply(self, path: str, mode: str) -> list[dict]:
        import json

        from rollout.staging import IDX, VAL
        from rollout.worker_apply import check_fused_complete, read_stage

        meta, tensors = read_stage(path)
        if self.fail_next:
            self.fail_next -= 1
            name = next(iter(self.weights))
            self.weights[name] = self.weights[name] ^ np.uint16(1)  # half-applied garbage
            raise EngineControlError("POST /collective_rpc: expected 2xx, found 500: injected")
        if mode == "reload":
            check_fused_complete(list(tensors), DEFAULT_PACKED_MODULES)
            for n, t in tensors.items():
                self.weights[n] = to_bf16_bits(t).copy()
        else:
            for n in json.loads(meta["shapes"]):
                flat = self.weights[n].reshape(-1)
                flat[tensors[n + IDX].numpy()] = to_bf16_bits(tensors[n + VAL])
        self.applies.append((mode, sorted(tensors)))
        return [{"version": int(meta["version"])}]

    def pause(self, mode: str = "keep") -> None:
        if self.fail_pause:
            self.fail_pause -= 1
            raise EngineControlError("POST /pause: expected 2xx, found 503: injected")
        self.paused = True
        self.pauses += 1

    def resume(self) -> None:
        if self.fail_resume:
            self.fail_resume -= 1
            raise EngineControlError("POST /resume: expected 2xx, found 500: injected")
        self.paused = False

    def set_version(self, version: int) -> None:
        if self.fail_set_version:
            self.fail_set_version -= 1
            raise EngineControlError("POST /update_weight_version: expected 2xx: injected")
        self.version = str(version)

    def served_digests(self) -> dict[str, str]:
        from deltasync.bf16 import digest

        self.readbacks += 1
        return {n: digest(a) for n, a in self.weights.items()}

    def reset_prefix_cache(self) -> bool:
        if self.fail_reset:
            self.fail_reset -= 1
            raise EngineControlError("POST /reset_prefix_cache: expected 2xx: injected")
        return True


def generate(url: str, model: str, prompts: list[str], max_tokens: int = 12) -> list:
    """Greedy completions: per prompt, (token strings, token logprobs, top-5 logprobs)."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for p in prompts:
            r = c.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "logprobs": 5,
                    "prompt_logprobs": 1,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            ch = r.json()["choices"][0]
            lp = ch["logprobs"]
            out.append(
                (lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], ch.get("prompt_logprobs"))
            )
    return out


PROMPTS = ["Hello, world", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "abcdefg"]
