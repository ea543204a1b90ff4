"""The training job: TRL's AsyncGRPOTrainer on Wordle, publishing every update to the bucket.

``python -m trainer`` (or ``make train``). The local default creates a tiny model, starts the
Wordle Space and a vLLM replica as children, trains for ``max_steps`` steps, and prints a summary.
Restart: a run whose bucket already holds versions resumes from the newest one (the model weights
are rebuilt from the bucket's newest anchor and deltas; the optimizer state starts fresh) and
continues the version sequence with an anchor.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass

from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.status import read_heartbeats
from deltasync.store import Store

from . import local_stack, trl_compat
from .bucket_transfer import BucketWeightTransfer
from .config import TINY, TrainConfig
from .metrics import BucketMetricsCallback
from .rollout_tagging import ReplicaVersionTagger
from .wordle_task import ENV_URL_VAR, WordleToolEnv, format_reward, make_dataset

log = logging.getLogger("trainer")


def prepare_model(cfg: TrainConfig, store: Store) -> str:
    """The model folder TRL loads: the configured one, or for a run that already has versions,
    a copy whose weights are the bucket's newest version (restart)."""
    from deltasync.subscriber import DeltaSubscriber, HeldWeights

    model = cfg.model_id()
    if model == TINY:
        from deltasync.tiny_model import make_tiny_qwen3

        model = os.path.abspath(os.path.join(cfg.run_dir, "model"))
        if not os.path.exists(os.path.join(model, "config.json")):
            make_tiny_qwen3(model, seed=cfg.seed)
    sub = DeltaSubscriber(store)
    manifest = sub.read_manifest()
    if manifest is None or manifest.latest is None:
        return model
    held = HeldWeights()
    sub.sync(held)
    sub.close()
    resume = os.path.abspath(os.path.join(cfg.run_dir, "resume"))
    _write_checkpoint(model, held, resume)
    log.info("resuming run %s from bucket version %d (%s)", cfg.run_id, held.version, resume)
    return resume


