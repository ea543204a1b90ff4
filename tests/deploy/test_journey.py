"""The user's journey (``make journey``, tools/journey.py), offline through the local Hub:
``make spaces`` creates the bucket and three Spaces that run, the exact ``make train`` line it
prints trains 3 steps through ``batch_bucket_files`` and hf_xet while the rollout Space follows
the bucket over the Hub API and serves the rollouts, the dashboard Space shows the trainer's
version and the replica's lag, ``make spaces-down`` pauses the rollout Space. Each step's outcome
is checked as a user sees it, and the requests are counted at the Hub."""

from __future__ import annotations

import json
import time

import pytest

from tools.journey import main

from ..conftest import E2E_WARM_START


@pytest.mark.slow
def test_the_journey_through_a_local_hub(tmp_path, e2e_warm_start, capsys):
    ws = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in E2E_WARM_START.items())
    argv = [
        "--root",
        str(tmp_path),
        "--cache-dir",
        e2e_warm_start["cache_dir"],
        "--warm-start-args",
        ws,
        "--prefix",
        "jt",
        "--bucket-name",
        "jt",
    ]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "journey.json").read_text())
    steps = {s["step"]: s["saw"] for s in report["steps"]}
    # make spaces printed a make train line with the Spaces' local URLs
    assert "make train BUCKET=me/jt VLLM_URL=http://127.0.0.1:" in steps["make spaces"]
    # the trainer published 3 versions after the anchor, and the rollout Space ends bit-exact
    assert report["summary"] == {"final_version": 3, "replica_bit_exact": True, "steps": 3}
    assert "replicas: me--jt-rollout held 3 (lag 0)" in steps["dashboard"]
    assert steps["spaces-down"] == "rollout Space PAUSED"
    # requests crossed the Hub, each unit with its own token: the trainer wrote, the Space read
    during = report["requests_during_training"]
    assert during["me-write"]["api"] > 0 and during["rollout-space"]["resolver"] > 0
    # a quiet terminal: one line per step, no per-request log lines or upload progress bars
    assert "HTTP Request:" not in out and "Processing Files" not in out
    train_log = (tmp_path / "logs" / "train.log").read_text()
    assert "HTTP Request:" not in train_log and "New Data Upload" not in train_log
    # make journey leaves nothing running: the Hub stopped its Spaces' processes (an exited
    # process whose parent, the Hub, is gone may stay a zombie until init reaps it)
    for known in (tmp_path / "hub" / "spaces").glob("*/*/process.json"):
        pid = json.loads(known.read_text())["pid"]
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(pid), f"{known.parent.name}'s process {pid} still runs"


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
