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
from trainer.config import TINY, TrainConfig
from trainer.fleet import pool as fleet_pool
from trainer.fleet.rollout_tagging import ReplicaVersionTagger
from trainer.fleet.router import FleetRouter
from trainer.local import processes
from trainer.loop import ranks, trl_compat
from trainer.loop.bucket_transfer import BucketWeightTransfer
from trainer.loop.learning_curve import EvalEvery, paired_difference
from trainer.loop.metrics import BucketMetricsCallback, quiet_progress
from trainer.task.evaluate import check_context, evaluate
from trainer.task.wordle_task import ENV_URL_VAR, WordleToolEnv, eval_seeds, make_dataset

log = logging.getLogger("trainer")


def initial_model(cfg: TrainConfig) -> tuple[str, float]:
    """The model a new run starts from and the seconds spent building it: for ``tiny``, the
    warm-started local model (``trainer.task.warm_start``, cached under ``runs/cache``)."""
    model = cfg.model_id()
    if model != TINY:
        return model, 0.0
    from trainer.task.warm_start import WarmStartConfig, warm_start

    ws = WarmStartConfig(
        games=cfg.warm_start_games, epochs=cfg.warm_start_epochs, seed=cfg.seed,
        hidden_size=cfg.model_hidden_size, layers=cfg.model_layers,
    )  # fmt: skip
    return warm_start(cfg.cache_dir or os.path.join(cfg.runs_root, "cache"), ws)


def prepare_model(cfg: TrainConfig, store: Store, model: str) -> str:
    """The model folder TRL loads: ``model``, or for a run that already has versions, a copy
    whose weights are the bucket's newest version (restart)."""
    from deltasync.subscriber import DeltaSubscriber, HeldWeights

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


