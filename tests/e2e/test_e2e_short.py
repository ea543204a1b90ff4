"""The short form of `make e2e` (trainer.e2e): trainer + Wordle Space + two vLLM replicas (one
started late, then killed with SIGKILL and restarted) + the dashboard + a file bucket, with one
corrupted delta injected. Ends with both replicas on the final version, which is bit for bit the
trainer's final bf16 weights, and the corruption reported and recovered from."""

import pytest

from trainer.e2e import run_e2e


@pytest.mark.slow
def test_e2e_short(tmp_path):
    report = run_e2e(steps=7, anchor_every=3, late_at=1, kill_at=3, runs_root=str(tmp_path))
    assert report["bucket_digest_equals_trainer"]
    final = report["final_version"]
    assert set(report["replicas"]) == {"local-0", "local-1"}
    assert all(r["held_version"] == final for r in report["replicas"].values())
    events = [e["event"] for e in report["faults"]]
    assert events[0] == "start late replica" and "kill (SIGKILL)" in events
    assert events[-1] == "restart"
    assert report["corrupted"]["version"] in report["anchors"]
    assert any(r["errors"] > 0 for r in report["replicas"].values())
    assert report["dashboard_http"] == 200
    assert len(report["anchors"]) >= 2 and sum(report["staleness"].values()) > 0
