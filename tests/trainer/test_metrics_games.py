"""Training games and their consistent share: the consistent guesses read back from rendered
conversations (``trainer.task.wordle.board.consistency``) equal what the environment's own
``EpisodeStats`` counts; the tagger counts each kept, scored episode once however many rows TRL
made of it; and the metrics callback writes the step's share and game count to the bucket and its
log line, and copies the new evaluation rates (not ``per_seed``)."""

from __future__ import annotations

import math
import queue
import random
from types import SimpleNamespace

import numpy as np
import pytest

from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics
from deltasync.store import Store
from trainer.loop.rollout_tagging import ReplicaVersionTagger
from trainer.task.wordle.board import accepted_moves, consistency
from trainer.task.wordle.game_env import EpisodeStats, call_message, solver_conversation
from trainer.task.wordle.task import FIGURES, episode_counts, step_figures
from wordle_env import wordlists
from wordle_env.game import WordleGame


def _observation(game: WordleGame, move) -> SimpleNamespace:
    """What the server returns after a move (``WordleObservation``'s fields that matter)."""
    return SimpleNamespace(
        reply=move.reply,
        done=game.done,
        won=game.won,
        guesses=list(game.guesses),
        feedback=list(game.marks),
        error_code=None if move.invalid is None else move.invalid.code,
    )


def _stats_of(target: str, words: list[str]) -> EpisodeStats:
    """The environment's own count: ``words`` replayed through the game into ``EpisodeStats``."""
    game, stats = WordleGame(target), EpisodeStats()
    for w in words:
        stats.record(_observation(game, game.play(f"[{w}]")))
    return stats


def _played(target: str, words: list[str]) -> tuple[list[dict], EpisodeStats]:
    """The completion messages of an episode that sends ``words`` (invalid ones included), with
    the tool replies ``WordleToolEnv`` renders, and its ``EpisodeStats``."""
    game, stats, completion = WordleGame(target), EpisodeStats(), []
    for w in words:
        if game.done:
            break
        obs = _observation(game, game.play(f"[{w}]"))
        stats.record(obs)
        completion.append(call_message(w))
        completion.append({"role": "tool", "name": "guess", "content": stats.reply(obs, obs.done)})
    return completion, stats


def test_consistency_of_solver_games_matches_episode_stats():
    rng = random.Random(0)
    targets = rng.sample(sorted(wordlists.answers()), 40)
    consistent = checked = 0
    for i, target in enumerate(targets):
        explore = (0.0, 0.5, 1.0)[i % 3]  # consistent, mixed and random players
        messages = solver_conversation(WordleGame(target), random.Random(i), explore=explore)
        completion = messages[2:]  # TRL keeps the prompt (system, user) apart
        guesses, marks = accepted_moves(completion)
        game = WordleGame(target)
        for g in guesses:
            game.play(f"[{g}]")
        assert (game.guesses, game.marks) == (guesses, marks) and game.done
        stats = _stats_of(target, guesses)
        assert consistency(completion) == (stats.consistent, stats.checked), target
        consistent, checked = consistent + stats.consistent, checked + stats.checked
    assert 0 < consistent < checked  # both kinds of guesses were checked


def test_consistency_skips_invalid_moves_and_tool_errors():
    words = ["crane", "zzzzz", "slate", "crane", "pious", "toast"]  # two invalid moves
    completion, stats = _played("toast", words)
    completion.insert(2, {"role": "tool", "name": "guess", "content": "{'error': 'unreachable'}"})
    completion.append({"role": "assistant", "content": "You submitted [bogus].\nFeedback:\n"})
    assert stats.invalid == 2 and stats.checked == 3
    assert stats.invalid_reasons == {"not_a_word": 1, "repeated_guess": 1}
    assert accepted_moves(completion)[0] == ["crane", "slate", "pious", "toast"]
    assert consistency(completion) == (stats.consistent, stats.checked)
    assert consistency([]) == (0, 0)


class _FakeWorker:
    def __init__(self):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()

    def update_model_version(self, v):
        pass


