"""The dashboard data layer (``dashboard.data``) on buckets recorded by the real
publisher and subscriber: the frames it builds (checked against the recorded manifest, heartbeats
and metrics), cheap re-reading, stalled/failing flags, the reward and learning curves, and the
router's counts. Also that importing it stays light (no torch, no gradio). The waiting/error
states and their messages: ``test_states.py``."""

from __future__ import annotations

import bisect
import os
import subprocess
import sys

import pandas as pd
import pytest

from dashboard.data import BucketReader
from dashboard.frames import BYTES_PER_MB, COLUMNS, REWARD_SERIES, TRAIN_SUFFIX
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import (
    TRAINER_METRICS_PATH,
    ReplicaHeartbeat,
    TrainerMetrics,
    read_heartbeats,
    write_heartbeat,
)
from deltasync.store import Store


def _recorded(uri: str) -> tuple[Manifest, dict[str, ReplicaHeartbeat], TrainerMetrics]:
    store = Store(uri)
    manifest = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    metrics = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    return manifest, read_heartbeats(store), metrics


def _unix(col: pd.Series) -> list[float]:
    """A frame's naive-UTC datetime column back to unix seconds."""
    return [t.value / 1e9 for t in col]


def test_frames_match_the_recorded_bucket(recorded_bucket):
    uri, _ = recorded_bucket
    manifest, heartbeats, metrics = _recorded(uri)
    now = max(hb.updated_at for hb in heartbeats.values()) + 1.0
    view = BucketReader(uri).read(now=now)

    assert view.state == "ok", view.message
    assert view.run_id == manifest.run_id
    assert view.trainer_version == manifest.latest.version
    assert view.warnings == []
    # then one column per figure the task declares, in declared order (an old file: Wordle's)
    scalar = [f for f in metrics.figures if not f.counts]
    own = {
        "training": [f.name for f in scalar if f.steps],
        "evals": [f.name for f in scalar if f.evals],
    }
    for name, cols in COLUMNS.items():
        assert list(view.frame(name).columns) == cols + own.get(name, []), name

    # payload MB per version, anchors marked
    payloads = view.frame("payloads")
    want = {(v.version, "delta", v.delta.bytes) for v in manifest.versions if v.delta}
    want |= {(v.version, "anchor", v.anchor.bytes) for v in manifest.versions if v.anchor}
    assert set(zip(payloads.version, payloads.kind, payloads.bytes, strict=True)) == want
    assert payloads.mb.tolist() == pytest.approx((payloads.bytes / BYTES_PER_MB).tolist())
    anchors = [v.version for v in manifest.versions if v.anchor]
    assert len(anchors) >= 2  # the fixture anchors every 3 versions
    density = view.frame("density").set_index("version")
    for v in manifest.versions:
        assert density.loc[v.version, "density"] == pytest.approx(v.density)
        assert density.loc[v.version, "changed"] == v.changed
        assert (density.loc[v.version, "marker"] != "delta") == (v.anchor is not None)

    # held version vs trainer version over time
    versions = view.frame("versions")
    trainer = versions[versions.series == "trainer"]
    assert trainer.version.tolist() == [v.version for v in manifest.versions] + [
        manifest.latest.version
    ]
    assert _unix(trainer.time)[:-1] == pytest.approx([v.created_at for v in manifest.versions])
    assert _unix(trainer.time)[-1] == pytest.approx(now)
    for rid, hb in heartbeats.items():
        mine = versions[versions.series == rid]
        points = dict(zip(_unix(mine.time), mine.version, strict=True))
        want_points = {r.applied_at: r.version for r in hb.recent}
        want_points[hb.updated_at] = hb.held_version
        assert sorted(points.values()) == sorted(want_points.values())
        assert sorted(points) == pytest.approx(sorted(want_points))

    # one row per sync record, with its timings; lag_s there is publish -> apply
    syncs = view.frame("syncs")
    records = [(rid, r) for rid, hb in heartbeats.items() for r in hb.recent]
    assert len(syncs) == len(records)
    by_key = {(row.replica, row.version): row for row in syncs.itertuples()}
    for rid, r in records:
        row = by_key[(rid, r.version)]
        assert (row.kind, row.steps, row.bytes) == (r.kind, r.steps, r.bytes)
        assert row.fetch_s == pytest.approx(r.fetch_s)
        assert row.paused_s == pytest.approx(r.paused_s)
        assert row.apply_s == pytest.approx(r.apply_s)
        assert row.lag_s == pytest.approx(r.lag_s)
    assert {"chain"} <= set(syncs.kind)  # r1 syncs every 2nd version: two deltas per pause
    phases = view.frame("sync_phases")
    assert len(phases) == 4 * len(records)
    assert set(phases.phase) == {"fetch", "decode", "apply", "paused"}

    # lag over time: the status.py definition evaluated just before and at each apply
    lag = view.frame("lag")
    created = [v.created_at for v in manifest.versions]
    for rid, hb in heartbeats.items():
        rows = lag[(lag.replica == rid) & (lag.source == "sync")]
        at = dict(zip(_unix(rows.time), rows.lag_versions, strict=True))
        for r in hb.recent:
            newest = manifest.versions[bisect.bisect_right(created, r.applied_at) - 1]
            got = [v for t, v in at.items() if t == pytest.approx(r.applied_at, abs=1e-6)]
            assert newest.version - r.version in got
        beats = lag[(lag.replica == rid) & (lag.source == "heartbeat")]
        assert beats.lag_versions.tolist() == [hb.lag_versions]
    r1 = lag[(lag.replica == "r1") & (lag.source == "sync")]
    assert r1.lag_versions.max() >= 1  # r1 falls behind between its syncs

    # reward and staleness over steps
    training = view.frame("training")
    assert training.step.tolist() == [s.step for s in metrics.steps]
    assert training.reward.tolist() == pytest.approx([s.reward for s in metrics.steps])
    for s, mean in zip(metrics.steps, training.staleness_mean, strict=True):
        n = sum(s.staleness.values())
        assert mean == pytest.approx(sum(int(k) * c for k, c in s.staleness.items()) / n)
    staleness = view.frame("staleness")
    assert int(staleness["count"].sum()) == sum(sum(s.staleness.values()) for s in metrics.steps)
    assert training.consistent_rate.tolist() == pytest.approx(
        [s.figures["consistent_rate"] for s in metrics.steps]
    )
    assert training.games.tolist() == [s.games for s in metrics.steps]

    # the learning curve: per evaluation its reward, win rate and consistent share at its step,
    # then the training games' consistent share per step
    curve = view.frame("curve")
    assert [e.label for e in metrics.evals] == ["before", "step-4"]
    series = {REWARD_SERIES: "reward_mean", "win rate": "win_rate"}
    series |= {"consistent": "consistent_rate", "valid": "valid_guess_rate"}
    for name, field in series.items():
        mine = curve[curve.series == name]
        assert mine.label.tolist() == [e.label for e in metrics.evals], name
        assert mine.step.tolist() == [e.step for e in metrics.evals], name
        want = [
            e.reward_mean if field == "reward_mean" else e.figures[field] for e in metrics.evals
        ]
        assert mine.value.tolist() == pytest.approx(want)
    train = curve[curve.series == "consistent" + TRAIN_SUFFIX]
    assert train.step.tolist() == training.step.tolist()
    assert train.value.tolist() == pytest.approx(training.consistent_rate.tolist())
    assert set(train.label) == {"training"}
    evals = view.frame("evals")
    assert evals.stopped_early_rate.tolist() == [
        e.figures["stopped_early_rate"] for e in metrics.evals
    ]

    # status table
    status = view.frame("status").set_index("replica")
    assert set(status.index) == set(heartbeats)
    for rid, hb in heartbeats.items():
        row = status.loc[rid]
        assert row.held_version == hb.held_version
        assert row.lag_versions == manifest.latest.version - hb.held_version
        assert row.heartbeat_age_s == pytest.approx(now - hb.updated_at, abs=0.1)
        assert row.health == "ok"
    assert "trainer version" in view.markdown()


