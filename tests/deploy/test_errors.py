"""Deploy errors: no HF_TOKEN, Spaces that end in BUILD_ERROR / RUNTIME_ERROR / PAUSED, a wait that
times out, and a checkout without the Space files. Each message names what is wrong, the Space URL
and how to read its logs; nothing secret is in any message."""

from __future__ import annotations

import io

import pytest

from tools.deploy_spaces import main
from tools.space_config import DeployError
from tools.space_stage import stage_space

from .conftest import TOKEN, FakeHfApi


def test_no_token_names_hf_token(make_deployer, monkeypatch):
    api = FakeHfApi()
    with pytest.raises(DeployError, match="HF_TOKEN is not set") as e:
        make_deployer(api=api, out=io.StringIO(), token=None).run()
    assert "huggingface.co/settings/tokens" in str(e.value)
    assert api.calls == []


def test_cli_without_token_exits_1_with_the_message(monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert main(["--owner", "alice", "--no-wait"]) == 1
    assert "error: HF_TOKEN is not set" in capsys.readouterr().err


@pytest.mark.parametrize(
    "stage, why",
    [
        ("BUILD_ERROR", "the Docker image failed to build"),
        ("RUNTIME_ERROR", "the container exited or failed its health check"),
    ],
)
def test_space_failure_names_url_and_logs(make_deployer, stage, why):
    api = FakeHfApi(stages={"alice/deltasync-rollout": ["BUILDING", "BUILDING", stage]})
    out = io.StringIO()
    with pytest.raises(DeployError) as e:
        make_deployer(api=api, out=out).run()
    msg = str(e.value)
    assert "Space alice/deltasync-rollout (https://alice-deltasync-rollout.hf.space)" in msg
    assert f"expected RUNNING, found {stage} ({why}): fake {stage.lower()} message" in msg
    assert "hf spaces logs alice/deltasync-rollout --build" in msg
    assert "https://huggingface.co/spaces/alice/deltasync-rollout?logs=container" in msg
    assert TOKEN not in msg and TOKEN not in out.getvalue()
    assert "make train" not in out.getvalue()


def test_a_stale_error_stage_counts_only_after_the_grace_period(make_deployer, clock):
    # the previous deploy's RUNTIME_ERROR, never replaced: reported once grace_s has passed
    api = FakeHfApi(stages={"alice/deltasync-wordle": ["RUNTIME_ERROR"]})
    with pytest.raises(DeployError, match="alice/deltasync-wordle .* found RUNTIME_ERROR"):
        make_deployer(api=api, out=io.StringIO(), grace_s=30.0).run()
    assert clock.now == 30.0


def test_paused_space_says_how_to_restart(make_deployer):
    api = FakeHfApi(stages={"alice/deltasync-dashboard": ["BUILDING", "PAUSED"]})
    with pytest.raises(DeployError, match="found PAUSED .*restart it from its settings"):
        make_deployer(api=api, out=io.StringIO()).run()


def test_timeout_lists_the_waiting_spaces(make_deployer, clock):
    api = FakeHfApi(stages={"alice/deltasync-rollout": ["BUILDING"]})
    with pytest.raises(DeployError) as e:
        make_deployer(api=api, out=io.StringIO(), timeout_s=120.0).run()
    msg = str(e.value)
    assert "expected every Space RUNNING within 120s" in msg
    assert "alice/deltasync-rollout (BUILDING)" in msg and "--timeout-s" in msg
    assert "deltasync-wordle (" not in msg
    assert clock.now == 120.0


def test_missing_space_files_are_reported(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    with pytest.raises(DeployError, match="run from the repository root .* or pass --repo-root"):
        stage_space(str(tmp_path), "spaces/vllm-rollout", str(tmp_path / "out"))


def test_readme_without_docker_front_matter_is_refused(tmp_path):
    for p in ("pyproject.toml", "shared/deltasync/__init__.py", "spaces/x/Dockerfile"):
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text("")
    (tmp_path / "spaces/x/README.md").write_text("---\nsdk: gradio\n---\n# x\n")
    (tmp_path / "out").mkdir()
    with pytest.raises(
        DeployError, match="expected sdk: docker and app_port: 7860, found sdk: 'gradio'"
    ):
        stage_space(str(tmp_path), "spaces/x", str(tmp_path / "out"))
