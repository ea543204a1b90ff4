"""`make train NPROC=2`: two trainer processes (torchrun, DDP over gloo on CPU) train the local
default through the local stack. Rank 0 publishes one version per optimizer step, the model plays
real Wordle moves, and the replica ends bit for bit on the trainer's weights."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NPROC_STEPS = 2


@pytest.mark.slow
def test_two_trainer_processes_publish_one_version_per_step(tmp_path, e2e_warm_start):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "trainer", "--max-steps", str(NPROC_STEPS), "--runs-root", str(tmp_path)]
    cmd += ["--run-id", "np2", "--eval-episodes", "4", "--dashboard", "false"]
    cmd += ["--token-budget", "4096"]
    for field, value in e2e_warm_start.items():  # the session's warm start, already built
        cmd += ["--" + field.replace("_", "-"), str(value)]
    env = {k: v for k, v in os.environ.items() if k not in ("BUCKET", "VLLM_URL", "ENV_URL")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout[-3000:] + proc.stderr[:4000] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "rank 1 of 2: training" in proc.stderr, out  # the second process trained too
    with open(tmp_path / "np2" / "summary.json") as f:
        summary = json.load(f)
    assert summary["trainer_processes"] == 2
    assert summary["steps"] == NPROC_STEPS
    assert summary["versions_published"] == list(range(NPROC_STEPS + 1))  # v0, then one per step
    assert summary["turns_mean"] >= 2  # tool calls reached the Wordle server and came back
    assert summary["replica_bit_exact"] is True
    # the local default's update: centred advantages, answer rows tied to spelling on every rank
    assert summary["grpo"] == {
        "learning_rate": 2e-4,
        "scale_rewards": "none",
        "tie_answer_rows": True,
    }
