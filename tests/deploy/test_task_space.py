"""``make spaces TASK=...`` deploys the task's own environment Space (``Task.space``): the
number-guess example's folder as ``<prefix>-number-guess``, its key as ``NUMBER_GUESS_API_KEY``
(kept like Wordle's and handed to the trainer as ``WORDLE_API_KEY``), the printed ``make train``
line naming the task; a task that cannot be loaded or has no Space is refused before any Hub
call; ``--only env`` redeploys the environment Space alone. Wordle's plan is unchanged without
``TASK`` (test_plan.py)."""

from __future__ import annotations

import io
import os
import stat

import pytest

from tools.env_space import env_space
from tools.space_config import DeployError, parse_args
from trainer.task.base import Task

from .conftest import FakeHfApi

# a task without a Space of its own (``TASK=tests.deploy.test_task_space:NO_SPACE``)
NO_SPACE = Task(
    name="no_space",
    dataset=lambda rows, seed: None,
    eval_seeds=lambda count: [],
    eval_seed_count=0,
    reward_funcs=[lambda prompts, completions, **_: [0.0] * len(completions)],
    evaluate=lambda *a: {},
)


def test_the_task_names_its_space_its_name_and_its_key():
    number = env_space("number_guess")
    assert (number.folder, number.key) == ("examples/number_guess/space", "number-guess")
    assert number.key_variable == "NUMBER_GUESS_API_KEY" and not number.default
    wordle = env_space()
    assert (wordle.folder, wordle.key, wordle.key_variable) == (
        "spaces/wordle-env",
        "wordle",
        "WORDLE_API_KEY",
    )


def test_a_dry_run_deploys_the_tasks_folder_as_its_own_space(make_deployer):
    api, out = FakeHfApi(), io.StringIO()
    line = make_deployer(api=api, out=out, owner="alice", task="number_guess").run(dry_run=True)
    text = out.getvalue()
    upload = next(
        ln
        for ln in text.splitlines()
        if "upload_folder(repo_id='alice/deltasync-number-guess'" in ln
    )
    # the folder is its own build context: its files, no deltasync
    for part in ("Dockerfile", "README.md", "game.py", "server.py", "pyproject.toml"):
        assert part in upload
    assert "shared/" not in upload and "deploy examples/number_guess/space" in upload
    assert "alice/deltasync-wordle" not in text
    assert line == (
        "make train TASK=number_guess BUCKET=alice/deltasync-run "
        "VLLM_URL=https://alice-deltasync-rollout.hf.space "
        "ENV_URL=https://alice-deltasync-number-guess.hf.space MODEL=Qwen/Qwen3-0.6B"
    )
    assert "number-guess: https://alice-deltasync-number-guess.hf.space" in text


def test_a_public_space_gets_its_key_and_the_trainer_reads_it(make_deployer, tmp_path):
    api, out = FakeHfApi(), io.StringIO()
    d = make_deployer(api=api, out=out, task="number_guess", private_spaces=False)
    line = d.run()
    path = tmp_path / "state" / "alice--deltasync-number-guess.number_guess_api_key"
    key = path.read_text().strip()
    assert len(key) >= 40 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secrets = [
        kw
        for fn, kw in api.calls
        if fn == "add_space_secret" and kw["repo_id"] == "alice/deltasync-number-guess"
    ]
    assert [(s["key"], s["value"]) for s in secrets] == [("NUMBER_GUESS_API_KEY", key)]
    # the line hands the Space's key to the trainer in the variable it reads, from the file
    assert f'WORDLE_API_KEY="$(cat {path})" ' in line and "make train TASK=number_guess " in line
    assert key not in out.getvalue()


def test_a_given_key_comes_from_the_tasks_variable():
    cfg, _, _ = parse_args(
        ["--task", "number_guess", "--public"],
        env={"NUMBER_GUESS_API_KEY": "k-number", "WORDLE_API_KEY": "k-wordle"},
    )
    assert cfg.task == "number_guess" and cfg.wordle_api_key == "k-number"
    assert parse_args([], env={"WORDLE_API_KEY": "k-wordle"})[0].wordle_api_key == "k-wordle"


@pytest.mark.parametrize(
    "task, says",
    [
        ("chess", "TASK=chess: --task 'chess': expected one of number_guess, wordle or"),
        ("tests.deploy.test_task_space:NO_SPACE", "found space=None in task 'no_space'"),
    ],
)
def test_a_task_without_a_space_is_refused_before_any_call(task, says, capsys, make_deployer):
    with pytest.raises(SystemExit) as e:
        parse_args(["--task", task], env={})
    assert e.value.code == 2
    assert says in " ".join(capsys.readouterr().err.split())
    api = FakeHfApi()
    with pytest.raises(DeployError, match="TASK="):
        make_deployer(api=api, out=io.StringIO(), owner="alice", task=task).run()
    assert api.calls == []


def test_only_env_redeploys_the_environment_space_alone(make_deployer):
    api = FakeHfApi()
    line = make_deployer(api=api, out=io.StringIO(), task="number_guess", only=("env",)).run()
    created = [kw["repo_id"] for fn, kw in api.calls if fn == "create_repo"]
    assert created == ["alice/deltasync-number-guess"]
    assert [fn for fn, _ in api.calls if fn == "upload_folder"] == ["upload_folder"]
    waited = {kw["repo_id"] for fn, kw in api.calls if fn == "get_space_runtime"}
    assert waited == {"alice/deltasync-number-guess"}
    assert "VLLM_URL=https://alice-deltasync-rollout.hf.space" in line  # the one deployed before
    with pytest.raises(SystemExit):
        parse_args(["--only", "wordle"], env={})