def _row(completion, group_id, lead, version=5, reward=0.5, trained=4):
    """One RolloutSample-like row: ``lead`` context tokens, then ``trained`` trained tokens."""
    mask = np.array([0] * lead + [1] * trained + [0] * 3, dtype=np.int64)
    return SimpleNamespace(
        completion=completion,
        group_id=group_id,
        model_version=version,
        input_ids=np.arange(mask.size),
        completion_mask=mask,
        metrics={"reward": reward},
    )


def test_tagger_counts_each_kept_scored_episode_once():
    targets = random.Random(3).sample(sorted(wordlists.answers()), 5)
    convo = {
        name: solver_conversation(WordleGame(targets[k]), random.Random(k), explore=0.6)[2:]
        for k, name in enumerate("abcde")
    }
    worker = _FakeWorker()
    tagger = ReplicaVersionTagger(
        worker, lambda: None, lambda: None, max_staleness=1, episode_counts=episode_counts
    )
    tagger.trl_version = 5
    rows = [
        _row(convo["a"], 0, 10),  # a: one row
        _row(convo["b"], 1, 10),  # b: forked into two rows
        _row(convo["b"], 1, 60),
        _row(convo["b"], 1, 10),  # b again: another episode of group 1 with the same moves
        _row(convo["b"], 1, 60),
        _row(convo["c"], 1, 10, version=3),  # c: its first row stale (dropped), its forks kept
        _row(convo["c"], 1, 40),
        _row(convo["c"], 1, 70),
        _row(convo["d"], 2, 10, version=2),  # d: stale, dropped
        _row(convo["e"], 2, 10, reward=math.nan),  # e: never scored (the server was unreachable)
    ]
    for r in rows:
        worker.rollout_buffer.put(r)
    for _ in rows:
        tagger.rollout_buffer.get(timeout=1)
    want = [consistency(convo[n]) for n in "abbc"]
    step = tagger.take_games()
    assert (step.games, step.counts["consistent"], step.counts["checked"]) == (
        4,
        sum(c for c, _ in want),
        sum(n for _, n in want),
    )
    figures = step_figures(dict(step.counts), step.games)
    consistent_rate = step.counts["consistent"] / step.counts["checked"]
    assert figures["consistent_rate"] == pytest.approx(consistent_rate, abs=1e-4)
    assert tagger.games_total == 4 and tagger.dropped == 2
    empty = tagger.take_games()
    assert (empty.games, step_figures(dict(empty.counts), 0)["consistent_rate"]) == (0, None)
    worker.rollout_buffer.put(_row(convo["a"], 3, 10))
    tagger.rollout_buffer.get(timeout=1)
    assert tagger.take_games().games == 1 and tagger.games_total == 5


class _FakePublisher:
    published: list = []


