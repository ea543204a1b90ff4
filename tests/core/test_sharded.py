"""Two CPU processes (gloo) train and publish through ShardedPublisher, with FSDP2 shards and with
DDP: the bucket gets exactly one committed version per optimizer step, and a replica rebuilds
every version bit for bit equal to the full parameters gathered from the ranks."""

import os
import subprocess
import sys

import numpy as np
import pytest

from deltasync.subscriber import DeltaSubscriber, HeldWeights

WORKER = os.path.join(os.path.dirname(__file__), "sharded_worker.py")
STEPS = 5


def run_ranks(tmp_path, mode):
    bucket, out = tmp_path / "bucket", tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [WORKER, mode, str(bucket), str(out), str(STEPS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    # the ranks' own tracebacks come first in torchrun's stderr, its summary last
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[:6000] + proc.stderr[-1500:]
    return bucket, out


@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_two_ranks_publish_one_version_per_step_bit_exact(tmp_path, mode):
    bucket, out = run_ranks(tmp_path, mode)
    sub = DeltaSubscriber(str(bucket))
    manifest = sub.read_manifest()
    assert [(v.version, v.step) for v in manifest.versions] == [(s, s) for s in range(STEPS + 1)]
    kinds = [(v.delta is not None, v.anchor is not None) for v in manifest.versions]
    assert kinds[0] == (False, True) and kinds[1] == (True, False) and kinds[3] == (True, True)
    held = HeldWeights()
    for v in range(STEPS + 1):  # follow version by version, as a replica polling each step
        sub.sync(held, target=v)
        truth = dict(np.load(out / f"v{v}.npz"))
        assert held.version == v and set(held.tensors) == set(truth)
        for name, bits in truth.items():
            assert np.array_equal(held.tensors[name], bits), (v, name)
    assert manifest.versions[-1].changed > 0  # training moved the weights


def test_a_failed_publish_reaches_every_rank(tmp_path):
    """Rank 0's bucket fails: rank 0 raises the error and rank 1 a RuntimeError naming it,
    instead of waiting forever in a collective."""
    _, out = run_ranks(tmp_path, "fail")
    errors = {r: (out / f"rank{r}.err").read_text() for r in (0, 1)}
    assert errors[0].startswith("OSError: bucket unreachable at v1")
    assert errors[1].startswith("RuntimeError: rank 0 failed to publish: OSError: bucket")