def test_unchanged_bucket_is_not_read_again(recorded_bucket):
    uri, _ = recorded_bucket
    reader = BucketReader(uri)
    first = reader.read()
    assert first.stats.files_read == 4  # manifest, 2 heartbeats, trainer metrics
    again = reader.read()
    assert (again.stats.files_read, again.stats.bytes_read) == (0, 0)
    assert again.frame("syncs").equals(first.frame("syncs"))

    store = Store(uri)
    hb = read_heartbeats(store)["r0"]
    hb.status, hb.recent = "syncing", []  # its sync records stay in the dashboard's history
    write_heartbeat(store, hb)
    third = reader.read()
    assert third.stats.files_read == 1
    assert third.frame("status").set_index("replica").loc["r0", "status"] == "syncing"
    assert len(third.frame("syncs")) == len(first.frame("syncs"))


def test_memory_store_rereads_only_what_changed():
    uri = "memory://dash-test-reread"
    store = Store(uri)
    for rid in ("a", "b"):
        write_heartbeat(store, ReplicaHeartbeat.empty(rid))
    reader = BucketReader(uri)
    view = reader.read()
    assert view.state == "waiting" and view.stats.files_read == 2
    assert reader.read().stats.files_read == 0
    write_heartbeat(
        store,
        ReplicaHeartbeat.empty("b", status="error", last_error="boom"),
    )
    view = reader.read()
    assert view.stats.files_read == 1
    assert view.frame("status").set_index("replica").loc["b", "last_error"] == "boom"
    store.rm(store.ls(""))