def test_callback_writes_the_steps_consistent_share_and_games(capsys):
    from trainer.loop.metrics import BucketMetricsCallback

    store = Store("memory://test-metrics-games")
    worker = _FakeWorker()
    tagger = ReplicaVersionTagger(worker, lambda: None, lambda: None, episode_counts=episode_counts)
    cb = BucketMetricsCallback(
        store, "run", _FakePublisher(), tagger=tagger, step_figures=step_figures, figures=FIGURES
    )
    words = ["crane", "cranes", "slate", "zzzzz", "pious", "slate", "boast", "toast"]
    completion, stats = _played("toast", words)
    for group in range(3):
        worker.rollout_buffer.put(_row(completion, group, 10))
        tagger.rollout_buffer.get(timeout=1)
    cb.on_log(None, SimpleNamespace(global_step=1), None, logs={"loss": 0.1, "reward": 0.4})
    cb.on_log(None, SimpleNamespace(global_step=2), None, logs={"loss": 0.1, "reward": 0.5})
    cb.add_eval("step-2", 2, None, _eval_block())
    written = TrainerMetrics.model_validate_json(store.read_bytes(TRAINER_METRICS_PATH))
    first, second = written.steps
    assert (first.games, second.games) == (3, 0)
    assert first.figures["consistent_rate"] == pytest.approx(
        stats.consistent / stats.checked, abs=1e-4
    )
    assert "consistent_rate" not in second.figures  # not measured: absent
    assert cb.tagger.games_total == 3
    out = capsys.readouterr().out
    # the moves the game took and refused, by its own codes, as the episode's stats counted them
    refused = sum(stats.invalid_reasons.values())
    assert stats.invalid_reasons == {"wrong_length": 1, "not_a_word": 1, "repeated_guess": 1}
    assert {
        k.split("/", 1)[1]: v for k, v in first.figures.items() if k.startswith("invalid_reasons/")
    } == {k: 3 * v for k, v in stats.invalid_reasons.items()}
    assert first.figures["valid_rate"] == pytest.approx(
        stats.accepted / (stats.accepted + refused), abs=1e-4
    )
    assert first.figures["guesses_mean"] == stats.accepted == 5
    assert second.figures == {}
    # the step line: Wordle's declared step figures, in declared order, under their labels
    f = first.figures
    line = f"consistent={f['consistent_rate']:.2f} valid={f['valid_rate']:.2f} guesses_a_game=5"
    assert f"{line} games=3" in out
    assert "consistent=None valid=None guesses_a_game=None games=0" in out
    assert written.figures == list(FIGURES)  # the run's declarations, written once
    assert cb._undeclared == set()  # every figure Wordle returns is declared
    ev = written.evals[0]
    assert (ev.label, ev.figures["consistent_rate"], ev.figures["invalid_rate"]) == (
        "step-2",
        0.42,
        0.05,
    )
    assert ev.figures["stopped_early_rate"] == 0.1
    assert set(ev.figures) == set(_eval_block()) - {
        "episodes",
        "reward_mean",
        "reward_se",
        "per_seed",
    }
    assert "per_seed" not in store.read_bytes(TRAINER_METRICS_PATH).decode()


def _eval_block() -> dict:
    """A ``trainer.task.wordle.figures.summarize`` block, with ``evaluate(per_seed=True)``'s extra
    key."""
    return {
        "episodes": 4,
        "wellformed_rate": 1.0,
        "valid_guess_rate": 0.9,
        "reward_mean": 0.5,
        "reward_se": 0.1,
        "win_rate": 0.25,
        "guesses_mean": 5.0,
        "bad_end_rate": 0.0,
        "consistent_rate": 0.42,
        "invalid_rate": 0.05,
        "stopped_early_rate": 0.1,
        "shaped_reward_mean": 0.45,
        "per_seed": [0.1, 0.2, 1.0, 0.7],
    }


def test_a_stalled_metrics_write_does_not_stall_training():
    """A Hub outage stalls hf_xet's upload for minutes: the step's metrics write must not wait
    for it. The steps go on, the newest metrics replace a write still waiting, and the end of
    training waits until the last one is written."""
    import threading
    import time
    from types import SimpleNamespace

    from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics
    from trainer.loop.metrics import BucketMetricsCallback

    class StalledStore:
        uri = "memory://stalled"

        def __init__(self):
            self.entered, self.release, self.written = threading.Event(), threading.Event(), []

        def write_bytes(self, path, data):
            self.entered.set()
            self.release.wait(30)
            self.written.append((path, data))

    store = StalledStore()
    cb = BucketMetricsCallback(store, "run", _FakePublisher())
    cb.on_log(None, SimpleNamespace(global_step=1), None, logs={"loss": 0.1, "reward": 0.1})
    assert store.entered.wait(10)  # the first write hangs in the store
    t0 = time.monotonic()
    for step in range(2, 6):
        cb.on_log(None, SimpleNamespace(global_step=step), None, logs={"loss": 0.1, "reward": 0.1})
    assert time.monotonic() - t0 < 5  # four steps logged while that write hangs
    store.release.set()
    cb.on_train_end(None, SimpleNamespace(global_step=5), None)
    # the hung write (step 1), then only the newest content: steps 2-4 never on their own
    steps = [TrainerMetrics.model_validate_json(d).steps[-1].step for _, d in store.written]
    assert steps[0] == 1 and steps[-1] == 5 and set(steps) == {1, 5} and len(steps) <= 3
    last = TrainerMetrics.model_validate_json(store.written[-1][1])
    assert store.written[-1][0] == TRAINER_METRICS_PATH and last.steps[-1].step == 5
