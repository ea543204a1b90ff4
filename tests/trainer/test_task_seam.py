"""The environment sits behind one seam (``trainer.task.base.Task``): nothing outside
``trainer/task/`` names Wordle or imports its modules, a task is picked by name or module path with
clear errors, and a second, different task (a single-turn letter puzzle served by its own OpenEnv
server, ``letter_task.py`` / ``letter_env.py`` beside this file) trains through the same trainer,
replica and bucket without a line of ``trainer/loop``, ``trainer/fleet`` or ``trainer/stack.py``
knowing it."""

from __future__ import annotations

import ast
import io
import logging
import tokenize
from pathlib import Path

import pytest

import trainer
from trainer.task.base import Task, TaskError, load_task

TRAINER = Path(trainer.__file__).parent
HERE = Path(__file__).parent  # letter_task.py, letter_env.py


@pytest.fixture(autouse=True)
def letter_on_path(monkeypatch):
    """``letter_task`` importable, as a user's own task module on PYTHONPATH would be (TRL's
    spawned rollout process inherits ``sys.path``)."""
    monkeypatch.syspath_prepend(str(HERE))


# What the rest of the trainer may import from trainer/task/: the seam itself and the tool-call
# renderer every tool task shares.
SEAM = {"trainer.task.base", "trainer.task.chat_format"}


def _outside_task() -> list[Path]:
    return [
        p for p in sorted(TRAINER.rglob("*.py")) if "task" not in p.relative_to(TRAINER).parts[:1]
    ]


def test_no_wordle_name_outside_the_task():
    found = []
    for path in _outside_task():
        source = path.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.NAME and "wordle" in tok.string.lower():
                found.append(f"{path.relative_to(TRAINER)}:{tok.start[0]} {tok.string}")
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module == "trainer.task":
                names = [f"trainer.task.{a.name}" for a in node.names]  # modules of the package
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("wordle_env") or (
                    name.startswith("trainer.task.") and name not in SEAM
                ):
                    found.append(f"{path.relative_to(TRAINER)}:{node.lineno} imports {name}")
    assert len(_outside_task()) >= 25  # the walk saw the trainer's files
    assert found == [], (
        f"expected the environment only behind trainer.task.base.Task, found {found}; reach it "
        "through the run's Task (cfg.task())"
    )


def test_load_task_by_name_and_by_module_path():
    wordle = load_task("wordle")
    assert isinstance(wordle, Task) and wordle.name == "wordle"
    assert load_task("trainer.task.wordle.task:TASK") is wordle
    letter = load_task("letter_task:TASK")
    assert letter.name == "letter" and letter.environment_factory is None and letter.reward_funcs
    number = load_task("number_guess")  # the example, a tool task with its own Space
    assert number is load_task("examples.number_guess.task:TASK")
    assert number.evaluate is None and number.space == "examples/number_guess/space"


