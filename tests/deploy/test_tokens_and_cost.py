"""Least privilege and cost: the Spaces' own tokens (SPACE_HF_TOKEN, DASHBOARD_HF_TOKEN) reach
only their Spaces and are never printed, reusing the deploy token warns once; paid Spaces get a
sleep time; ``--down`` (``make spaces-down``) pauses the rollout Space(s) and says how to
restart them. All against the recording fake Hub."""

from __future__ import annotations

import io
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from tools.deploy_spaces import main
from tools.space_config import (
    DEFAULT_SLEEP_TIME_S,
    MASK,
    TOKENS_URL,
    DeployConfig,
    DeployError,
    parse_args,
)

from .conftest import CONTROL, REPO_ROOT, TOKEN, FakeHfApi

SPACE_TOKEN = "hf_SPACE_rw_bucket_only_never_printed"
DASH_TOKEN = "hf_DASH_read_only_never_printed"


def run(make_deployer, dry_run=False, **kw):
    api, out = FakeHfApi(), io.StringIO()
    make_deployer(api=api, out=out, owner="alice", wait=False, **kw).run(dry_run=dry_run)
    return api, out.getvalue()


def secret_values(api: FakeHfApi) -> dict[tuple[str, str], str]:
    return {
        (kw["repo_id"].split("/")[1], kw["key"]): kw["value"]
        for n, kw in api.calls
        if n == "add_space_secret"
    }


def warnings_in(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("warning:")]


# ------------------------------------------------------------------------------------- tokens
def test_space_and_dashboard_tokens_go_to_their_spaces_without_warning(make_deployer):
    api, text = run(make_deployer, space_token=SPACE_TOKEN, dashboard_token=DASH_TOKEN)
    assert secret_values(api) == {
        ("deltasync-rollout", "HF_TOKEN"): SPACE_TOKEN,
        ("deltasync-rollout", "CONTROL_TOKEN"): CONTROL,
        ("deltasync-dashboard", "HF_TOKEN"): DASH_TOKEN,
    }
    assert warnings_in(text) == []
    for secret in (TOKEN, SPACE_TOKEN, DASH_TOKEN, CONTROL):
        assert secret not in text


def test_dashboard_falls_back_to_the_space_token(make_deployer):
    api, text = run(make_deployer, space_token=SPACE_TOKEN)
    secrets = secret_values(api)
    assert secrets[("deltasync-dashboard", "HF_TOKEN")] == SPACE_TOKEN
    assert TOKEN not in secrets.values() and warnings_in(text) == []


def test_reusing_the_deploy_token_works_but_warns_once(make_deployer):
    api, text = run(make_deployer)
    secrets = secret_values(api)
    assert secrets[("deltasync-rollout", "HF_TOKEN")] == TOKEN
    assert secrets[("deltasync-dashboard", "HF_TOKEN")] == TOKEN
    (warning,) = warnings_in(text)
    assert "the rollout and dashboard Spaces get your deploy token (HF_TOKEN)" in warning
    assert TOKENS_URL in warning and "bucket alice/deltasync-run" in warning
    assert "SPACE_HF_TOKEN" in warning and "DASHBOARD_HF_TOKEN" in warning
    assert TOKEN not in text
    # the deploy goes on: every Space is still created and uploaded
    assert api.names().count("upload_folder") == 3


def test_a_space_token_equal_to_the_deploy_token_still_warns(make_deployer):
    _, text = run(make_deployer, space_token=TOKEN, dashboard_token=DASH_TOKEN)
    (warning,) = warnings_in(text)
    assert warning.startswith("warning: the rollout Space gets your deploy token")


def test_only_the_dashboard_reusing_the_deploy_token_warns_for_it(make_deployer):
    _, text = run(make_deployer, space_token=SPACE_TOKEN, dashboard_token=TOKEN)
    (warning,) = warnings_in(text)
    assert warning.startswith("warning: the dashboard Space gets your deploy token")


def test_dry_run_masks_the_space_tokens_and_warns(make_deployer):
    api, text = run(make_deployer, dry_run=True, space_token=SPACE_TOKEN, dashboard_token=TOKEN)
    assert api.calls == []
    assert f"repo_id='alice/deltasync-rollout', key='HF_TOKEN', value='{MASK}'" in text
    assert f"repo_id='alice/deltasync-dashboard', key='HF_TOKEN', value='{MASK}'" in text
    assert len(warnings_in(text)) == 1
    for secret in (TOKEN, SPACE_TOKEN, CONTROL):
        assert secret not in text


