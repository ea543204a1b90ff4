"""The run's summary: what a user checks after ``make train`` (printed, and written to
``runs/<run_id>/summary.json``): the evaluations before and after GRPO and their paired
difference, the learning curve, throughput, staleness, the published versions and their bytes,
the fleet, and whether the replica holds the trainer's weights bit for bit."""

from __future__ import annotations

import statistics

from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics, read_heartbeats
from trainer.config import train_dtype
from trainer.loop import ranks


def build_summary(cfg, start: dict, trainer_digest: str, parts) -> dict:
    """The summary of a finished run (every field written once; ``run()`` adds ``wall_s`` last):
    the run's own figures (``train_dtype``, ``bfloat16`` or ``float32``, and
    ``train_dtype_reason``: the settings and whether bf16 is native on this machine,
    ``trainer.config.train_dtype``), then each part's ``summary()`` in order.

    Args:
        cfg: the run's ``TrainConfig`` (the summary records the update's settings and all of
            them under ``settings``).
        start: ``initial_model`` (name), ``warm_start_s`` and ``train_s`` (GRPO, learning-curve
            evaluations included).
        trainer_digest: the digest of what the trainer publishes, from its own model
            (``weights.trained_digest(trainer)``).
        parts: objects with ``summary() -> dict``: the run stack (bucket, versions, fleet), the
            rollout tagger (staleness, training games), the metrics (step times), the held-out
            evaluations and the trained weights; None for a part the run does not have.
    """
    grpo = cfg.grpo
    dtype = train_dtype(grpo)
    summary = {
        "run_id": cfg.run.run_id,
        "bucket": cfg.run.bucket_uri(),
        "task": cfg.run.task,
        "grpo": {  # the update's settings (docs/BENCHMARKS.md section 6 (the main job) measures each)
            "learning_rate": grpo.learning_rate,
            "scale_rewards": grpo.scale_rewards,
            "tie_answer_rows": grpo.tie_answer_rows,
        },
        "initial_model": start["initial_model"],
        "warm_start_s": round(start["warm_start_s"], 1),
        "train_s": round(start["train_s"], 1),
        "trainer_model_digest": trainer_digest,
        "trainer_processes": ranks.world(),
        "train_dtype": dtype.dtype,
        "train_dtype_reason": dtype.reason,
    }
    for part in parts:
        if part is not None:
            summary.update(part.summary())
    games, train_s = summary.get("train_games"), start["train_s"]
    summary["train_games_per_s"] = round(games / train_s, 2) if games and train_s else None
    summary["settings"] = cfg.record()  # what ran: e.g. which off-policy correction
    summary["replica_bit_exact"] = replica_bit_exact(summary)
    return summary


def replica_bit_exact(summary: dict) -> bool | None:
    """Whether the replica serves the final version and that version's model digest (which the
    replica verified bit for bit before applying it) equals the digest of the trainer's weights."""
    if summary.get("final_version_digest") is None:
        return None
    same_digest = summary["final_version_digest"] == summary["trainer_model_digest"]
    return bool(same_digest and summary.get("replica_version") == summary["final_version"])


def bucket_summary(store, publisher, replica_version_fn) -> dict:
    """What the bucket and the replicas say: versions, bytes, rewards, heartbeats (the run
    stack's part of the summary)."""
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
        # the publisher's cadence (syncs between publishes: min/max/last/changes, 429s waited
        # out, publishes put off); None where every sync published (no cadence)
        "publish_cadence": (
            {**cadence.summary(), "rate_limited": getattr(publisher, "rate_limited", 0)}
            if (cadence := getattr(publisher, "cadence", None)) is not None
            else None
        ),
    }


def _mean(xs):
    return round(statistics.fmean(xs), 6) if xs else None
