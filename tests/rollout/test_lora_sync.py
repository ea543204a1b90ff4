"""A LoRA replica's sync loop against a fake engine (no vLLM; fast): adapter versions followed
and loaded under versioned names with no pause, the PEFT folder written bit-exact to the
published tensors, old versions unloaded only once no request in flight uses them and their
folders deleted one poll later; runs it cannot serve refused before any download while it keeps
serving (another base model, a full-weight run, an adapter run on a full-weight replica, a rank
above MAX_LORA_RANK); a failed load retried; a restart unloading what a previous life left. Also
the LoRA settings (ADAPTER, MAX_LORA_RANK rounded like TRL's ``round_lora_rank``) and vLLM's
command line and environment with and without them."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from deltasync.status import heartbeat_path
from rollout.config import VLLM_LORA_RANKS, ConfigError, RolloutConfig, round_lora_rank
from rollout.launch import vllm_command, vllm_env
from rollout.lora import AdapterTarget, Lease, RunRefusedError
from rollout.sync_loop import SyncLoop

from .lora_helpers import FakeLoraEngine, LoraTrainer, read_folder_bits, set_manifest_base
from .rollout_helpers import FakeEngine, Trainer

REQUIRED = {"BUCKET": "file:///tmp/b", "MODEL": "Qwen/Qwen3-0.6B"}


@pytest.fixture
def bucket(tmp_path) -> str:
    return str(tmp_path / "bucket")


def lora_loop(trainer: LoraTrainer, bucket, tmp_path, rid="r0", max_rank=16, engine=None):
    eng = engine or FakeLoraEngine()
    target = AdapterTarget("policy", trainer.info.base_digest, max_rank, "tiny")
    loop = SyncLoop(bucket, eng, rid, stage_dir=str(tmp_path / "stage"), adapter=target)
    assert loop.connect() == "lora"
    return eng, loop


def folder(loop: SyncLoop, version: int) -> str:
    return loop.lora.folder_for(version)


def test_max_lora_rank_rounds_like_trl():
    from trl.experimental.async_grpo.async_grpo_trainer import VLLM_LORA_RANKS as TRL_RANKS
    from trl.experimental.async_grpo.async_grpo_trainer import round_lora_rank as trl_round

    assert TRL_RANKS == VLLM_LORA_RANKS
    for r in range(1, 513):
        assert round_lora_rank(r) == trl_round(r), r
    with pytest.raises(ValueError, match="above the largest rank"):
        round_lora_rank(513)


def test_lora_settings_and_vllm_command():
    cfg = RolloutConfig.from_env({**REQUIRED, "ADAPTER": "lora", "MAX_LORA_RANK": "4"})
    assert cfg.adapter == "lora" and cfg.adapter_name == "policy" and cfg.lora_args == (8, 4)
    assert RolloutConfig.from_env(REQUIRED).lora_args is None  # full weights by default
    for bad, what in [
        ({"ADAPTER": "qlora"}, "ADAPTER: expected"),
        ({"ADAPTER": "lora", "ADAPTER_NAME": "a/b"}, "ADAPTER_NAME: expected"),
        ({"ADAPTER": "lora", "ADAPTER_NAME": "Qwen/Qwen3-0.6B"}, "ADAPTER_NAME"),
        ({"ADAPTER": "lora", "SERVED_MODEL_NAME": "policy"}, "served model's name"),
        ({"ADAPTER": "lora", "MAX_LORA_RANK": "600"}, "MAX_LORA_RANK: LoRA rank 600"),
        ({"ADAPTER": "lora", "MAX_LORAS": "0"}, "MAX_LORAS must be >= 1"),
        ({"ADAPTER": "lora", "VLLM_EXTRA_ARGS": "--max-loras 9"}, "use MAX_LORA_RANK"),
    ]:
        with pytest.raises(ConfigError, match=what):
            RolloutConfig.from_env({**REQUIRED, **bad})
    cmd = vllm_command("/m/tiny", 8001, lora=cfg.lora_args)
    assert "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8" and cmd[cmd.index("--max-loras") + 1] == "4"
    plain = vllm_command("/m/tiny", 8001)
    assert not {"--enable-lora", "--max-lora-rank", "--max-loras"} & set(plain)
    assert vllm_env({}, "/m/tiny", lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env({}, "/m/tiny")


def test_follows_adapter_versions_bit_exact_without_a_pause(char_model_dir, bucket, tmp_path):
    tr = LoraTrainer(char_model_dir, bucket, anchor_every=3)
    eng, loop = lora_loop(tr, bucket, tmp_path)
    assert loop.poll_once() is None and loop.routes.current is None  # nothing published yet
    for _ in range(4):
        v = tr.publish()
        rec = loop.poll_once()
        assert rec.version == v and rec.apply_path == "lora" and rec.paused_s == 0
        assert eng.pauses == 0 and loop.served_version == v
        assert loop.routes.current == Lease(f"policy-v{v}", v)
        written = read_folder_bits(folder(loop, v))  # the folder vLLM loaded
        assert written.keys() == tr.versions[v].keys()
        for n, a in tr.versions[v].items():
            assert np.array_equal(written[n], a), n
            assert np.array_equal(eng.adapters[f"policy-v{v}"][n], a), n
        cfg = json.load(open(os.path.join(folder(loop, v), "adapter_config.json")))
        assert cfg == tr.info.peft_config
    assert [r.kind for r in loop.recent] == ["anchor", "delta", "delta", "delta"]
    # each older version was unloaded at the poll after the next one loaded
    assert list(eng.adapters) == ["policy-v2", "policy-v3"]
    loop.poll_once()
    assert list(eng.adapters) == ["policy-v3"]
    hb = json.loads(loop.store.read_bytes(heartbeat_path("r0")))
    assert hb["held_version"] == 3 and hb["status"] == "ok" and hb["apply_path"] == "lora"
    tr.close()


def test_old_version_stays_loaded_while_a_request_uses_it(char_model_dir, bucket, tmp_path):
    tr = LoraTrainer(char_model_dir, bucket)
    eng, loop = lora_loop(tr, bucket, tmp_path)
    tr.publish()
    loop.poll_once()
    lease = loop.routes.acquire("policy")  # a request arrives on v0
    assert lease == Lease("policy-v0", 0)
    tr.publish()
    loop.poll_once()
    assert loop.routes.acquire("policy") == Lease("policy-v1", 1)  # a new request: v1
    loop.routes.release(Lease("policy-v1", 1))
    for _ in range(3):  # polls while the v0 request runs: v0 stays loaded, its folder too
        loop.poll_once()
        assert "policy-v0" in eng.adapters and os.path.isdir(folder(loop, 0))
    assert loop.routes.acquire("policy-v0") == lease  # asked by its versioned name: routable
    loop.routes.release(lease)
    loop.routes.release(lease)  # both requests on v0 are done
    loop.poll_once()
    assert "policy-v0" not in eng.adapters and os.path.isdir(folder(loop, 0))  # unloaded
    assert loop.routes.acquire("policy-v0") is None  # no longer routable
    loop.poll_once()
    assert not os.path.exists(folder(loop, 0))  # deleted one poll after the unload
    assert list(eng.adapters) == ["policy-v1"]
    tr.close()


def test_wrong_base_is_refused_and_the_replica_keeps_serving(char_model_dir, bucket, tmp_path):
    tr = LoraTrainer(char_model_dir, bucket)
    eng, loop = lora_loop(tr, bucket, tmp_path)
    tr.publish()
    loop.poll_once()
    tr.publish()
    old = set_manifest_base(bucket, "0123456789abcdef")  # another base model's adapter
    assert loop.poll_once() is None
    assert loop.served_version == 0 and loop.status == "error"
    assert loop.last_error.startswith("RunRefusedError: WrongBaseModelError")
    assert "0123456789abcdef" in loop.last_error and "MODEL=" in loop.last_error
    assert list(eng.adapters) == ["policy-v0"] and loop.held.version == 0  # nothing pulled
    hb = json.loads(loop.store.read_bytes(heartbeat_path("r0")))
    assert hb["status"] == "error" and "WrongBaseModelError" in hb["last_error"]
    assert hb["held_version"] == 0
    with open(os.path.join(bucket, "manifest.json"), "wb") as f:
        f.write(old)  # the run's own manifest again
    assert loop.poll_once().version == 1 and loop.status == "ok"
    tr.close()


def test_a_run_of_the_other_kind_is_refused(char_model_dir, tmp_path):
    full = Trainer(char_model_dir, str(tmp_path / "full"))
    full.publish()
    adapter_run = LoraTrainer(char_model_dir, str(tmp_path / "lora"))
    adapter_run.publish()
    eng, loop = lora_loop(adapter_run, str(tmp_path / "full"), tmp_path, rid="lora-on-full")
    assert loop.poll_once() is None and eng.adapters == {} and loop.served_version is None
    assert isinstance(loop._last_exc, RunRefusedError)
    assert "full-weight run" in loop.last_error and "ADAPTER" in loop.last_error
    shapes = {n: a.shape for n, a in full.bits.items()}
    weights = FakeEngine(shapes)
    loop2 = SyncLoop(str(tmp_path / "lora"), weights, "full-on-lora", stage_dir=str(tmp_path / "s"))
    loop2.connect()
    assert loop2.poll_once() is None and weights.applies == [] and weights.pauses == 0
    assert "lora adapter run" in loop2.last_error and "ADAPTER=lora" in loop2.last_error
    full.close()
    adapter_run.close()


def test_rank_above_max_lora_rank_is_refused(char_model_dir, bucket, tmp_path):
    tr = LoraTrainer(char_model_dir, bucket, rank=16)
    eng, loop = lora_loop(tr, bucket, tmp_path, max_rank=8)
    tr.publish()
    assert loop.poll_once() is None and eng.calls == []
    assert "rank is 16" in loop.last_error and "MAX_LORA_RANK=16" in loop.last_error
    tr.close()


def test_failed_load_keeps_the_old_version_and_is_retried(char_model_dir, bucket, tmp_path, caplog):
    tr = LoraTrainer(char_model_dir, bucket)
    eng, loop = lora_loop(tr, bucket, tmp_path)
    tr.publish()
    loop.poll_once()
    tr.publish()
    eng.fail_load = 1
    with caplog.at_level(logging.WARNING, logger="rollout.sync"):
        assert loop.poll_once() is None
    assert loop.served_version == 0 and loop.routes.current.version == 0
    # reported: the engine's error in last_error and the heartbeat, what failed in the log line
    engine_error = "EngineControlError: POST /v1/load_lora_adapter: expected 2xx, found 500"
    assert loop.status == "error" and loop.errors == 1 and loop.last_error == engine_error
    hb = json.loads(loop.store.read_bytes(heartbeat_path("r0")))
    assert (hb["status"], hb["held_version"], hb["last_error"]) == ("error", 0, engine_error)
    logged = [r.getMessage() for r in caplog.records if r.name == "rollout.sync"]
    what = "load of adapter v1 failed; retrying at the next poll"
    assert f"{what}: {engine_error} (serving v0, errors=1)" in logged, logged
    rec = loop.poll_once()  # nothing new in the bucket: the held v1 is loaded again
    assert rec.version == 1 and loop.routes.current == Lease("policy-v1", 1)
    assert loop.status == "ok" and loop.errors == 1  # recovered; the count of errors stays
    assert eng.calls.count(("load", "policy-v1")) == 2
    for n, a in tr.versions[1].items():
        assert np.array_equal(eng.adapters["policy-v1"][n], a), n
    tr.close()


def test_restart_unloads_what_a_previous_life_left(char_model_dir, bucket, tmp_path):
    tr = LoraTrainer(char_model_dir, bucket, anchor_every=2)
    eng, first = lora_loop(tr, bucket, tmp_path)
    tr.publish()
    first.poll_once()
    tr.publish()
    first.poll_once()  # v1 loaded; the process then dies without cleaning up
    half = folder(first, 2) + ".tmp-123-abcdef"
    os.makedirs(half)  # a folder write cut short
    eng.adapters["other-v1"] = {}  # not this replica's name: left alone
    tr.publish()
    eng2, again = lora_loop(tr, bucket, tmp_path, engine=eng)
    assert list(eng.adapters) == ["other-v1"] and not os.path.exists(half)
    rec = again.poll_once()
    assert rec.version == 2 and rec.kind == "anchor" and again.routes.current.version == 2
    assert sorted(eng.adapters) == ["other-v1", "policy-v2"]
    tr.close()
