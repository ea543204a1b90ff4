"""The deploy plan and its dry run: which Hub calls in which order, secrets masked, Space URLs,
the printed `make train` line, flag parsing, and that importing the deploy module stays light."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tools.deploy_spaces import Deployer
from tools.space_config import MASK, DeployConfig, parse_args
from tools.space_plan import space_specs
from tools.space_stage import HubCall, read_front_matter, space_url

from .conftest import CONTROL, TOKEN, FakeHfApi


def dry_run(make_deployer, **kw) -> tuple[str, str, FakeHfApi]:
    api, out = FakeHfApi(), io.StringIO()
    line = make_deployer(api=api, out=out, owner="alice", **kw).run(dry_run=True)
    return out.getvalue(), line, api


def test_dry_run_prints_every_call_in_order_and_makes_none(make_deployer):
    text, line, api = dry_run(make_deployer)
    assert api.calls == [], "a dry run must not touch the Hub"
    calls = [
        ln.removeprefix("would call: ").split("(")[0]
        for ln in text.splitlines()
        if ln.startswith("would call: ")
    ]

    def per_space(secrets: int, variables: int) -> list[str]:
        middle = ["add_space_secret"] * secrets + ["add_space_variable"] * variables
        return ["create_repo", *middle, "request_space_hardware", "upload_folder"]

    # the rollout Space's variables: BUCKET, MODEL, POLL_INTERVAL_S, RUN_PUBLIC_KEY
    assert calls == ["create_bucket", *per_space(2, 4), *per_space(0, 0), *per_space(1, 1)]
    assert "create_bucket(bucket_id='alice/deltasync-run', private=True, exist_ok=True)" in text
    assert (
        "create_repo(repo_id='alice/deltasync-rollout', repo_type='space', space_sdk='docker', "
        "private=True, exist_ok=True)" in text
    )
    assert (
        "request_space_hardware(repo_id='alice/deltasync-rollout', hardware='l4x1', "
        "sleep_time=3600)" in text
    )
    assert "request_space_hardware(repo_id='alice/deltasync-wordle', hardware='cpu-basic')" in text
    assert "key='BUCKET', value='hf://buckets/alice/deltasync-run'" in text
    assert "key='MODEL', value='Qwen/Qwen3-0.6B'" in text
    assert "repo_id='alice/deltasync-dashboard', key='BUCKET', value='hf://buckets/alice/" in text


def test_dry_run_masks_every_secret(make_deployer):
    text, _, _ = dry_run(make_deployer)
    assert TOKEN not in text and CONTROL not in text
    assert f"key='HF_TOKEN', value='{MASK}'" in text
    assert f"key='CONTROL_TOKEN', value='{MASK}'" in text
    assert f"HfApi(token='{MASK}')" in text


def test_dry_run_shows_the_staged_upload(make_deployer):
    text, _, _ = dry_run(make_deployer)
    upload = next(
        ln for ln in text.splitlines() if "upload_folder(repo_id='alice/deltasync-rollout'" in ln
    )
    for part in (
        "Dockerfile",
        "README.md",
        "pyproject.toml",
        "shared/ (",
        "spaces/vllm-rollout/ (",
    ):
        assert part in upload


def test_dry_run_prints_urls_and_the_make_train_line(make_deployer):
    text, line, _ = dry_run(make_deployer, model="Qwen/Qwen3-1.7B", bucket="my.run")
    assert line == (
        "make train BUCKET=alice/my.run VLLM_URL=https://alice-deltasync-rollout.hf.space "
        "ENV_URL=https://alice-deltasync-wordle.hf.space MODEL=Qwen/Qwen3-1.7B"
    )
    assert f"  {line}" in text.splitlines()
    assert "https://alice-deltasync-dashboard.hf.space" in text


def test_dry_run_without_token_or_owner_still_plans(make_deployer):
    api, out = FakeHfApi(), io.StringIO()
    d = make_deployer(api=api, out=out, token=None)
    d.run(dry_run=True)
    assert api.calls == []
    assert "would call: whoami()" in out.getvalue()
    assert "<your-username>/deltasync-rollout" in out.getvalue()


def test_duplicate_plan_copies_spaces_and_uploads_nothing(make_deployer):
    text, _, _ = dry_run(make_deployer, from_owner="deltasync-org")
    assert "upload_folder" not in text and "create_repo" not in text
    assert (
        "duplicate_repo(from_id='deltasync-org/deltasync-rollout', to_id='alice/deltasync-rollout',"
        " repo_type='space', private=True, exist_ok=True)" in text
    )


@pytest.mark.parametrize(
    "owner, name, url",
    [
        ("alice", "deltasync-rollout", "https://alice-deltasync-rollout.hf.space"),
        ("Alice_B", "My.Space_x", "https://alice-b-my-space-x.hf.space"),
    ],
)
def test_space_url(owner, name, url):
    assert space_url(owner, name) == url


def test_render_masks_by_argument_name():
    call = HubCall("add_space_secret", dict(repo_id="a/b", key="K", value="s3cret"), ("value",))
    assert call.render() == f"add_space_secret(repo_id='a/b', key='K', value='{MASK}')"


def test_front_matter_of_every_space_readme():
    import os

    from .conftest import REPO_ROOT

    for folder in ("vllm-rollout", "wordle-env", "dashboard"):
        with open(os.path.join(REPO_ROOT, "spaces", folder, "README.md"), encoding="utf-8") as f:
            meta = read_front_matter(f.read())
        assert meta["sdk"] == "docker" and meta["app_port"] == "7860", folder


def test_parse_args_reads_tokens_from_env_and_bucket_owner():
    cfg, dry, down = parse_args(
        ["--bucket", "bob/run1", "--rollout-hardware", "a10g-small", "--dry-run"],
        env={"HF_TOKEN": "hf_x", "CONTROL_TOKEN": "c"},
    )
    assert dry and not down and cfg.owner == "bob" and cfg.bucket_name == "run1"
    assert cfg.token == "hf_x" and cfg.control_token == "c" and cfg.rollout_hardware == "a10g-small"
    assert "hf_x" not in repr(cfg)


def test_config_rejects_conflicting_owner():
    with pytest.raises(ValueError, match="names owner 'bob' but --owner is 'alice'"):
        DeployConfig(owner="alice", bucket="bob/run")


def test_unknown_hardware_is_refused_before_any_call(make_deployer):
    api = FakeHfApi()
    with pytest.raises(ValueError, match="unknown hardware 'h100-imaginary'"):
        make_deployer(api=api, out=io.StringIO(), rollout_hardware="h100-imaginary").run()
    assert api.names() == ["whoami"]


def test_generated_control_token_differs_per_deploy():
    a = Deployer(DeployConfig(owner="x"), out=io.StringIO())
    b = Deployer(DeployConfig(owner="x"), out=io.StringIO())
    sa = a.specs("x")[0].secrets["CONTROL_TOKEN"]
    assert len(sa) >= 40 and sa != b.specs("x")[0].secrets["CONTROL_TOKEN"]
    assert a.specs("x")[0].secrets["CONTROL_TOKEN"] == sa  # stable within one deploy


def test_the_plan_refuses_a_config_without_control_token():
    cfg = DeployConfig(owner="x")
    with pytest.raises(ValueError, match="expected DeployConfig.control_token to be set"):
        space_specs(cfg, "x")
    secrets = space_specs(DeployConfig(owner="x", control_token="given"), "x")[0].secrets
    assert secrets["CONTROL_TOKEN"] == "given"


def test_importing_deploy_does_not_import_huggingface_hub():
    code = "import sys, tools.deploy_spaces; print('huggingface_hub' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("from_owner", [None, "deltasync-org"])
def test_every_planned_call_binds_to_the_installed_hfapi(from_owner):
    """The plan's keyword arguments match huggingface_hub's own signatures (no network)."""
    import inspect

    from huggingface_hub import HfApi

    d = Deployer(DeployConfig(token="t", owner="alice", from_owner=from_owner), out=io.StringIO())
    for call in d.plan("alice"):
        kwargs = dict(call.kwargs)
        if call.stage is not None:
            kwargs["folder_path"] = "/tmp/staged"
        inspect.signature(getattr(HfApi, call.fn)).bind(None, **kwargs)
    for fn in ("whoami", "get_space_runtime"):
        assert callable(getattr(HfApi, fn))
    inspect.signature(HfApi.get_space_runtime).bind(None, "alice/x")


def test_spaces_are_private_unless_public_is_asked_for(make_deployer, capsys):
    assert parse_args([], env={})[0].private_spaces is True
    assert parse_args(["--private-spaces"], env={})[0].private_spaces is True
    assert parse_args(["--public"], env={})[0].private_spaces is False
    with pytest.raises(SystemExit) as e:
        parse_args(["--public", "--private-spaces"], env={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --public and --private-spaces contradict each other; give one of them" in err
    text, _, _ = dry_run(make_deployer)
    repos = [ln for ln in text.splitlines() if "create_repo(" in ln]
    # all three are private: the trainer sends its HF token to each (the Wordle WebSocket too)
    assert len(repos) == 3 and all("private=True" in ln for ln in repos)
    text, _, _ = dry_run(make_deployer, private_spaces=False)
    repos = [ln for ln in text.splitlines() if "create_repo(" in ln]
    assert len(repos) == 3 and all("private=False" in ln for ln in repos)
    assert "create_bucket(bucket_id='alice/deltasync-run', private=True" in text