def _write_checkpoint(src: str, held, dst: str) -> None:
    """Copy a model folder's config/tokenizer to ``dst`` with the held weights as safetensors."""
    from huggingface_hub import snapshot_download
    from safetensors.torch import save_file

    if not os.path.isdir(src):
        src = snapshot_download(src, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja"])
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    for fn in os.listdir(src):
        if not fn.endswith(".safetensors") and not fn.endswith(".index.json"):
            p = os.path.join(src, fn)
            if os.path.isfile(p):
                shutil.copy(p, dst)
    save_file({n: t.contiguous() for n, t in held.to_torch().items()}, f"{dst}/model.safetensors")


def build_trainer(cfg: TrainConfig, model_path: str, publisher, replica_version_fn):
    """AsyncGRPOTrainer with the bucket weight transfer and truthful staleness tagging."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        output_dir=cfg.output_dir or os.path.join(cfg.run_dir, "trainer"),
        max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate,
        num_generations=cfg.num_generations,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        max_completion_length=cfg.max_completion_length,
        max_tool_calling_iterations=cfg.max_tool_calling_iterations,
        max_staleness=cfg.max_staleness,
        token_budget=cfg.token_budget,
        weight_sync_steps=cfg.weight_sync_steps,
        vllm_server_base_url=cfg.vllm_url,
        dtype="bfloat16" if cfg.bf16 else "float32",
        bf16=cfg.bf16,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=cfg.seed,
        log_completions=False,
    )
    n_rows = max(64, cfg.max_steps * cfg.per_device_train_batch_size)
    state = {}
    transfer = BucketWeightTransfer(
        publisher,
        step_fn=lambda: state["trainer"].state.global_step if "trainer" in state else 0,
        first_apply_fn=lambda v: _wait_replica(replica_version_fn, v),
    )
    trainer = AsyncGRPOTrainer(
        model=model_path,
        reward_funcs=[format_reward],
        args=args,
        train_dataset=make_dataset(n_rows, cfg.seed),
        environment_factory=WordleToolEnv,
        weight_transfer=transfer,
    )
    state["trainer"] = trainer
    tagger = trl_compat.wrap_rollout_worker(
        trainer,
        lambda inner: ReplicaVersionTagger(
            inner, lambda: transfer.last_version, replica_version_fn
        ),
    )
    return trainer, transfer, tagger


def _wait_replica(version_fn, version: int, timeout_s: float = 600.0) -> None:
    """Block until the replica serves ``version`` (the first publish only, so that the first
    rollouts are not refused by a replica that has not loaded the run's weights yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = version_fn()
        if v is not None and v >= version:
            return
        time.sleep(0.25)
    raise TimeoutError(f"the replica did not apply v{version} within {timeout_s:.0f}s")


@dataclass
class RunContext:
    """What hooks of :func:`run` can use: the config, the bucket, the model folder, the log folder,
    the publisher, and the children (anything appended is stopped at the end)."""

    cfg: TrainConfig
    store: Store
    store_uri: str
    model_path: str
    logs_dir: str
    children: list
    publisher: DeltaPublisher | None = None


def run(cfg: TrainConfig, callbacks=(), publisher_hook=None, before_stop=None) -> dict:
    """Train; returns the summary (also printed and written to ``runs/<run_id>/summary.json``).

    Args:
        cfg: the configuration.
        callbacks: factories ``f(ctx: RunContext) -> transformers.TrainerCallback`` (e.g. the
            fault injection of ``trainer.e2e``).
        publisher_hook: ``f(ctx)`` called once the publisher exists.
        before_stop: ``f(ctx, summary)`` called after training, before the children stop; it may
            add to the summary.
    """
    trl_compat.apply()
    os.makedirs(cfg.run_dir, exist_ok=True)
    store_uri = cfg.store_uri()
    storage = {"token": cfg.hf_token} if store_uri.startswith("hf://") and cfg.hf_token else {}
    store = Store(store_uri, **storage)
    children: list[local_stack.Child] = []
    logs_dir = os.path.join(cfg.run_dir, "logs")
    t_start = time.time()
    try:
        model_path = prepare_model(cfg, store)
        env_url = cfg.env_url
        if env_url is None:
            wordle = local_stack.start_wordle(logs_dir)
            children.append(wordle)
            env_url = wordle.url
        os.environ[ENV_URL_VAR] = env_url  # read by WordleToolEnv in TRL's rollout process
        publisher = DeltaPublisher(
            store,
            run_id=cfg.run_id,
            config=PublisherConfig(
                anchor_every=cfg.anchor_every, keep_anchors=cfg.keep_anchors, takeover=cfg.takeover
            ),
        )
        if cfg.vllm_url is None:
            replica = local_stack.start_replica(store_uri, model_path, logs_dir)
            children.append(replica)
            cfg.vllm_url = replica.url
        if cfg.dashboard and cfg.local:
            children.append(local_stack.start_dashboard(store_uri, cfg.dashboard_port, logs_dir))
            log.info("dashboard: http://127.0.0.1:%d", cfg.dashboard_port)
        ctx = RunContext(cfg, store, store_uri, model_path, logs_dir, children, publisher)
        if publisher_hook is not None:
            publisher_hook(ctx)
        for child in children:
            child.wait_healthy(900)
        replica_url = cfg.vllm_url

        def replica_version():
            return local_stack.held_version(replica_url)

        trainer, transfer, tagger = build_trainer(cfg, model_path, publisher, replica_version)
        trainer.add_callback(BucketMetricsCallback(store, cfg.run_id, publisher, tagger))
        for make_callback in callbacks:
            trainer.add_callback(make_callback(ctx))
        try:
            trainer.train()
        finally:
            publisher.close()  # idempotent with TRL's destroy(): flush the last publish
        if cfg.vllm_url and children:  # local replica: let it apply the last version
            _wait_replica(replica_version, publisher.published[-1].version, timeout_s=120)
        summary = _summary(cfg, store, publisher, tagger, replica_version, t_start)
        summary["trainer_model_digest"] = _model_digest(trainer.model)
        if before_stop is not None:
            before_stop(ctx, summary)
    finally:
        for child in reversed(children):
            child.stop()
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _summary(cfg, store, publisher, tagger, replica_version_fn, t_start) -> dict:
    from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics

    entries = publisher.published
    deltas = [e for e in entries if e.delta is not None]
    metrics = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    rewards = [s.reward for s in metrics.steps if s.reward is not None]
    try:
        rv = replica_version_fn()
    except Exception as e:  # the replica may already be gone; the summary says so
        rv = f"unreachable ({type(e).__name__})"
    hb = {k: h.model_dump(include={"held_version", "lag_versions", "lag_s", "errors"})
          for k, h in read_heartbeats(store).items()}  # fmt: skip
    return {
        "run_id": cfg.run_id,
        "bucket": cfg.store_uri(),
        "steps": metrics.steps[-1].step if metrics.steps else 0,
        "wall_s": round(time.time() - t_start, 1),
        "reward_first5": _mean(rewards[:5]),
        "reward_last5": _mean(rewards[-5:]),
        "versions_published": [e.version for e in entries],
        "anchors": [e.version for e in entries if e.anchor is not None],
        "delta_bytes_mean": _mean([e.delta.bytes for e in deltas]),
        "bytes_per_changed_mean": _mean([e.delta.bytes / e.changed for e in deltas if e.changed]),
        "density_mean": _mean([e.density for e in deltas]),
        "final_version": entries[-1].version if entries else None,
        "final_version_digest": entries[-1].digest if entries else None,
        "replica_version": rv,
        "replicas": hb,
        "staleness": dict(sorted(tagger.staleness.items())) if tagger else {},
        "staleness_dropped": sum(n for s, n in tagger.staleness.items() if s > cfg.max_staleness)
        if tagger
        else 0,
    }


def _model_digest(model) -> str:
    """Model digest (``deltasync.manifest.model_digest``) of the model's bf16 weights, named as
    TRL streams them to the publisher."""
    from deltasync.bf16 import digest, to_bf16_bits
    from deltasync.manifest import model_digest

    return model_digest({n: digest(to_bf16_bits(p)) for n, p in model.named_parameters()})


def _mean(xs):
    return round(statistics.fmean(xs), 6) if xs else None
