"""The run's summary: what a user checks after ``make train`` (printed, and written to
``runs/<run_id>/summary.json``): the evaluations before and after GRPO and their paired
difference, the learning curve, throughput, staleness, the published versions and their bytes,
the fleet, and whether the replica holds the trainer's weights bit for bit."""

from __future__ import annotations

import statistics

from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics, read_heartbeats
from trainer.loop import ranks
from trainer.settings import GRPOSettings, RunSettings


def build_summary(
    run: RunSettings,
    grpo: GRPOSettings,
    weights,
    stack,
    trainer_digest: str,
    tagger,
    metrics_cb,
    evals,
    start: dict,
) -> dict:
    """The summary of a finished run (every field written here once; ``run()`` adds ``wall_s``
    last).

    Args:
        run, grpo: the run's settings (the summary records the update's).
        weights: what the run trained (``trainer.loop.trained_weights``).
        stack: the run's bucket and fleet: ``store``, ``publisher``, ``pool``, ``router`` and
            ``replica_version()`` (a :class:`~trainer.stack.RunStack`).
        trainer_digest: the digest of what the trainer publishes, from its own model
            (``weights.trained_digest(trainer)``).
        tagger: the rollout worker's ``ReplicaVersionTagger`` (staleness, games; None: none).
        metrics_cb: the run's ``BucketMetricsCallback`` (step times, stale fraction).
        evals: the run's ``HeldOutEvals``.
        start: ``initial_model`` (name), ``warm_start_s`` and ``train_s`` (GRPO, learning-curve
            evaluations included).
    """
    pool, router = stack.pool, stack.router
    summary = _bucket_summary(run, stack.store, stack.publisher, tagger, stack.replica_version)
    games, train_s = (tagger.games_total if tagger is not None else None), start["train_s"]
    summary.update(
        weights.summary(),  # an adapter run: what its replicas need (make eval starts one)
        grpo={  # the update's settings (docs/BENCHMARKS.md section 6 (the main job) measures each)
            "learning_rate": grpo.learning_rate,
            "scale_rewards": grpo.scale_rewards,
            "tie_answer_rows": grpo.tie_answer_rows,
        },
        initial_model=start["initial_model"],
        warm_start_s=round(start["warm_start_s"], 1),
        eval_before=evals.summary_block("before"),
        eval_after=evals.summary_block("after"),
        eval_paired=evals.paired(),
        eval_curve=evals.curve(),
        step_s_median=metrics_cb.step_s_median(),
        stale_fraction=metrics_cb.stale_fraction(),
        train_games=games,
        train_s=round(train_s, 1),
        train_games_per_s=round(games / train_s, 2) if games and train_s else None,
        fleet=pool.replica_rows(),
        max_request_s=round(router.max_request_s, 1),
        sticky_turns=router.affinity.hits,  # later turns sent to their replica
        per_sample_tags=tagger.per_sample_tags if tagger else 0,
        trainer_model_digest=trainer_digest,
        trainer_processes=ranks.world(),
    )
    summary["replica_bit_exact"] = replica_bit_exact(summary)
    return summary


def replica_bit_exact(summary: dict) -> bool | None:
    """Whether the replica serves the final version and that version's model digest (which the
    replica verified bit for bit before applying it) equals the digest of the trainer's weights."""
    if summary.get("final_version_digest") is None:
        return None
    same_digest = summary["final_version_digest"] == summary["trainer_model_digest"]
    return bool(same_digest and summary.get("replica_version") == summary["final_version"])


def _bucket_summary(run: RunSettings, store, publisher, tagger, replica_version_fn) -> dict:
    """What the bucket and the replicas say: versions, bytes, rewards, heartbeats, staleness."""
    entries = publisher.published
    deltas = [e for e in entries if e.delta is not None]
    metrics = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    rewards = [s.reward for s in metrics.steps if s.reward is not None]
    try:
        rv = replica_version_fn()
    except Exception as e:  # the replica may already be gone; the summary says so
        rv = f"unreachable ({type(e).__name__})"
    beats = read_heartbeats(store)
    keep = {"held_version", "lag_versions", "lag_s", "errors"}
    return {
        "run_id": run.run_id,
        "bucket": run.bucket_uri(),
        "steps": metrics.steps[-1].step if metrics.steps else 0,
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
        "replicas": {k: h.model_dump(include=keep) for k, h in beats.items()},
        "staleness": dict(sorted(tagger.staleness.items())) if tagger else {},
        "staleness_dropped": tagger.dropped if tagger else 0,
    }


def _mean(xs):
    return round(statistics.fmean(xs), 6) if xs else None
