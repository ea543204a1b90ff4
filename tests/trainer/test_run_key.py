"""The trainer's run key: a local run makes one in its run folder (mode 0600) and starts its
replica with the public key, so the replica serves only versions this trainer signed; a bucket run
signs with ``RUN_KEY`` (or the key ``make spaces`` kept); a key file others can read is refused."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from deltasync.errors import KeyFileError
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.signing import RunKey, verify_manifest
from trainer.config import TrainConfig
from trainer.loop.trained_weights import FullWeights
from trainer.stack import RunStack


def test_a_local_run_signs_and_gives_its_replica_the_public_key(tmp_path):
    cfg = TrainConfig.from_flags(runs_root=str(tmp_path), run_id="signed")
    with RunStack(cfg, FullWeights()) as stack:
        pub = stack._start_publisher(str(tmp_path / "model"))
        try:
            pub.publish([("w", np.zeros((4, 4), np.uint16))])
            pub.flush()
            env = stack.replica_env()
        finally:
            pub.close()
        manifest = Manifest.from_json(stack.store.read_bytes(MANIFEST_PATH))
    path = tmp_path / "signed" / "run_key.pem"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = RunKey.load(path)
    assert env["RUN_PUBLIC_KEY"] == key.public_key
    verify_manifest(manifest, key.public_key)  # raises unless this run's key signed it
    # a resumed run signs with the same key: its replicas keep trusting it
    assert cfg.run.signing_key().public_key == key.public_key


def test_a_bucket_run_loads_run_key_and_refuses_a_readable_key_file(tmp_path):
    path = tmp_path / "run_key.pem"
    key = RunKey.generate()
    key.save(path)
    cfg = TrainConfig.from_flags(bucket=str(tmp_path / "b"), run_key=str(path))
    assert cfg.run.signing_key().public_key == key.public_key
    os.chmod(path, 0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        cfg.run.signing_key()