def build_trainer(cfg: TrainConfig, model_path: str, publisher, replica_version_fn, on_first_apply,
                  sample_versions_fn=None):  # fmt: skip
    """AsyncGRPOTrainer with the bucket weight transfer and truthful staleness tagging.

    ``on_first_apply(version)`` runs once the replica serves the first published version and
    before TRL's rollout worker starts (the evaluation "before" uses it).
    ``sample_versions_fn(token_ids)``: the versions that answered a sample's turns (the router's
    ``EpisodeAffinity.versions_of``), for per-sample staleness.
    """
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    step_samples = cfg.per_device_train_batch_size
    args = AsyncGRPOConfig(
        output_dir=cfg.output_dir or os.path.join(cfg.run_dir, "trainer"),
        max_steps=cfg.max_steps,
        learning_rate=cfg.lr(),
        num_generations=cfg.num_generations,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        max_completion_length=cfg.max_completion_length,
        max_tool_calling_iterations=cfg.max_tool_calling_iterations,
        max_staleness=cfg.max_staleness,
        # Bounded generation: at most one step's worth of episodes in flight and one step's worth
        # of scored samples queued: the next step is generated while this one trains, and little
        # is generated that will be discarded as stale.
        max_inflight_tasks=cfg.max_inflight_tasks or step_samples,
        queue_maxsize=cfg.queue_maxsize or step_samples,
        chat_template_kwargs={"enable_thinking": False},
        gradient_checkpointing=False,  # a small model: recomputation costs more than it saves
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
        # several CPU processes: accelerate's MULTI_CPU (DDP over gloo) needs use_cpu
        use_cpu=ranks.world() > 1 and not ranks.has_cuda(),
        ddp_find_unused_parameters=False,  # every parameter takes part in the forward
    )
    n_rows = max(64, cfg.max_steps * cfg.per_device_train_batch_size)
    state = {}
    transfer = BucketWeightTransfer(
        publisher,
        step_fn=lambda: state["trainer"].state.global_step if "trainer" in state else 0,
        first_apply_fn=lambda v: (_wait_replica(replica_version_fn, v), on_first_apply(v)),
    )
    trainer = AsyncGRPOTrainer(
        model=model_path,
        reward_funcs=[],  # the environment's get_reward is the reward (trainer.task.wordle_task)
        args=args,
        train_dataset=make_dataset(n_rows, cfg.seed),
        environment_factory=WordleToolEnv,
        weight_transfer=transfer,
    )
    state["trainer"] = trainer
    trl_compat.bound_score_queue(trainer, groups=1)
    tagger = trl_compat.wrap_rollout_worker(
        trainer,
        lambda inner: ReplicaVersionTagger(
            inner,
            lambda: transfer.last_version,
            replica_version_fn,
            max_staleness=cfg.max_staleness,
            sample_versions_fn=sample_versions_fn,
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
    fleet: fleet_pool.ReplicaPool | None = None  # set once the rollout fleet is up


def run(cfg: TrainConfig, callbacks=(), publisher_hook=None, before_stop=None) -> dict:
    """Train; returns the summary (also printed and written to ``runs/<run_id>/summary.json``).

    Args:
        cfg: the configuration.
        callbacks: factories ``f(ctx: RunContext) -> transformers.TrainerCallback`` (e.g. the
            fault injection of ``trainer.local.e2eNone``).
        publisher_hook: ``f(ctx)`` called once the publisher exists.
        before_stop: ``f(ctx, summary)`` called after training, before the children stop; it may
            add to the summary.
    """
    trl_compat.apply()
    if ranks.world() > 1 and ranks.rank() != 0:
        return ranks.run_other_rank(
            lambda model_path: build_trainer(cfg, model_path, None, None, None)[0]
        )
    os.makedirs(cfg.run_dir, exist_ok=True)
    store_uri = cfg.store_uri()
    storage = {"token": cfg.hf_token} if store_uri.startswith("hf://") and cfg.hf_token else {}
    store = Store(store_uri, **storage)
    children: list[processes.Child] = []
    stoppers: list = []  # the fleet router and pool, stopped before the children
    logs_dir = os.path.join(cfg.run_dir, "logs")
    file_log = processes.log_to_file(os.path.join(logs_dir, "trainer.log"))
    t_start = time.time()
    try:
        base_model, warm_start_s = initial_model(cfg)
        model_path = prepare_model(cfg, store, base_model)
        env_url = cfg.env_url
        if env_url is None:
            wordle = processes.start_wordle(logs_dir)
            children.append(wordle)
            env_url = wordle.url
        os.environ[ENV_URL_VAR] = env_url  # read by WordleToolEnv in TRL's rollout process
        retention = {"anchor_every": cfg.anchor_every, "keep_anchors": cfg.keep_anchors}
        publisher = DeltaPublisher(
            store,
            run_id=cfg.run_id,
            config=PublisherConfig(
                takeover=cfg.takeover,
                diff_on=cfg.diff_on,
                **{k: v for k, v in retention.items() if v is not None},  # None: the default
            ),
        )
        fixed_urls, discover = fleet_pool.parse_vllm_urls(cfg.vllm_url)
        if not fixed_urls and not discover and cfg.local:  # one replica of our own
            replica = processes.start_replica(store_uri, model_path, logs_dir)
            children.append(replica)
            fixed_urls, discover = [replica.url], True  # late local replicas join by heartbeat
        elif not fixed_urls:  # a bucket and no VLLM_URL: every replica that follows it
            discover = True
        if cfg.dashboard and cfg.local:
            children.append(processes.start_dashboard(store_uri, cfg.dashboard_port, logs_dir))
            log.info("dashboard: http://127.0.0.1:%d", cfg.dashboard_port)
        ctx = RunContext(cfg, store, store_uri, model_path, logs_dir, children, publisher)
        if publisher_hook is not None:
            publisher_hook(ctx)
        for child in children:
            child.wait_healthy(900)
        pool = fleet_pool.ReplicaPool(
            fixed_urls, store if discover else None, cfg.rollout_headers,
            published_version_fn=lambda: publisher.published[-1].version
            if publisher.published else None,
            max_staleness=cfg.max_staleness, health_interval_s=cfg.fleet_health_interval_s,
            discover_interval_s=None if store.is_local else cfg.fleet_discover_interval_s,
            require_https=not store.is_local,
        ).start()  # fmt: skip
        router = FleetRouter(pool, wait_s=cfg.fleet_wait_s)
        ctx.fleet = pool
        stoppers.extend([router.stop, pool.stop])
        # TRL, the context check and the evaluations all reach the fleet through the router.
        replica_url = cfg.vllm_url = router.start(processes.free_port())
        log.info("rollout fleet behind %s: %s", replica_url, pool.describe())

        def replica_version():
            return pool.oldest_serving_version()

        evals: dict[str, dict] = {}
        metrics_cb = BucketMetricsCallback(
            store, cfg.run_id, publisher, log_path=os.path.join(logs_dir, "steps.jsonl")
        )

        def run_eval(label: str, step: int, version: int | None, games: int) -> None:
            if games <= 0:
                return
            t0 = time.time()
            block = evaluate(
                replica_url,
                model_path,
                env_url,
                eval_seeds(count=games),
                cfg.max_completion_length,
                cfg.eval_temperature,
                per_seed=True,
            )
            evals[label] = block
            metrics_cb.add_eval(label, step, version, block)
            log.info("eval %s (v%s, %.0fs): %s", label, version, time.time() - t0, _fmt_eval(block))

        def first_apply(version: int) -> None:
            """Once a replica serves the first version: the context check, the evaluation."""
            worst = check_context(replica_url, model_path, cfg.max_completion_length)
            log.info("a full episode fits the replica's context (at most %d tokens)", worst)
            run_eval("before", 0, version, cfg.eval_episodes)

        def curve_point(step: int) -> None:
            """A learning-curve point: the held-out games on the newest published version."""
            version = publisher.published[-1].version
            _wait_replica(replica_version, version, timeout_s=300)
            run_eval(f"step-{step}", step, version, cfg.eval_curve_episodes)

        ranks.share_model_path(model_path)  # the other ranks build their trainers now
        trainer, transfer, tagger = build_trainer(
            cfg, model_path, publisher, replica_version, first_apply, router.affinity.versions_of
        )
        metrics_cb.tagger = tagger
        metrics_cb.fleet = pool.snapshot
        trainer.add_callback(metrics_cb)
        trainer.add_callback(EvalEvery(cfg.eval_every, cfg.max_steps, curve_point))
        for make_callback in callbacks:
            trainer.add_callback(make_callback(ctx))
        quiet_progress(trainer)
        t_train = time.time()
        try:
            trainer.train()
        finally:
            publisher.close()  # idempotent with TRL's destroy(): flush the last publish
        train_s = time.time() - t_train
        final = publisher.published[-1].version
        if cfg.vllm_url:  # let the replica apply the last version (the evaluation needs it)
            _wait_replica(replica_version, final, timeout_s=300)
        run_eval("after", trainer.state.global_step, final, cfg.eval_episodes)
        summary = _summary(cfg, store, publisher, tagger, replica_version, t_start)
        summary.update(
            initial_model=base_model,
            warm_start_s=round(warm_start_s, 1),
            eval_before=_without_seeds(evals.get("before")),
            eval_after=_without_seeds(evals.get("after")),
            eval_paired=_paired(evals),
            eval_curve=_curve(evals),
            step_s_median=metrics_cb.step_s_median(),
            stale_fraction=metrics_cb.stale_fraction(),
        )
        games = tagger.games_total if tagger is not None else None
        summary["train_games"] = games
        summary["train_s"] = round(train_s, 1)  # GRPO, learning-curve evaluations included
        summary["train_games_per_s"] = round(games / train_s, 2) if games and train_s else None
        summary["fleet"] = pool.snapshot()
        summary["max_request_s"] = round(router.max_request_s, 1)
        summary["sticky_turns"] = router.affinity.hits  # later turns sent to their replica
        summary["per_sample_tags"] = tagger.per_sample_tags if tagger else 0
        summary["trainer_model_digest"] = _model_digest(trainer.model)
        summary["trainer_processes"] = ranks.world()
        summary["replica_bit_exact"] = _replica_bit_exact(summary)
        if before_stop is not None:
            before_stop(ctx, summary)
        summary["wall_s"] = round(time.time() - t_start, 1)
    finally:
        for stop in reversed(stoppers):
            stop()
        for child in reversed(children):
            child.stop()
        logging.getLogger().removeHandler(file_log)
        file_log.close()
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


_CURVE = ("reward_mean", "reward_se", "win_rate", "consistent_rate", "invalid_rate", "episodes")


def _without_seeds(block: dict | None) -> dict | None:
    return None if block is None else {k: v for k, v in block.items() if k != "per_seed"}


def _curve(evals: dict) -> list[dict]:
    """One row per evaluation, in order, each with its paired difference from the first
    evaluation on the seeds they share (a curve point plays the first ``eval_curve_episodes``)."""
    before = evals.get("before")
    rows = []
    for label, block in evals.items():
        row = {"label": label, **{m: block[m] for m in _CURVE if m in block}}
        if before is not None and label != "before" and len(block["per_seed"]) > 1:
            n = len(block["per_seed"])
            row["vs_before"] = paired_difference(before["per_seed"][:n], block["per_seed"])
        rows.append(row)
    return rows


def _paired(evals: dict) -> dict | None:
    """The paired comparison of the first and the last evaluation (same seeds)."""
    before, after = evals.get("before"), evals.get("after")
    if not before or not after:
        return None
    return paired_difference(before["per_seed"], after["per_seed"])


def _fmt_eval(b: dict) -> str:
    return (
        f"reward {b['reward_mean']:.3f}+-{b['reward_se']:.3f} win {b['win_rate']:.2f} "
        f"consistent {b['consistent_rate']:.2f} "
        f"wellformed {b['wellformed_rate']:.2f} valid {b['valid_guess_rate']:.2f} "
        f"guesses {b['guesses_mean']:.2f} bad-end {b['bad_end_rate']:.2f}"
    )


def _replica_bit_exact(summary: dict) -> bool | None:
    """Whether the replica serves the final version and that version's model digest (which the
    replica verified bit for bit before applying it) equals the digest of the trainer's weights."""
    if summary.get("final_version_digest") is None:
        return None
    same_digest = summary["final_version_digest"] == summary["trainer_model_digest"]
    return bool(same_digest and summary.get("replica_version") == summary["final_version"])


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
        "turns_mean": _mean([s.turns_mean for s in metrics.steps if s.turns_mean is not None]),
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
