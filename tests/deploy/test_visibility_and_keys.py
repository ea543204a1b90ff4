"""Safe by default when public (issue 56): a deploy without --public makes repos an earlier
--public deploy left public private again (and says so in one line); CONTROL_TOKEN, and on a
public deploy ROLLOUT_API_KEY and WORDLE_API_KEY, are kept in 0600 files under the state dir,
saved before the first Hub call that writes and reused by every later deploy; the printed
`make train` line hands the keys to the trainer without printing them."""

from __future__ import annotations

import io
import os
import stat

import pytest

from tools.space_config import DeployError, parse_args

from .conftest import CONTROL, TOKEN, FakeHfApi

SPACES = ("alice/deltasync-rollout", "alice/deltasync-wordle", "alice/deltasync-dashboard")


def deploy(make_deployer, api=None, **kw):
    api = api or FakeHfApi()
    out = io.StringIO()
    line = make_deployer(api=api, out=out, **kw).run()
    return api, out.getvalue(), line


def secrets_of(api: FakeHfApi) -> dict[tuple[str, str], str]:
    return {
        (kw["repo_id"], kw["key"]): kw["value"] for n, kw in api.calls if n == "add_space_secret"
    }


def test_a_private_deploy_makes_spaces_left_public_private_again(make_deployer):
    api = FakeHfApi()
    _, text, _ = deploy(make_deployer, api=api, private_spaces=False)
    assert all(api.private[r] is False for r in SPACES)
    assert "update_repo_settings" not in api.names()  # created public, nothing to change
    api.calls.clear()
    _, text, _ = deploy(make_deployer, api=api)  # no --public
    updates = [kw for n, kw in api.calls if n == "update_repo_settings"]
    assert updates == [dict(repo_id=r, repo_type="space", private=True) for r in SPACES]
    assert all(api.private[r] is True for r in SPACES)
    for r in SPACES:
        lines = [ln for ln in text.splitlines() if f"Space {r} was public" in ln]
        assert lines == [
            f"Space {r} was public: made it private (update_repo_settings(repo_id='{r}', "
            "repo_type='space', private=True))"
        ]
    # a third deploy finds them private and changes nothing
    api.calls.clear()
    _, text, _ = deploy(make_deployer, api=api)
    assert "update_repo_settings" not in api.names() and "was public" not in text


def test_a_public_bucket_is_made_private_again(make_deployer):
    api = FakeHfApi()
    api.private["alice/deltasync-run"] = False  # made public earlier (--public-bucket)
    _, text, _ = deploy(make_deployer, api=api)
    assert ("update_bucket_settings", dict(bucket_id="alice/deltasync-run", private=True)) in (
        api.calls
    )
    assert "bucket alice/deltasync-run was public: made it private" in text


def test_duplicated_spaces_are_checked_too(make_deployer):
    api = FakeHfApi()
    api.private["bob/deltasync-wordle"] = False
    _, text, _ = deploy(make_deployer, api=api, from_owner="org", owner="bob")
    assert [kw["repo_id"] for n, kw in api.calls if n == "update_repo_settings"] == [
        "bob/deltasync-wordle"
    ]


def test_dry_run_says_it_would_check_visibility_and_calls_nothing(make_deployer):
    api, out = FakeHfApi(), io.StringIO()
    make_deployer(api=api, out=out, owner="alice").run(dry_run=True)
    text = out.getvalue()
    assert api.calls == []
    assert (
        "would check: Space alice/deltasync-rollout is private, else update_repo_settings("
        "repo_id='alice/deltasync-rollout', repo_type='space', private=True)" in text
    )
    assert "would check: bucket alice/deltasync-run is private, else update_bucket_settings(" in (
        text
    )


class FailingApi(FakeHfApi):
    """Refuses the first call that writes (create_bucket), as an expired token would."""

    def create_bucket(self, **kwargs):
        raise RuntimeError("403 Forbidden")


def test_control_token_is_saved_before_any_write_and_reused(make_deployer, tmp_path):
    path = tmp_path / "state" / "alice--deltasync-rollout.control_token"
    with pytest.raises(RuntimeError, match="403"):
        deploy(make_deployer, api=FailingApi(), control_token=None)
    saved = path.read_text().strip()
    assert len(saved) >= 40 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    api, text, _ = deploy(make_deployer, control_token=None)
    assert secrets_of(api)[("alice/deltasync-rollout", "CONTROL_TOKEN")] == saved
    assert f"CONTROL_TOKEN of alice/deltasync-rollout: reusing the one saved in {path}" in text
    api2, _, _ = deploy(make_deployer, control_token=None)
    assert secrets_of(api2)[("alice/deltasync-rollout", "CONTROL_TOKEN")] == saved
    assert saved not in text


def test_a_saved_file_readable_by_others_is_made_0600(make_deployer, tmp_path):
    path = tmp_path / "state" / "alice--deltasync-rollout.control_token"
    path.parent.mkdir()
    path.write_text("kept-token\n")
    os.chmod(path, 0o644)
    api, text, _ = deploy(make_deployer, control_token=None)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and "made it mode 0600" in text
    assert secrets_of(api)[("alice/deltasync-rollout", "CONTROL_TOKEN")] == "kept-token"


