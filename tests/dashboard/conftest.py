"""Fixtures of the dashboard tests: a bucket recorded with the real publisher and subscriber.

``RunRecorder`` publishes small random bf16 models (np.uint16 bits) with the real
``DeltaPublisher``, follows them with real ``Follower``s (``deltasync.follow``: one per simulated
replica, apply path "cpu-dict": verified patches are applied to a separate serving dict inside the
"pause"), writes each replica's ``ReplicaHeartbeat`` with its ``SyncRecord``s, and the trainer's
``TrainerMetrics`` (its steps, and an evaluation every 4 steps). ``recorded_bucket`` is a finished
recording; ``run_recorder`` hands out the class for tests that record while the dashboard runs.

With ``adapter`` (an ``AdapterInfo``: ``lora_adapter``) the recording is an adapter run: the
publisher records the adapter in every manifest, the tensors are PEFT ``adapter_model.safetensors``
keys (``ADAPTER_SHAPES``), and the replicas report as LoRA replicas do (apply path "lora",
``paused_s`` 0, ``apply_s`` the load). ``adapter_bucket`` is such a finished recording, its base
model named by a local path (``BASE_DIR`` under the test's tmp folder) that public pages must not
show.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from deltasync.adapter import base_digest_of
from deltasync.follow import Follower
from deltasync.manifest import AdapterInfo
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.status import (
    TRAINER_METRICS_PATH,
    EvalResult,
    ReplicaHeartbeat,
    StepMetrics,
    TrainerMetrics,
    lag_s,
    lag_versions,
    write_heartbeat,
)
from deltasync.store import Store
from deltasync.subscriber import apply_patches

SHAPES = {
    "model.embed.weight": (64, 16),
    "model.layer0.mlp.weight": (32, 32),
    "lm_head.bias": (48,),
}
# An adapter run's tensors: rank-4 LoRA on two projections of a one-layer model, under the keys of
# PEFT's adapter_model.safetensors (lora_A: (r, in), lora_B: (out, r)).
LORA_RANK = 4
ADAPTER_SHAPES = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (LORA_RANK, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (32, LORA_RANK),
    "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": (LORA_RANK, 32),
    "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": (64, LORA_RANK),
}
BASE_DIR = "models/qwen3-base"  # under tmp_path: the base model's local folder in adapter_bucket


def lora_adapter(base_model: str) -> AdapterInfo:
    """The ``AdapterInfo`` of an adapter run on a small random base model named ``base_model``
    (its PEFT config names the base too, as PEFT writes ``base_model_name_or_path``)."""
    rng = np.random.default_rng(7)
    base = {
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((32, 32), np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((64, 32), np.float32),
    }
    return AdapterInfo(
        kind="lora",
        peft_config={
            "peft_type": "LORA",
            "r": LORA_RANK,
            "lora_alpha": 8,
            "target_modules": ["q_proj", "up_proj"],
            "base_model_name_or_path": base_model,
        },
        base_model=base_model,
        base_digest=base_digest_of(base),
    )


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (np.uint16) by truncation."""
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@dataclass
class _Replica:
    replica_id: str
    every: int  # syncs after every ``every``-th version
    follower: Follower
    serving: dict  # the "engine" weights: np.uint16 bits, updated inside the pause
    heartbeat: ReplicaHeartbeat


