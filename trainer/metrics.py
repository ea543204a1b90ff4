"""Trainer metrics in the bucket (``metrics/trainer.json``, ``deltasync.status.TrainerMetrics``),
rewritten after every logged step so that a dashboard anywhere can read them, plus one dense log
line per step."""

from __future__ import annotations

import logging
import math

from transformers import TrainerCallback

from deltasync.status import TRAINER_METRICS_PATH, StepMetrics, TrainerMetrics
from deltasync.store import Store

log = logging.getLogger("trainer.metrics")


def _num(logs: dict, *keys) -> float | None:
    for k in keys:
        v = logs.get(k)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None


class BucketMetricsCallback(TrainerCallback):
    """Collects reward, loss, staleness and publish costs per step and writes them to the bucket.

    Args:
        store: the run's store.
        run_id: the run.
        publisher: the DeltaPublisher (its committed entries give bytes, density, timings).
        tagger: the ReplicaVersionTagger (staleness histogram, replica version), or None.
        keep: newest steps kept in the file.
    """

    def __init__(self, store: Store, run_id: str, publisher, tagger=None, keep: int = 1000):
        self.store = store
        self.publisher = publisher
        self.tagger = tagger
        self.keep = keep
        self.metrics = TrainerMetrics(run_id=run_id)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs and "reward" not in logs:
            return
        entry = self.publisher.published[-1] if self.publisher.published else None
        m = StepMetrics(
            step=state.global_step,
            version=entry.version if entry else None,
            reward=_num(logs, "reward", "rewards/mean"),
            loss=_num(logs, "loss"),
            staleness={str(k): v for k, v in sorted(self.tagger.staleness.items())}
            if self.tagger
            else {},
            diff_s=entry.timings_s.get("diff_s") if entry else None,
            encode_s=entry.timings_s.get("encode_s") if entry else None,
            upload_s=entry.timings_s.get("write_upload_s") if entry else None,
            bytes=(entry.delta.bytes if entry and entry.delta else None),
            density=entry.density if entry and entry.delta else None,
        )
        self.metrics.steps = (self.metrics.steps + [m])[-self.keep :]
        self.store.write_bytes(TRAINER_METRICS_PATH, self.metrics.model_dump_json().encode())
        rv = self.tagger.replica_version if self.tagger else None
        log.info(
            "step %d reward=%s loss=%s version=%s replica=%s lag=%s bytes=%s density=%s",
            m.step, _fmt(m.reward), _fmt(m.loss), m.version, rv,
            (m.version - rv) if m.version is not None and rv is not None else None,
            m.bytes, _fmt(m.density, 5),
        )  # fmt: skip


def _fmt(x, digits=3):
    return None if x is None else f"{x:.{digits}f}"
