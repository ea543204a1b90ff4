"""Fixtures for the core tests: small random models as bf16 bits and bucket stores."""

import uuid

import numpy as np
import pytest

from deltasync.bf16 import from_order_key, order_key


class TinyTrainer:
    """A fake model: a few named float32 master tensors, stepped by small updates and exposed as
    bf16 bits (np.uint16), like a trainer's bf16 view of fp32 master weights."""

    def __init__(self, seed=0, shapes=None):
        self.rng = np.random.default_rng(seed)
        shapes = shapes or {"embed.weight": (64, 32), "layer.0.q.weight": (32, 32), "norm": (32,)}
        self.master = {
            n: (self.rng.standard_normal(s) * (0.02 if len(s) > 1 else 1.0)).astype(np.float32)
            for n, s in shapes.items()
        }

    def step(self, lr=3e-4):
        for n, w in self.master.items():
            self.master[n] = (w + lr * self.rng.standard_normal(w.shape)).astype(np.float32)

    def bits(self) -> dict[str, np.ndarray]:
        out = {}
        for n, w in self.master.items():
            u = np.asarray(w, np.float32).view(np.uint32)
            # round to nearest even bf16
            out[n] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return out

    def named(self):
        return list(self.bits().items())


@pytest.fixture
def trainer():
    return TinyTrainer()


@pytest.fixture(params=["memory", "file"])
def bucket(request, tmp_path):
    if request.param == "memory":
        return f"memory://deltasync-test-{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "bucket")


def ulp_step(bits: np.ndarray, k: int = 1) -> np.ndarray:
    return from_order_key((order_key(bits).astype(np.int64) + k).astype(np.uint16))