class RunRecorder:
    """Records a run into ``uri``: call :meth:`step` once per trainer step, then :meth:`close`.

    Args:
        uri: the bucket (run root).
        replicas: {replica_id: sync every N versions} (N > 1 makes that replica lag and chain).
        anchor_every: the publisher's anchor interval (small, so anchors appear).
        density: fraction of elements changed per step.
        seed: numpy seed of the weights, changes, rewards and staleness.
        adapter: record an adapter run of this adapter (``ADAPTER_SHAPES``, LoRA replicas).
        run_id: the run's id.
    """

    def __init__(
        self,
        uri: str,
        replicas: dict[str, int] | None = None,
        anchor_every: int = 3,
        density: float = 0.05,
        seed: int = 0,
        adapter: AdapterInfo | None = None,
        run_id: str = "dash-test",
    ):
        self.store = Store(uri)
        self.rng = np.random.default_rng(seed)
        self.density = density
        self.adapter = adapter
        shapes = SHAPES if adapter is None else ADAPTER_SHAPES
        self.weights = {
            n: _bf16_bits(self.rng.standard_normal(s).astype(np.float32)) for n, s in shapes.items()
        }
        self.publisher = DeltaPublisher(
            self.store,
            run_id=run_id,
            config=PublisherConfig(anchor_every=anchor_every, keep_anchors=100, encode_threads=1),
            adapter=adapter,
        )
        self.apply_path = "cpu-dict" if adapter is None else "lora"
        self.replicas = {
            rid: _Replica(
                rid,
                every,
                Follower(self.store, fetch_threads=1),
                {},
                ReplicaHeartbeat.empty(rid, apply_path=self.apply_path),
            )
            for rid, every in (replicas or {"r0": 1, "r1": 2}).items()
        }
        self.metrics = TrainerMetrics(run_id=run_id)
        self.steps = 0
        for r in self.replicas.values():
            write_heartbeat(self.store, r.heartbeat)

    def step(self) -> int:
        """One trainer step: change the weights, publish and commit, sync due replicas, write
        heartbeats and metrics. Returns the version published."""
        if self.steps:
            for bits in self.weights.values():
                flat = bits.reshape(-1)
                idx = self.rng.choice(flat.size, max(1, int(self.density * flat.size)), False)
                flat[idx] = _bf16_bits(self.rng.standard_normal(idx.size).astype(np.float32))
        version = self.publisher.publish(self.weights.items(), step=self.steps)
        self.publisher.flush(timeout=30)
        entry = self.publisher.manifest.entry(version)
        self.steps += 1
        for r in self.replicas.values():
            if version % r.every == 0:
                self._sync(r)
            self._beat(r)
        staleness = {str(k): int(self.rng.integers(0, 5)) for k in range(3)}
        staleness["0"] += 1
        self.metrics.steps.append(
            StepMetrics(
                step=entry.step,
                version=version,
                time=entry.created_at,
                reward=float(self.rng.uniform(0, 1)),
                loss=float(self.rng.uniform(0, 2)),
                staleness=staleness,
                diff_s=entry.timings_s.get("diff_s"),
                encode_s=entry.timings_s.get("encode_s"),
                upload_s=entry.timings_s.get("write_upload_s"),
                bytes=(entry.delta.bytes if entry.delta else 0)
                + (entry.anchor.bytes if entry.anchor else 0),
                density=entry.density,
                consistent_rate=float(self.rng.uniform(0, 1)),
                games=int(self.rng.integers(1, 9)),
            )
        )
        if entry.step % 4 == 0:  # a learning-curve point
            self.metrics.evals.append(self._eval(entry.step, version))
        self.metrics.updated_at = time.time()
        self.store.write_bytes(TRAINER_METRICS_PATH, self.metrics.model_dump_json().encode())
        return version

    def _eval(self, step: int, version: int) -> EvalResult:
        """An evaluation at ``step`` with random rates (label "before" at step 0)."""

        def rate() -> float:
            return round(float(self.rng.uniform(0, 1)), 4)

        return EvalResult(
            label="before" if step == 0 else f"step-{step}",
            step=step,
            version=version,
            episodes=16,
            wellformed_rate=rate(),
            valid_guess_rate=rate(),
            reward_mean=rate(),
            reward_se=0.05,
            win_rate=rate(),
            guesses_mean=5.0,
            consistent_rate=rate(),
            invalid_rate=rate(),
            stopped_early_rate=rate(),
        )

    def _sync(self, r: _Replica) -> None:
        pulled = r.follower.poll()
        if pulled is None:
            return
        apply_s = 0.0
        t_pause = time.perf_counter()
        for patches in pulled.applied:  # the pause (cpu-dict) or the adapter load (lora)
            t0 = time.perf_counter()
            apply_patches(r.serving, patches)
            apply_s += time.perf_counter() - t0
        # a LoRA replica loads the new adapter beside the old one: generation never pauses
        paused_s = time.perf_counter() - t_pause if self.adapter is None else 0.0
        r.heartbeat.recent.append(pulled.record(paused_s, apply_s, self.apply_path))

    def _beat(self, r: _Replica) -> None:
        latest = r.follower.subscriber.read_manifest().latest
        hb, held = r.heartbeat, r.follower.held.version
        hb.held_version = held
        hb.newest_seen = latest.version
        hb.lag_versions = lag_versions(latest.version, held)
        hb.lag_s = lag_s(latest.created_at if hb.lag_versions else None)
        hb.status = "ok"
        hb.updated_at = time.time()
        write_heartbeat(self.store, hb)

    def close(self) -> None:
        """Close the publisher (releases its lease) and the subscribers."""
        self.publisher.close()
        for r in self.replicas.values():
            r.follower.close()


@pytest.fixture
def run_recorder() -> type[RunRecorder]:
    """The RunRecorder class (for tests that record while something reads)."""
    return RunRecorder


