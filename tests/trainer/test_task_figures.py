"""A task reports its own figures (``Task.figures``, ``deltasync.status.TaskFigure``): the letter
task's answer length reaches the step line, the bucket's metrics, the summary's parts and the
learning curve through the same path as Wordle's, with fakes for the rollouts and the publisher;
a figure returned undeclared is recorded with one warning; and a metrics file written before
figures were declared (Wordle's fields of their own) still reads."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltasync.status import LEGACY_FIGURES, TRAINER_METRICS_PATH, TaskFigure, TrainerMetrics
from deltasync.store import Store
from trainer.loop.learning_curve import HeldOutEvals
from trainer.loop.metrics import BucketMetricsCallback

HERE = Path(__file__).parent  # letter_task.py, letter_env.py


@pytest.fixture
def letter(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    import letter_task

    return letter_task


class _Tagger:
    """The rollout tagger's surface the metrics read: each step's games and their counts."""

    def __init__(self, steps: list[tuple[int, dict]]):
        self.steps, self.staleness, self.dropped, self.replica_version = steps, {0: 4}, 0, 1

    def take_games(self):
        games, counts = self.steps.pop(0)
        return SimpleNamespace(games=games, counts=Counter(counts), dropped=0)

    def left_in_queue(self) -> int:
        return 0


def _callback(store, task, tagger):
    return BucketMetricsCallback(
        store,
        "run",
        SimpleNamespace(published=[]),
        tagger=tagger,
        step_figures=task.step_figures,
        figures=task.figures,
    )


def _log(cb, step: int) -> None:
    cb.on_log(None, SimpleNamespace(global_step=step), None, logs={"loss": 0.1, "reward": 0.5})


def test_the_letter_tasks_own_figure_goes_through_the_same_path(letter, tmp_path, capsys):
    task = letter.TASK
    counts = letter.episode_counts([{"role": "assistant", "content": " apple "}])
    assert counts == {"chars": 5}
    store = Store("memory://task-figures-letter")
    cb = _callback(store, task, _Tagger([(4, {"chars": 22}), (0, {})]))
    _log(cb, 1)
    _log(cb, 2)
    out = capsys.readouterr().out
    # the step line: the declared figure under its label, not Wordle's
    assert "answer_length=5.5 games=4" in out and "answer_length=None games=0" in out
    assert "cons=" not in out and "valid=" not in out
    block = {"episodes": 2, "reward_mean": 0.5, "reward_se": 0.5, "answer_chars": 4.5}
    evals = HeldOutEvals(SimpleNamespace(), task, None, None, record=cb.add_eval)
    evals.blocks["before"] = block | {"per_seed": [0.0, 1.0]}
    cb.add_eval("before", 0, None, block | {"per_seed": [0.0, 1.0]})
    # the bucket's metrics: the declarations once, the values by name
    written = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    assert written.figures == list(task.figures)
    assert [s.figures for s in written.steps] == [{"answer_chars": 5.5}, {}]
    assert written.evals[0].figures == {"answer_chars": 4.5}
    # the summary's parts
    summary = cb.summary()
    assert summary["figures"] == [f.model_dump() for f in task.figures]
    assert summary["train_figures"] == {"answer_chars": 5.5}
    assert evals.curve()[0]["answer_chars"] == 4.5


def test_a_figure_returned_undeclared_is_recorded_with_one_warning(letter, caplog):
    declared = TaskFigure(name="answer_chars", label="answer length")
    task = SimpleNamespace(
        figures=(declared,),
        step_figures=lambda counts, games: {"answer_chars": 5.0, "surprise": 0.25},
    )
    store = Store("memory://task-figures-undeclared")
    cb = _callback(store, task, _Tagger([(1, {}), (1, {})]))
    with caplog.at_level(logging.WARNING, logger="trainer.loop.metrics"):
        _log(cb, 1)
        _log(cb, 2)
    warned = [r.getMessage() for r in caplog.records if "surprise" in r.getMessage()]
    assert len(warned) == 1 and "does not declare" in warned[0]
    cb.flush()  # the metrics are written on a thread of their own
    written = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    assert all(s.figures == {"answer_chars": 5.0, "surprise": 0.25} for s in written.steps)


def test_a_metrics_file_written_before_figures_were_declared_still_reads():
    old = (
        '{"run_id": "r", "updated_at": 1.0, "steps": [{"step": 1, "time": 1.0, "reward": 0.3, '
        '"consistent_rate": 0.5, "games": 8, "valid_rate": 0.9, "guesses_mean": 4.0, '
        '"invalid_reasons": {"not_a_word": 2}}, {"step": 2, "time": 2.0, "consistent_rate": null, '
        '"valid_rate": null, "guesses_mean": null, "invalid_reasons": {}}], "evals": [{"label": '
        '"before", "step": 0, "version": 0, "episodes": 16, "reward_mean": 0.5, "reward_se": 0.1, '
        '"wellformed_rate": 1.0, "valid_guess_rate": 0.9, "win_rate": 0.25, "guesses_mean": 5.0, '
        '"consistent_rate": null, "invalid_rate": null, "stopped_early_rate": null, "time": 1.0}], '
        '"fleet": []}'
    )
    m = TrainerMetrics.model_validate_json(old)
    assert m.figures == list(LEGACY_FIGURES)  # Wordle's, the only task then
    assert m.steps[0].figures == {
        "consistent_rate": 0.5,
        "valid_rate": 0.9,
        "guesses_mean": 4.0,
        "invalid_reasons/not_a_word": 2.0,
    }
    assert m.steps[1].figures == {}
    assert m.evals[0].figures == {
        "wellformed_rate": 1.0,
        "valid_guess_rate": 0.9,
        "win_rate": 0.25,
        "guesses_mean": 5.0,
    }
    assert TrainerMetrics.model_validate_json(m.model_dump_json()) == m  # and writes back whole


def test_wordle_declares_every_figure_it_reports():
    """Every figure of Wordle's step figures is declared (nothing is recorded undeclared; its
    evaluation block's: ``test_metrics_games``), and the old files' declarations agree with
    Wordle's."""
    from trainer.task.wordle import task as wordle

    declared = {f.name: f for f in wordle.FIGURES}
    steps = wordle.step_figures({"consistent": 1, "checked": 2, "accepted": 3}, 1)
    assert set(steps) <= {n for n, f in declared.items() if f.steps}
    for old in LEGACY_FIGURES:
        assert declared[old.name] == old