def test_stalled_and_failing_replicas_are_flagged(recorded_bucket):
    uri, _ = recorded_bucket
    store = Store(uri)
    heartbeats = read_heartbeats(store)
    now = max(hb.updated_at for hb in heartbeats.values())
    r0, r1 = heartbeats["r0"], heartbeats["r1"]
    r0.updated_at = now - 120.0
    r1.status, r1.errors, r1.last_error = "error", 3, "DeltaCorruptError: v5 digest mismatch"
    write_heartbeat(store, r0)
    write_heartbeat(store, r1)

    view = BucketReader(uri, stalled_after_s=30.0).read(now=now)
    status = view.frame("status").set_index("replica")
    assert status.loc["r0", "health"] == "STALLED"
    assert status.loc["r0", "heartbeat_age_s"] == pytest.approx(120.0)
    assert status.loc["r1", "health"] == "FAILING"
    assert status.loc["r1", "last_error"] == r1.last_error
    assert status.loc["r1", "errors"] == 3
    assert "2 flagged" in view.markdown()


def test_importing_the_data_layer_is_light():
    code = (
        "import sys, deltasync, dashboard.data\n"
        "bad = [m for m in ('torch', 'gradio', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_reward_curve_with_evaluations_and_stale_fraction():
    from deltasync.status import EvalResult, StepMetrics

    uri = "memory://dash-test-evals"
    store = Store(uri)
    ev = dict(
        episodes=16, wellformed_rate=1.0, valid_guess_rate=0.9, win_rate=0.25, guesses_mean=5.0
    )
    metrics = TrainerMetrics(
        run_id="r",
        steps=[StepMetrics(step=s, reward=0.1 * s, stale_fraction=0.05 * s) for s in range(4)],
        evals=[
            EvalResult(label="before", step=0, reward_mean=0.2, reward_se=0.05, **ev),
            EvalResult(label="after", step=3, reward_mean=0.6, reward_se=0.1, **ev),
        ],
    )
    store.write_bytes("metrics/trainer.json", metrics.model_dump_json().encode())
    view = BucketReader(uri).read()
    reward = view.frame("reward")
    train = reward[reward.series == "train"]
    assert train.step.tolist() == [0, 1, 2, 3]
    after = reward[reward.series == "eval after ±SE"].reward.tolist()
    assert after == pytest.approx([0.5, 0.6, 0.7])  # mean - SE, mean, mean + SE
    assert view.frame("training").stale_fraction.tolist() == pytest.approx([0, 0.05, 0.1, 0.15])
    assert view.frame("evals").label.tolist() == ["before", "after"]
    assert "eval **after**" in view.markdown(public=True)
    # written before consistent_rate was measured: the curve leaves it out, the table has NaN
    curve = view.frame("curve")
    assert sorted(set(curve.series)) == ["reward", "valid", "win rate"]
    assert curve[curve.series == "win rate"].value.tolist() == [0.25, 0.25]
    assert view.frame("evals").consistent_rate.isna().all()
    assert "consistent" not in view.markdown()


def test_status_shows_each_replicas_url_and_the_routers_counts(tmp_path):
    """A replica's announced URL (heartbeat) and the trainer's fleet view (metrics) share its
    status row; a replica the router does not know has empty fleet columns."""
    import time

    from deltasync.status import (
        TRAINER_METRICS_PATH,
        FleetMember,
        ReplicaHeartbeat,
        TrainerMetrics,
        write_heartbeat,
    )
    from deltasync.store import Store

    store = Store(str(tmp_path / "bucket"))
    for rid, url in (("a", "https://a.hf.space"), ("b", None)):
        write_heartbeat(store, ReplicaHeartbeat.empty(rid, url=url, updated_at=time.time()))
    fleet = [
        FleetMember(
            url="https://a.hf.space",
            replica_id="a",
            state="serving",
            held_version=3,
            inflight=2,
            served=40,
            failed=1,
        )
    ]
    store.write_bytes(
        TRAINER_METRICS_PATH, TrainerMetrics(run_id="r", fleet=fleet).model_dump_json().encode()
    )
    reader = BucketReader(str(tmp_path / "bucket"))
    status = reader.read().frame("status").set_index("replica")
    assert status.loc["a", "url"] == "https://a.hf.space"
    assert (status.loc["a", "fleet_state"], status.loc["a", "served"]) == ("serving", 40)
    assert status.loc["b", "url"] == "" and status.loc["b", "fleet_state"] == ""
    assert pd.isna(status.loc["a", "served_per_s"])  # one view: no rate yet
    # the trainer writes its metrics again 20 s later, a having answered 100 more: 5 requests/s
    t0 = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH)).updated_at
    fleet[0] = fleet[0].model_copy(update={"served": 140})
    later = TrainerMetrics(run_id="r", fleet=fleet, updated_at=t0 + 20)
    store.write_bytes(TRAINER_METRICS_PATH, later.model_dump_json().encode())
    status = reader.read().frame("status").set_index("replica")
    assert status.loc["a", "served"] == 140 and status.loc["a", "served_per_s"] == 5.0