def test_an_empty_saved_file_is_a_specific_error(make_deployer, tmp_path):
    path = tmp_path / "state" / "alice--deltasync-rollout.control_token"
    path.parent.mkdir()
    path.write_text("\n")
    api = FakeHfApi()
    with pytest.raises(DeployError, match="found an empty file: delete it"):
        deploy(make_deployer, api=api, control_token=None)
    assert api.names() == ["whoami"]


def test_a_private_deploy_gives_no_api_keys(make_deployer, tmp_path):
    api, _, line = deploy(make_deployer)
    keys = {k for _, k in secrets_of(api)}
    assert "ROLLOUT_API_KEY" not in keys and "WORDLE_API_KEY" not in keys
    assert line.startswith("make train ")
    assert not list((tmp_path / "state").glob("*api_key"))


def test_a_public_deploy_keys_both_spaces_and_tells_the_trainer_how(make_deployer, tmp_path):
    api, text, line = deploy(make_deployer, private_spaces=False)
    s = secrets_of(api)
    rollout_key = s[("alice/deltasync-rollout", "ROLLOUT_API_KEY")]
    wordle_key = s[("alice/deltasync-wordle", "WORDLE_API_KEY")]
    rpath = tmp_path / "state" / "alice--deltasync-rollout.rollout_api_key"
    wpath = tmp_path / "state" / "alice--deltasync-wordle.wordle_api_key"
    assert rpath.read_text().strip() == rollout_key and wpath.read_text().strip() == wordle_key
    for p in (rpath, wpath):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert line.startswith(
        f'ROLLOUT_API_KEY="$(cat {rpath})" WORDLE_API_KEY="$(cat {wpath})" make train BUCKET='
    )
    for secret in (rollout_key, wordle_key, TOKEN, CONTROL):
        assert secret not in text
    # the next public deploy reuses both
    api2, _, _ = deploy(make_deployer, private_spaces=False)
    assert secrets_of(api2)[("alice/deltasync-rollout", "ROLLOUT_API_KEY")] == rollout_key
    assert secrets_of(api2)[("alice/deltasync-wordle", "WORDLE_API_KEY")] == wordle_key
    # a private deploy deletes them from the Spaces (the trainer sends its HF token there), keeps
    # the files, and the line has no key
    api3, text3, line3 = deploy(make_deployer)
    keys = {k for _, k in secrets_of(api3)}
    assert "ROLLOUT_API_KEY" not in keys and "WORDLE_API_KEY" not in keys
    deleted = [kw for n, kw in api3.calls if n == "delete_space_secret"]
    assert deleted == [
        dict(repo_id="alice/deltasync-rollout", key="ROLLOUT_API_KEY"),
        dict(repo_id="alice/deltasync-wordle", key="WORDLE_API_KEY"),
    ]
    assert f"ROLLOUT_API_KEY is kept in {rpath} for a public deploy" in text3
    assert line3.startswith("make train ") and rpath.exists() and wpath.exists()
    api4, _, _ = deploy(make_deployer, private_spaces=False)
    assert secrets_of(api4)[("alice/deltasync-rollout", "ROLLOUT_API_KEY")] == rollout_key


def test_given_keys_are_used_and_not_saved(make_deployer, tmp_path):
    api, text, line = deploy(
        make_deployer, private_spaces=False, rollout_api_key="given-r", wordle_api_key="given-w"
    )
    s = secrets_of(api)
    assert s[("alice/deltasync-rollout", "ROLLOUT_API_KEY")] == "given-r"
    assert s[("alice/deltasync-wordle", "WORDLE_API_KEY")] == "given-w"
    assert line.startswith("make train ") and "given-" not in text
    assert "the trainer reads ROLLOUT_API_KEY from the environment" in text


def test_keys_from_the_environment():
    cfg = parse_args(["--public"], env={"ROLLOUT_API_KEY": "r", "WORDLE_API_KEY": "w"})[0]
    assert cfg.rollout_api_key == "r" and cfg.wordle_api_key == "w"
    assert "'r'" not in repr(cfg) and "'w'" not in repr(cfg)


def test_the_visibility_calls_bind_to_the_installed_hfapi():
    """The calls made to check and set visibility match huggingface_hub's signatures."""
    import inspect

    from huggingface_hub import HfApi

    for fn, kwargs in (
        ("space_info", dict(repo_id="a/b")),
        ("bucket_info", dict(bucket_id="a/b")),
        ("update_repo_settings", dict(repo_id="a/b", repo_type="space", private=True)),
        ("update_bucket_settings", dict(bucket_id="a/b", private=True)),
        ("delete_space_secret", dict(repo_id="a/b", key="K")),
    ):
        inspect.signature(getattr(HfApi, fn)).bind(None, **kwargs)
