"""Dropped episodes (issue 56): an episode the environment failed (no reward: TRL's NaN) is
counted per step, shown in the step line and the bucket's metrics, and past
``--max-dropped-fraction`` for ``--max-dropped-steps`` steps in a row the run stops with
``DroppedEpisodesError``. Old metrics files (without the field) still parse."""

from __future__ import annotations

import math
import queue
from types import SimpleNamespace

import numpy as np
import pytest

from deltasync.status import TRAINER_METRICS_PATH, StepMetrics, TrainerMetrics
from deltasync.store import Store
from trainer.config import TrainConfig
from trainer.loop.metrics import BucketMetricsCallback, DroppedEpisodesError
from trainer.loop.rollout_tagging import ReplicaVersionTagger
from trainer.settings import GRPOConfigError


class _Worker:
    def __init__(self):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()

    def update_model_version(self, v):
        pass


class _Publisher:
    published: list = []


def _row(episode: int, reward: float) -> SimpleNamespace:
    """One row of its own episode (group ``episode``), as TRL queues it."""
    mask = np.array([0] * 10 + [1] * 4, dtype=np.int64)
    return SimpleNamespace(
        completion=[{"role": "assistant", "content": f"episode {episode}"}],
        group_id=episode,
        model_version=0,
        input_ids=np.arange(mask.size),
        completion_mask=mask,
        metrics={"reward": reward},
    )


class FlakyEnvironment:
    """Plays episodes whose reward is None where the environment failed them; TRL queues each
    as a row with reward NaN (``float(None-as-nan)``)."""

    def __init__(self, worker: _Worker, tagger: ReplicaVersionTagger):
        self.worker, self.tagger, self.n = worker, tagger, 0

    def play(self, ok: int, failed: int) -> None:
        rewards = [0.5] * ok + [None] * failed
        for r in rewards:
            self.worker.rollout_buffer.put(_row(self.n, math.nan if r is None else r))
            self.n += 1
        for _ in rewards:
            self.tagger.rollout_buffer.get(timeout=1)


def _stack(**limits):
    worker = _Worker()
    tagger = ReplicaVersionTagger(worker, lambda: None, lambda: None)
    store = Store("memory://test-dropped-" + "-".join(f"{k}{v}" for k, v in limits.items()))
    cb = BucketMetricsCallback(store, "run", _Publisher(), tagger=tagger, **limits)
    return FlakyEnvironment(worker, tagger), tagger, cb, store


def _log(cb, step: int) -> None:
    cb.on_log(None, SimpleNamespace(global_step=step), None, logs={"loss": 0.1, "reward": 0.5})


def test_failed_episodes_are_counted_per_step_and_shown(capsys):
    env, tagger, cb, store = _stack()
    env.play(ok=3, failed=2)
    _log(cb, 1)
    env.play(ok=4, failed=0)
    _log(cb, 2)
    cb.flush()
    first, second = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH)).steps
    assert (first.games, first.dropped_episodes) == (3, 2)
    assert (second.games, second.dropped_episodes) == (4, 0)
    assert tagger.dropped_total == 2 and tagger.summary()["dropped_episodes"] == 2
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert lines[0].endswith(" dropped=2/5") and "dropped" not in lines[1]


def test_past_the_threshold_for_n_steps_in_a_row_the_run_stops(capsys):
    env, _, cb, store = _stack(max_dropped_fraction=0.5, max_dropped_steps=2)
    env.play(ok=1, failed=3)
    _log(cb, 1)  # 3 of 4: failing, 1 in a row
    env.play(ok=3, failed=1)
    _log(cb, 2)  # 1 of 4: fine, the streak ends
    env.play(ok=2, failed=2)
    _log(cb, 3)  # exactly half: not over the threshold
    env.play(ok=0, failed=4)
    _log(cb, 4)
    env.play(ok=1, failed=5)
    with pytest.raises(DroppedEpisodesError) as e:
        _log(cb, 5)
    msg = str(e.value)
    assert "expected at most 0.5 of a step's episodes dropped" in msg
    assert "for 2 steps in a row (step 4: 4 of 4; step 5: 5 of 6)" in msg
    assert "ENV_URL" in msg and "--max-dropped-fraction" in msg
    # the failing steps are in the bucket before the run stops
    steps = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH)).steps
    assert [s.dropped_episodes for s in steps] == [3, 1, 2, 4, 5]


def test_by_default_a_callback_never_stops_and_the_run_settings_do():
    env, _, cb, _ = _stack()
    for step in range(1, 6):
        env.play(ok=0, failed=3)
        _log(cb, step)  # max_dropped_fraction 1.0: never
    cfg = TrainConfig.from_flags(max_dropped_fraction=0.25, max_dropped_steps=5)
    assert (cfg.grpo.max_dropped_fraction, cfg.grpo.max_dropped_steps) == (0.25, 5)
    default = TrainConfig.from_flags()
    assert (default.grpo.max_dropped_fraction, default.grpo.max_dropped_steps) == (0.5, 3)
    with pytest.raises(GRPOConfigError, match="--max-dropped-fraction"):
        TrainConfig.from_flags(max_dropped_fraction=1.5)


def test_old_metrics_files_still_parse():
    old = StepMetrics.model_validate({"step": 3, "reward": 0.2, "games": 8})
    assert old.dropped_episodes is None
