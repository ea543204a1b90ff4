"""The dashboard shows the publisher's cadence (issue 58): ``publish_every`` is a column of the
training frame, and one summary line says so while the last step's cadence publishes every
k > 1 syncs; k = 1, a run without a cadence, and files written before it was recorded show no
line and still load."""

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


def test_publish_every_is_a_column_and_a_line_while_k_is_over_one():
    steps = [
        StepMetrics(step=1, games=8, publish_every=1),
        StepMetrics(step=2, games=8, publish_every=1),
        StepMetrics(step=3, games=8, publish_every=4),
        StepMetrics(step=4, games=8, publish_every=3),
    ]
    view = _view("memory://dash-cadence", steps)
    assert view.frame("training").publish_every.tolist() == [1, 1, 4, 3]
    for public in (True, False):
        md = view.markdown(public=public)
        assert "publishing every 3 syncs (Hub budget)" in md  # the last step's k
        assert md.count("publishing every") == 1


def test_k_of_one_no_cadence_and_old_files_show_no_line():
    view = _view(
        "memory://dash-cadence-one",
        [StepMetrics(step=1, publish_every=4), StepMetrics(step=2, publish_every=1)],
    )
    assert view.frame("training").publish_every.tolist() == [4, 1]
    assert "publishing every" not in view.markdown()  # back to every sync
    view = _view("memory://dash-cadence-none", [StepMetrics(step=1, games=8)])
    assert view.frame("training").publish_every.isna().all()  # no cadence ran: None
    assert "publishing every" not in view.markdown()
    old = json.dumps({"run_id": "r", "steps": [{"step": 1, "games": 8, "reward": 0.3}]})
    view = _view("memory://dash-cadence-old", [], raw=old.encode())
    assert view.frame("training").publish_every.isna().all()
    assert view.frame("training").games.tolist() == [8]
    assert "publishing every" not in view.markdown()
