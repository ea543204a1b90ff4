"""A full deploy against a recording fake HfApi: the calls and their order, what each Space's
upload contains (the deltasync package, the Dockerfile and README front matter at the root), the
wait until RUNNING with its progress lines, the generated CONTROL_TOKEN kept in a 0600 file, and
secrets never printed."""

from __future__ import annotations

import io
import os
import stat

from deltasync.signing import RunKey
from tools.space_stage import read_front_matter

from .conftest import CONTROL, TOKEN, FakeHfApi


def deploy(make_deployer, api=None, **kw):
    api = api or FakeHfApi()
    out = io.StringIO()
    line = make_deployer(api=api, out=out, **kw).run()
    return api, out.getvalue(), line


def test_calls_in_order_with_whoami_owner(make_deployer):
    api, _, line = deploy(make_deployer)
    names = api.names()
    assert names[:2] == ["whoami", "create_bucket"]
    assert names.count("create_repo") == 3 and names.count("upload_folder") == 3
    assert api.calls[1] == (
        "create_bucket",
        dict(bucket_id="alice/deltasync-run", private=True, exist_ok=True),
    )
    # per Space: repo first, secrets and variables and hardware before the upload that builds it
    for repo in ("alice/deltasync-rollout", "alice/deltasync-wordle", "alice/deltasync-dashboard"):
        mine = [n for n, kw in api.calls if kw.get("repo_id") == repo and n != "get_space_runtime"]
        assert mine[0] == "create_repo" and mine[-2:] == ["request_space_hardware", "upload_folder"]
    assert line.startswith("make train BUCKET=alice/deltasync-run VLLM_URL=https://alice-")


def test_secrets_and_variables_reach_the_spaces(make_deployer, tmp_path):
    api, _, _ = deploy(make_deployer, model="Qwen/Qwen3-1.7B", poll_interval_s=2.5)
    secrets = {
        (kw["repo_id"], kw["key"]): kw["value"] for n, kw in api.calls if n == "add_space_secret"
    }
    variables = {
        (kw["repo_id"], kw["key"]): kw["value"] for n, kw in api.calls if n == "add_space_variable"
    }
    assert secrets == {
        ("alice/deltasync-rollout", "HF_TOKEN"): TOKEN,
        ("alice/deltasync-rollout", "CONTROL_TOKEN"): CONTROL,
        ("alice/deltasync-dashboard", "HF_TOKEN"): TOKEN,
    }
    assert variables == {
        ("alice/deltasync-rollout", "BUCKET"): "hf://buckets/alice/deltasync-run",
        ("alice/deltasync-rollout", "MODEL"): "Qwen/Qwen3-1.7B",
        ("alice/deltasync-rollout", "POLL_INTERVAL_S"): "2.5",
        ("alice/deltasync-rollout", "RUN_PUBLIC_KEY"): RunKey.load(
            tmp_path / "state" / "run_key.pem"
        ).public_key,
        ("alice/deltasync-dashboard", "BUCKET"): "hf://buckets/alice/deltasync-run",
    }
    hw = {kw["repo_id"]: kw["hardware"] for n, kw in api.calls if n == "request_space_hardware"}
    assert hw == {
        "alice/deltasync-rollout": "l4x1",
        "alice/deltasync-wordle": "cpu-basic",
        "alice/deltasync-dashboard": "cpu-basic",
    }


def test_space_token_can_differ_from_the_deploy_token(make_deployer):
    api, _, _ = deploy(make_deployer, space_token="hf_read_only")
    values = {
        kw["value"] for n, kw in api.calls if n == "add_space_secret" and kw["key"] == "HF_TOKEN"
    }
    assert values == {"hf_read_only"}


def test_rollout_upload_layout(make_deployer):
    api, _, _ = deploy(make_deployer)
    files = api.uploads["alice/deltasync-rollout"]
    for path in (
        "Dockerfile",
        "Dockerfile.dockerignore",
        "README.md",
        "pyproject.toml",
        "shared/deltasync/__init__.py",
        "shared/deltasync/subscriber.py",
        "spaces/vllm-rollout/rollout/launch.py",
        "spaces/vllm-rollout/Dockerfile",
    ):
        assert path in files, path
    assert not [p for p in files if "__pycache__" in p or p.endswith((".pyc", ".nbi", ".nbc"))]
    assert not [p for p in files if p.startswith("spaces/") and not p.startswith("spaces/vllm")]
    meta = read_front_matter(files["README.md"])
    assert meta["sdk"] == "docker" and meta["app_port"] == "7860"
    # the root Dockerfile is the Space's own: its COPY paths match the staged layout
    dockerfile = files["Dockerfile"]
    assert (
        "COPY shared/ shared/" in dockerfile
        and "COPY --chown=1000:1000 spaces/vllm-rollout/" in dockerfile
    )
    call = next(kw for n, kw in api.calls if n == "upload_folder")
    assert call["repo_type"] == "space" and call["repo_id"] == "alice/deltasync-rollout"


