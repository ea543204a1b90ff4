"""The dashboard shows the trainer's dropped episodes (issue 56): a column of the training frame
and one summary line when a step had any; files written before they were counted still load."""

from __future__ import annotations

import json

from dashboard.data import BucketReader
from deltasync.status import StepMetrics, TrainerMetrics
from deltasync.store import Store


def _view(uri: str, steps: list[StepMetrics], raw: bytes | None = None):
    store = Store(uri)
    body = raw if raw is not None else TrainerMetrics(run_id="r", steps=steps).model_dump_json()
    store.write_bytes("metrics/trainer.json", body if isinstance(body, bytes) else body.encode())
    return BucketReader(uri).read()


def test_dropped_episodes_are_a_column_and_a_line():
    steps = [
        StepMetrics(step=1, games=8, dropped_episodes=0),
        StepMetrics(step=2, games=5, dropped_episodes=3),
        StepMetrics(step=3, games=6, dropped_episodes=2),
        StepMetrics(step=4, games=8, dropped_episodes=0),
    ]
    view = _view("memory://dash-dropped", steps)
    assert view.frame("training").dropped_episodes.tolist() == [0, 3, 2, 0]
    for public in (True, False):
        assert (
            "dropped episodes (the environment failed them): **2 of 8** at step 3, 5 in 2 step(s)"
            in view.markdown(public=public)
        )


def test_no_dropped_episodes_no_line_and_old_files_load():
    view = _view("memory://dash-dropped-none", [StepMetrics(step=1, games=8, dropped_episodes=0)])
    assert "dropped episodes" not in view.markdown()
    old = json.dumps({"run_id": "r", "steps": [{"step": 1, "games": 8, "reward": 0.3}]})
    view = _view("memory://dash-dropped-old", [], raw=old.encode())
    assert view.frame("training").dropped_episodes.isna().all()
    assert view.frame("training").games.tolist() == [8]
    assert "dropped episodes" not in view.markdown()