@pytest.fixture
def recorded_bucket(tmp_path) -> Iterator[tuple[str, RunRecorder]]:
    """A finished recording: 8 versions (anchors every 3), replicas r0 (every version) and r1
    (every 2nd version, so it lags one version at odd versions), evaluations at steps 0 and 4.
    Yields (uri, recorder)."""
    uri = str(tmp_path / "bucket")
    rec = RunRecorder(uri)
    for _ in range(8):
        rec.step()
    rec.close()
    yield uri, rec


@pytest.fixture
def adapter_bucket(tmp_path) -> Iterator[tuple[str, RunRecorder]]:
    """A finished adapter run: 6 adapter versions (anchors every 3) of ``lora_adapter`` on a base
    model named by its local folder (``tmp_path / BASE_DIR``), replicas r0 (every version) and r1
    (every 2nd). Yields (uri, recorder)."""
    uri = str(tmp_path / "adapter-bucket")
    rec = RunRecorder(uri, adapter=lora_adapter(str(tmp_path / BASE_DIR)), run_id="dash-lora")
    for _ in range(6):
        rec.step()
    rec.close()
    yield uri, rec


def number_guess_metrics(run_id: str, versions: list[int], seed: int = 0) -> TrainerMetrics:
    """The trainer's metrics of a run of the number-guess example task (``examples/number_guess``)
    over ``versions`` (version v is step v): its declared figures (``Task.figures``), each step's
    figures made by its own ``step_figures`` from the ``episode_counts`` of 8 games played by its
    local model's teacher (``teacher_game``), and evaluations of 16 such games at step 0
    ("before") and at the last step ("after"), their blocks made by the generic evaluation's
    ``tool_block`` with the task's ``eval_figures``; as the trainer records them."""
    import random
    from types import SimpleNamespace

    from examples.number_guess.local_model import LocalModelConfig, teacher_game
    from examples.number_guess.task import TASK
    from trainer.task.tool_eval import tool_block

    rng = random.Random(seed)

    def games(n: int, binary_search: float) -> list[list[dict]]:
        cfg = LocalModelConfig(binary_search=binary_search)
        return [teacher_game(rng, cfg)[2:] for _ in range(n)]  # the messages after the prompt

    def counts(played: list[list[dict]]) -> dict[str, int]:
        total: dict[str, int] = {}
        for messages in played:
            for k, v in TASK.episode_counts(messages).items():
                total[k] = total.get(k, 0) + v
        return total

    def evaluation(label: str, step: int, binary_search: float) -> EvalResult:
        played = games(16, binary_search)
        episodes = [
            SimpleNamespace(
                messages=m,
                reward=1.0 if TASK.episode_counts(m)["solved"] else rng.uniform(0, 0.5),
                turns=sum(x["role"] == "assistant" for x in m),
                calls=sum(x["role"] == "tool" for x in m),
                tool_errors=0,
            )
            for m in played
        ]
        block = tool_block(episodes, TASK.eval_figures(episodes))
        own = ("episodes", "reward_mean", "reward_se")
        figures = {k: v for k, v in block.items() if k not in own and v is not None}
        return EvalResult(
            label=label, step=step, version=step, figures=figures, **{k: block[k] for k in own}
        )

    metrics = TrainerMetrics(run_id=run_id, figures=list(TASK.figures))
    for v in versions[1:]:
        played = games(8, binary_search=v / len(versions))  # it learns binary search
        metrics.steps.append(
            StepMetrics(
                step=v,
                version=v,
                time=time.time(),
                reward=round(rng.uniform(0.3, 0.8), 4),
                games=len(played),
                figures={
                    k: x
                    for k, x in TASK.step_figures(counts(played), len(played)).items()
                    if x is not None
                },
            )
        )
    metrics.evals = [evaluation("before", 0, 0.2), evaluation("after", versions[-1], 0.8)]
    metrics.updated_at = time.time()
    return metrics


@pytest.fixture
def number_guess_bucket(tmp_path) -> Iterator[tuple[str, TrainerMetrics]]:
    """A finished recording (6 versions, replicas r0 and r1) of a number-guess run: its weights
    published as in ``recorded_bucket``, its metrics :func:`number_guess_metrics`. Yields (uri,
    metrics)."""
    uri = str(tmp_path / "number-guess-bucket")
    rec = RunRecorder(uri, run_id="number-guess")
    for _ in range(6):
        rec.step()
    rec.close()
    metrics = number_guess_metrics("number-guess", list(range(6)))
    Store(uri).write_bytes(TRAINER_METRICS_PATH, metrics.model_dump_json().encode())
    yield uri, metrics