def test_tokens_from_env_and_flags_and_never_in_repr():
    env = {"HF_TOKEN": TOKEN, "SPACE_HF_TOKEN": SPACE_TOKEN, "DASHBOARD_HF_TOKEN": DASH_TOKEN}
    cfg, _, _ = parse_args([], env=env)
    assert (cfg.token, cfg.space_token, cfg.dashboard_token) == (TOKEN, SPACE_TOKEN, DASH_TOKEN)
    for secret in (TOKEN, SPACE_TOKEN, DASH_TOKEN):
        assert secret not in repr(cfg)
    cfg, _, _ = parse_args(["--space-token", "hf_flag", "--dashboard-token", "hf_d"], env=env)
    assert (cfg.space_token, cfg.dashboard_token) == ("hf_flag", "hf_d")
    cfg, _, _ = parse_args([], env={"SPACES_HF_TOKEN": "hf_old_name"})
    assert cfg.space_token == "hf_old_name" and cfg.dashboard_token is None


# -------------------------------------------------------------------------------- sleep time
def hardware_calls(api: FakeHfApi) -> dict[str, dict]:
    return {kw["repo_id"].split("/")[1]: kw for n, kw in api.calls if n == "request_space_hardware"}


def test_paid_spaces_get_a_sleep_time_free_ones_none(make_deployer):
    api, _ = run(make_deployer, dashboard_hardware="cpu-upgrade")
    hw = hardware_calls(api)
    assert hw["deltasync-rollout"]["sleep_time"] == DEFAULT_SLEEP_TIME_S == 3600
    assert hw["deltasync-dashboard"]["sleep_time"] == DEFAULT_SLEEP_TIME_S
    assert "sleep_time" not in hw["deltasync-wordle"]  # cpu-basic: the Hub refuses to set it


def test_sleep_time_flag(make_deployer):
    assert parse_args([], env={})[0].sleep_time_s == 3600
    assert parse_args(["--sleep-time", "900"], env={})[0].sleep_time_s == 900
    assert parse_args(["--rollout-sleep-time-s", "-1"], env={})[0].sleep_time_s == -1
    api, _ = run(make_deployer, sleep_time_s=900)
    assert hardware_calls(api)["deltasync-rollout"]["sleep_time"] == 900
    api, _ = run(make_deployer, sleep_time_s=None)
    assert "sleep_time" not in hardware_calls(api)["deltasync-rollout"]


@pytest.mark.parametrize("bad", [0, -5])
def test_a_nonsense_sleep_time_is_refused(bad, capsys):
    with pytest.raises(ValueError, match=rf"expected --sleep-time SECONDS > 0 .*found {bad}"):
        DeployConfig(sleep_time_s=bad)
    with pytest.raises(SystemExit) as e:
        parse_args(["--sleep-time", str(bad)], env={})
    assert e.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert f"error: expected --sleep-time SECONDS > 0 (or -1: never sleep), found {bad}" in err


def test_duplicated_spaces_get_the_sleep_time_too(make_deployer):
    api, _ = run(make_deployer, from_owner="deltasync-org")
    assert hardware_calls(api)["deltasync-rollout"]["sleep_time"] == 3600


# ---------------------------------------------------------------------------------- down
def down(make_deployer, dry_run=False, api=None, **kw):
    api, out = api or FakeHfApi(), io.StringIO()
    paused = make_deployer(api=api, out=out, **kw).down(dry_run=dry_run)
    return api, out.getvalue(), paused


def test_down_pauses_the_rollout_space_and_says_how_to_restart(make_deployer):
    api, text, paused = down(make_deployer, bucket="bob/run1")
    assert paused == ["bob/deltasync-rollout"]
    assert api.calls == [("pause_space", {"repo_id": "bob/deltasync-rollout"})]
    assert "paused: bob/deltasync-rollout (a paused Space bills nothing)" in text
    assert "hf spaces restart bob/deltasync-rollout" in text
    assert "https://huggingface.co/spaces/bob/deltasync-rollout/settings" in text
    assert TOKEN not in text


def test_down_pauses_every_named_replica(make_deployer):
    api, _, paused = down(make_deployer, owner="bob", rollout_spaces=("r1", "r2"))
    assert paused == ["bob/r1", "bob/r2"]
    assert [kw["repo_id"] for n, kw in api.calls if n == "pause_space"] == paused