def test_wordle_and_dashboard_uploads(make_deployer):
    api, _, _ = deploy(make_deployer)
    wordle = api.uploads["alice/deltasync-wordle"]
    assert "server/app.py" in wordle and "words/answers.txt" in wordle and "client.py" in wordle
    assert not any(path.startswith(("shared/", "spaces/")) for path in wordle)  # its own context
    assert read_front_matter(wordle["README.md"])["title"].startswith("Wordle")
    dash = api.uploads["alice/deltasync-dashboard"]
    assert "spaces/dashboard/dashboard/ui.py" in dash and "shared/deltasync/store.py" in dash


def test_waits_until_all_running_with_progress(make_deployer, clock):
    stages = {"alice/deltasync-rollout": ["BUILDING"] * 6 + ["APP_STARTING", "RUNNING"]}
    api, text, _ = deploy(make_deployer, api=FakeHfApi(stages=stages))
    progress = [ln for ln in text.splitlines() if ln.startswith("[")]
    assert progress[0].startswith("[0m00s] deltasync-rollout BUILDING | deltasync-wordle BUILDING")
    assert "deltasync-rollout RUNNING" in progress[-1]
    assert "all 3 Spaces are RUNNING after 0m35s" in text
    polled = [kw["repo_id"] for n, kw in api.calls if n == "get_space_runtime"]
    assert polled.count("alice/deltasync-wordle") == 3  # not polled again once RUNNING
    assert clock.now == 35.0


def test_no_wait_skips_polling(make_deployer):
    api, text, _ = deploy(make_deployer, wait=False)
    assert "get_space_runtime" not in [n for n, _ in api.calls]
    assert "make train" in text


def test_a_stale_running_stage_is_not_trusted_within_the_grace_period(make_deployer, clock):
    # a re-deploy: RUNNING (old build) until the Hub picks up the upload
    stages = {
        r: ["RUNNING", "RUNNING", "BUILDING", "RUNNING"]
        for r in ("alice/deltasync-rollout", "alice/deltasync-wordle", "alice/deltasync-dashboard")
    }
    api, text, _ = deploy(make_deployer, api=FakeHfApi(stages=stages))
    assert "all 3 Spaces are RUNNING after 0m15s" in text


def test_generated_control_token_is_saved_not_printed(make_deployer, tmp_path):
    api, text, _ = deploy(make_deployer, control_token=None)
    token = next(kw["value"] for n, kw in api.calls if kw.get("key") == "CONTROL_TOKEN")
    path = tmp_path / "state" / "alice--deltasync-rollout.control_token"
    assert path.read_text().strip() == token
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert token not in text and TOKEN not in text and str(path) in text


def test_duplicate_from_owner(make_deployer):
    api, _, _ = deploy(make_deployer, from_owner="deltasync-org", owner="bob")
    dups = [kw for n, kw in api.calls if n == "duplicate_repo"]
    assert [(d["from_id"], d["to_id"]) for d in dups] == [
        ("deltasync-org/deltasync-rollout", "bob/deltasync-rollout"),
        ("deltasync-org/deltasync-wordle", "bob/deltasync-wordle"),
        ("deltasync-org/deltasync-dashboard", "bob/deltasync-dashboard"),
    ]
    assert all(d["repo_type"] == "space" and d["exist_ok"] for d in dups)
    assert "upload_folder" not in api.names() and "whoami" not in api.names()


def test_the_run_key_is_made_once_and_kept_across_deploys(make_deployer, tmp_path):
    """The rollout Space gets RUN_PUBLIC_KEY of the run key the deploy keeps (mode 0600, the
    private key never printed); a second deploy reuses it, so replicas keep trusting the
    trainer."""
    api, out, _ = deploy(make_deployer)
    path = tmp_path / "state" / "run_key.pem"
    key = RunKey.load(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "PRIVATE KEY" not in out and f"RUN_PUBLIC_KEY={key.public_key}" in out

    def public_key(api):
        return [
            kw["value"]
            for n, kw in api.calls
            if n == "add_space_variable" and kw["key"] == "RUN_PUBLIC_KEY"
        ]

    assert public_key(api) == [key.public_key]
    api2, out2, _ = deploy(make_deployer)
    assert public_key(api2) == [key.public_key] and "reused from" in out2