@pytest.mark.parametrize(
    "spec, says",
    [
        ("chess", "expected one of number_guess, wordle or 'package.module:NAME'"),
        ("no_such_module_here:TASK", "cannot import 'no_such_module_here'"),
        ("trainer.task.wordle.task:episode_counts", "found function"),
    ],
)
def test_a_task_that_cannot_be_loaded_says_why(spec, says):
    with pytest.raises(TaskError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_task(spec)


def test_a_task_needs_an_environment_or_reward_functions():
    common = dict(
        dataset=lambda n, s: None, eval_seeds=lambda n: [], eval_seed_count=0, evaluate=dict
    )
    with pytest.raises(TaskError, match="found neither"):
        Task(name="empty", **common)
    with pytest.raises(TaskError, match="found both"):
        Task(name="both", environment_factory=object, reward_funcs=[print], **common)


def test_a_tool_task_without_evaluate_needs_what_the_generic_evaluation_plays():
    from trainer.task.base import TOOL_FIGURES
    from trainer.task.wordle.game_env import WordleToolEnv, eval_row

    common = dict(dataset=lambda n, s: None, eval_seeds=lambda n: [], eval_seed_count=0)
    with pytest.raises(TaskError, match="expected an evaluate function, or an .*found no eval_row"):
        Task(name="rowless", environment_factory=WordleToolEnv, **common)

    class NoUrl:  # what TRL alone needs: no arguments
        def reset(self, **row):
            return None

    with pytest.raises(TaskError, match=r"expected environment_factory\(env_url=None, env_he"):
        Task(name="no-url", environment_factory=NoUrl, eval_row=eval_row, **common)
    # a tool task with the generic evaluation declares its figures after the task's own
    task = Task(name="tool", environment_factory=WordleToolEnv, eval_row=eval_row, **common)
    assert task.figures == TOOL_FIGURES and task.evaluate is None


def test_the_command_line_picks_the_task(monkeypatch, capsys, caplog):
    from trainer.config import from_args

    monkeypatch.setenv("TASK", "letter_task:TASK")
    small = ["--eval-episodes", "16", "--eval-curve-episodes", "8"]
    picked = from_args(small)
    assert picked.task().name == "letter"
    # its local run has a folder of its own: a Wordle run's bucket is never resumed by it
    assert picked.run.run_id == "letter-local" and picked.run.run_dir.endswith("letter-local")
    assert from_args([*small, "--run-id", "mine"]).run.run_id == "mine"
    # the same from Python: the default lives in the run's settings, not in the command line
    from trainer.config import TrainConfig
    from trainer.settings import RunSettings

    flags = {"task": "letter_task:TASK", "eval_episodes": 16, "eval_curve_episodes": 8}
    assert TrainConfig.from_flags(**flags).run.run_id == "letter-local"
    assert TrainConfig.from_flags(**flags, bucket="user/my-run/").run.run_id == "my-run"
    assert RunSettings().run_id == "wordle-local"
    with pytest.raises(SystemExit) as e:  # argparse's error: the TaskError's message, exit 2
        from_args(["--task", "chess", *small])
    assert e.value.code == 2
    assert (
        "error: --task 'chess': expected one of number_guess, wordle or 'package.module:NAME'"
        in " ".join(capsys.readouterr().err.split())
    )
    # more held-out episodes than the task holds (the defaults 512 and 64): clamped to the task's
    # own count, and the log says so
    with caplog.at_level(logging.WARNING, logger="trainer"):
        cfg = from_args([])
    assert (cfg.eval.episodes, cfg.eval.curve_episodes) == (64, 64)
    assert "eval_episodes=512: the task holds 64 held-out evaluation seeds" in caplog.text
    assert "playing 64 (set --eval-episodes to choose fewer)" in caplog.text


@pytest.mark.slow
def test_a_second_task_trains_through_the_same_trainer_replica_and_bucket(tmp_path, e2e_warm_start):
    from trainer.config import TrainConfig
    from trainer.starting_point import initial_model

    from .small_task_run import small_task_run

    local = TrainConfig.from_flags(runs_root=str(tmp_path), **e2e_warm_start)
    model, _ = initial_model(local.run, local.task(), local.local_model)  # the cached local model
    # 2 steps through the bucket, the replica bit-exact, a paired evaluation (small_task_run)
    summary, served, steps = small_task_run(tmp_path, "letter_task:TASK", "letter", model=model)
    # the letter server scored every training episode and both evaluations, and rewards varied
    games = summary["train_games"]
    assert games >= 2 * 4 and served["answers"] >= games + 2 * 16
    assert 0 < served["rewarded"] < served["answers"], served
    assert all(0.0 <= s["reward"] <= 1.0 for s in steps)
    assert all(s["rewards/letter_reward"] == s["reward"] for s in steps)  # its one reward
    # its own figure (answer length), declared by the task, in the summary and each step's log
    assert [f["name"] for f in summary["figures"]] == ["answer_chars"]
    assert summary["train_figures"]["answer_chars"] > 0
    assert summary["eval_after"]["answer_chars"] > 0
    assert all("answer_chars" in row for row in summary["eval_curve"])
    assert all(s["games/answer_chars"] > 0 for s in steps)