def test_a_tasks_own_figures_are_the_columns_and_curves():
    """Another task's declared figure (the letter task's answer length, as ``Task.figures``
    declares it) is the training and evaluation frames' column and the learning curve's series,
    under its label, and Wordle's are nowhere."""
    from deltasync.status import EvalResult, StepMetrics, TaskFigure

    uri = "memory://dash-test-task-figures"
    length = TaskFigure(
        name="answer_chars",
        label="answer length",
        unit="chars",
        higher_is_better=None,
        headline=True,
    )
    metrics = TrainerMetrics(
        run_id="r",
        figures=[length],
        steps=[StepMetrics(step=s, reward=0.5, figures={"answer_chars": 5.0 + s}) for s in (1, 2)],
        evals=[
            EvalResult(
                label="before",
                step=0,
                episodes=4,
                reward_mean=0.2,
                reward_se=0.1,
                figures={"answer_chars": 4.5},
            )
        ],
    )
    Store(uri).write_bytes("metrics/trainer.json", metrics.model_dump_json().encode())
    view = BucketReader(uri).read()
    training, evals = view.frame("training"), view.frame("evals")
    assert list(training.columns) == COLUMNS["training"] + ["answer_chars"]
    assert training.answer_chars.tolist() == [6.0, 7.0]
    assert list(evals.columns) == COLUMNS["evals"] + ["answer_chars"]
    assert evals.answer_chars.tolist() == [4.5]
    curve = view.frame("curve")
    assert sorted(set(curve.series)) == ["answer length", "answer length (train)", "reward"]
    assert curve[curve.series == "answer length (train)"].value.tolist() == [6.0, 7.0]
    assert view.frame("figures").label.tolist() == ["answer length"]
    page = view.markdown(public=True)
    assert "answer length 4.5 chars" in page and "win rate" not in page