def test_down_dry_run_prints_the_calls_and_makes_none(make_deployer):
    api, text, _ = down(make_deployer, dry_run=True, token=None)
    assert api.calls == []
    assert "would call: whoami()" in text
    assert "would call: pause_space(repo_id='<your-username>/deltasync-rollout')" in text
    assert "would be paused" in text


def test_down_asks_whoami_without_an_owner(make_deployer):
    api, _, paused = down(make_deployer)
    assert api.names() == ["whoami", "pause_space"] and paused == ["alice/deltasync-rollout"]


def test_down_without_token_says_what_to_do(make_deployer):
    with pytest.raises(DeployError, match="HF_TOKEN is not set: pausing a Space needs"):
        down(make_deployer, token=None, owner="bob")


def test_down_on_a_missing_space_names_it_and_the_fix(make_deployer):
    class NotFound(Exception):
        response = SimpleNamespace(status_code=404)

    class Api(FakeHfApi):
        def pause_space(self, **kw):
            raise NotFound("404 Client Error")

    with pytest.raises(DeployError) as e:
        down(make_deployer, api=Api(), owner="bob", prefix="other")
    msg = str(e.value)
    assert "expected Space bob/other-rollout that this HF_TOKEN may pause, found 404" in msg
    assert "--prefix" in msg and TOKEN not in msg


def test_down_lets_other_hub_errors_through(make_deployer):
    class Api(FakeHfApi):
        def pause_space(self, **kw):
            raise ConnectionError("no network")

    with pytest.raises(ConnectionError):
        down(make_deployer, api=Api(), owner="bob")


def test_cli_down_flags(monkeypatch, capsys):
    cfg, dry, is_down = parse_args(["--down", "--rollout-space", "a", "--rollout-space", "b"], {})
    assert is_down and not dry and cfg.rollout_spaces == ("a", "b")
    with pytest.raises(SystemExit) as e:
        parse_args(["--rollout-space", "a"], env={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --rollout-space names Spaces to pause: use it with --down" in err
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert main(["--down", "--bucket", "bob/run", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would call: pause_space(repo_id='bob/deltasync-rollout')" in out
    assert main(["--down", "--bucket", "bob/run"]) == 1
    assert "error: HF_TOKEN is not set" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_spaces_down_runs_the_down_command():
    out = subprocess.run(
        ["make", "-n", "spaces-down", "BUCKET=bob/run", "DRY_RUN=1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '-m tools.deploy_spaces --down --bucket "bob/run"' in out and "--dry-run" in out


def test_down_pauses_through_the_installed_hfapi(make_deployer):
    """``down`` with the installed huggingface_hub's real ``HfApi`` (no fake; its HTTP client
    answered in-process): one POST to each Space's pause route with the deploy token, and a Space
    the Hub does not know becomes the error that names it."""
    httpx2 = pytest.importorskip("httpx2")
    hub_http = pytest.importorskip("huggingface_hub.utils._http")
    pauses: list[tuple[str, str, str | None]] = []

    def hub(request):
        path = request.url.path
        if not (path.startswith("/api/spaces/") and path.endswith("/pause")):
            return httpx2.Response(404)  # e.g. huggingface_hub's own /api/agent-harnesses
        pauses.append((request.method, path, request.headers.get("authorization")))
        if "/missing/" in path:
            return httpx2.Response(404, headers={"X-Error-Code": "RepoNotFound"})
        return httpx2.Response(200, json={"stage": "PAUSED", "hardware": None})

    hub_http.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(hub)))
    try:
        out = io.StringIO()
        deployer = make_deployer(out=out, owner="bob", rollout_spaces=("a", "b"))  # real HfApi
        assert deployer.down() == ["bob/a", "bob/b"] and "paused: bob/a, bob/b" in out.getvalue()
        auth = f"Bearer {TOKEN}"
        assert pauses == [
            ("POST", "/api/spaces/bob/a/pause", auth),
            ("POST", "/api/spaces/bob/b/pause", auth),
        ]
        missing = make_deployer(out=io.StringIO(), owner="missing", rollout_spaces=("r",))
        with pytest.raises(
            DeployError,
            match="expected Space missing/r that this HF_TOKEN may pause, found 404: check",
        ):
            missing.down()
        assert pauses[-1] == ("POST", "/api/spaces/missing/r/pause", auth)
    finally:
        hub_http.set_client_factory(hub_http.default_client_factory)
