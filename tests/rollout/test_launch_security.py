"""What the launcher gives vLLM: 127.0.0.1 only, a public model name, and no secrets it does not
need; and the front's security settings read from the environment (no vLLM started). Each check
runs for a full-weight replica and for a LoRA replica (``ADAPTER=lora``: ``--enable-lora`` and
vLLM's runtime adapter routes, which stay on 127.0.0.1 like the dev-mode routes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.config import DEFAULT_MAX_BODY_BYTES, ConfigError, RolloutConfig, served_name_for
from rollout.launch import vllm_command, vllm_env

SPACE = Path(__file__).resolve().parents[2] / "spaces" / "vllm-rollout"
BASE = {"BUCKET": "file:///tmp/b", "MODEL": "Qwen/Qwen3-0.6B"}
SECRETS = {
    "HF_TOKEN": "hf_x",
    "HUGGING_FACE_HUB_TOKEN": "hf_y",
    "CONTROL_TOKEN": "ctl",
    "ROLLOUT_API_KEY": "key",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "PATH": "/usr/bin",
}


ADAPTERS = pytest.mark.parametrize("adapter", [None, "lora"], ids=["full", "lora"])


def _arg(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _env(adapter: str | None, **more: str) -> dict[str, str]:
    """A replica's environment: ``BASE`` with ``ADAPTER`` when given, and ``more``."""
    return {**BASE, **({"ADAPTER": adapter} if adapter else {}), **more}


@ADAPTERS
def test_vllm_listens_on_loopback_only(adapter):
    cfg = RolloutConfig.from_env(_env(adapter))
    cmd = vllm_command("Qwen/Qwen3-0.6B", 8123, lora=cfg.lora_args)
    assert _arg(cmd, "--host") == "127.0.0.1" and _arg(cmd, "--port") == "8123"
    assert cmd.count("--host") == 1 and cmd.count("--port") == 1
    assert ("--enable-lora" in cmd) == (adapter == "lora")


@ADAPTERS
@pytest.mark.parametrize("arg", ["--host", "--host=0.0.0.0", "--port", "--served-model-name=x"])
def test_extra_args_cannot_move_vllm_off_loopback_or_rename_it(adapter, arg):
    with pytest.raises(ConfigError, match="VLLM_EXTRA_ARGS"):
        RolloutConfig.from_env(_env(adapter, VLLM_EXTRA_ARGS=f"--enforce-eager {arg} 0.0.0.0"))


def test_served_name_is_never_a_local_path(tmp_path):
    folder = tmp_path / "runs" / "my-model"
    folder.mkdir(parents=True)
    assert served_name_for(str(folder)) == "my-model"
    assert served_name_for(str(folder) + "/") == "my-model"
    assert served_name_for("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert served_name_for(str(folder), "public-name") == "public-name"
    cmd = vllm_command(str(folder), 8000)
    assert _arg(cmd, "--served-model-name") == "my-model"
    assert _arg(cmd, "--model") == str(folder)
    cfg = RolloutConfig.from_env({**BASE, "MODEL": str(folder)})
    assert cfg.model_name == "my-model"
    cfg = RolloutConfig.from_env({**BASE, "MODEL": str(folder), "SERVED_MODEL_NAME": "pub"})
    assert cfg.model_name == "pub"


@ADAPTERS
def test_child_env_drops_front_secrets_and_accepts_any_model_name(tmp_path, adapter):
    lora = adapter == "lora"
    env = vllm_env({**SECRETS}, "Qwen/Qwen3-0.6B", lora)  # a hub id: vLLM may need HF_TOKEN
    for name in ("CONTROL_TOKEN", "ROLLOUT_API_KEY", "AWS_SECRET_ACCESS_KEY"):
        assert name not in env
    assert env["HF_TOKEN"] == "hf_x" and env["PATH"] == "/usr/bin"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_SKIP_MODEL_NAME_VALIDATION"] == "1"
    assert env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == ("True" if lora else None)
    assert str(SPACE) in env["PYTHONPATH"]
    local = vllm_env({**SECRETS}, str(tmp_path), lora)  # a local folder: nothing to download
    for name in ("CONTROL_TOKEN", "ROLLOUT_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        assert name not in local
    assert vllm_env({**SECRETS}, "s3://bucket/model", lora)["AWS_SECRET_ACCESS_KEY"] == "aws"


@ADAPTERS
def test_api_key_and_body_limit_from_env_and_hidden_from_repr(adapter):
    cfg = RolloutConfig.from_env(_env(adapter))
    assert cfg.api_key is None and cfg.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 * 1024**2
    cfg = RolloutConfig.from_env(
        _env(adapter, ROLLOUT_API_KEY="s3cr3t", MAX_BODY_BYTES="65536", CONTROL_TOKEN="ctl-9")
    )
    assert cfg.api_key == "s3cr3t" and cfg.max_body_bytes == 65536 and cfg.adapter == adapter
    assert "s3cr3t" not in repr(cfg) and "ctl-9" not in repr(cfg)
    with pytest.raises(ConfigError, match="MAX_BODY_BYTES"):
        RolloutConfig.from_env(_env(adapter, MAX_BODY_BYTES="lots"))
    with pytest.raises(ConfigError, match="MAX_BODY_BYTES"):
        RolloutConfig.from_env(_env(adapter, MAX_BODY_BYTES="10"))


def test_dockerfile_runs_python3():
    text = (SPACE / "Dockerfile").read_text()
    cmd_lines = [ln for ln in text.splitlines() if ln.startswith(("CMD", "    CMD"))]
    assert cmd_lines and all("python3 " in ln or '"python3"' in ln for ln in cmd_lines)
    assert '"python"' not in text and "CMD python " not in text
