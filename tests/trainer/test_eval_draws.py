"""An evaluation can play each held-out game more than once (``EvalSettings.draws``): each draw
samples with its own seeds on the same games, draw 0 replays the tokens every earlier evaluation
sampled, and the pooled block's standard error is taken over games, not plays.

The games run on the real Wordle server; the replica is a stand-in over HTTP that, like vLLM with
a request ``seed``, picks its tokens from the seed alone (a real replica's sampling is covered by
the end-to-end runs)."""

from __future__ import annotations

import math
import random
import statistics
import threading
import time

import pytest

from trainer.loop.learning_curve import HeldOutEvals, paired_difference, pool_draws
from trainer.loop.rollouts import Rollouts
from trainer.settings import EvalConfigError, EvalSettings
from trainer.task.base import EvalRequest
from trainer.task.eval_http import sampling_seed
from trainer.task.wordle import task as wordle
from trainer.task.wordle.figures import EpisodeResult, summarize
from trainer.task.wordle.game_env import EpisodeStats, eval_seeds
from wordle_env import wordlists

from .completions_stub import completions_server

GAMES = 12
INFLIGHT = {"now": 0, "peak": 0}  # requests the stand-in replica holds at once


@pytest.fixture(scope="module")
def seeded_replica(tool_model_dir):
    """A ``/v1/completions`` server whose guess is drawn from the request's ``seed`` (a real or
    a 6-letter word, so some moves are invalid); yields ``(url, seeds it was sent)``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    words = [*wordlists.answers()[:300], "planet", "stream"]
    sent: list[int] = []
    lock = threading.Lock()

    def answer(payload: dict) -> str:
        with lock:
            sent.append(payload["seed"])
            INFLIGHT["now"] += 1
            INFLIGHT["peak"] = max(INFLIGHT["peak"], INFLIGHT["now"])
        time.sleep(0.02)  # long enough for concurrent games to overlap
        with lock:
            INFLIGHT["now"] -= 1
        word = random.Random(payload["seed"]).choice(words)
        return f'<tool_call>{{"name": "guess", "arguments": {{"word": "{word}"}}}}</tool_call>'

    with completions_server(answer, tokenizer) as url:
        yield url, sent


def _play(replica, env_url, model_dir, draw):
    url, sent = replica
    sent.clear()
    seeds = eval_seeds(count=GAMES)
    block = wordle.evaluate(
        url, model_dir, env_url, seeds, 64, 1.0, per_seed=True, model_name="m", draw=draw
    )
    return block, list(sent)


def test_draw_zero_replays_and_another_draw_samples_other_moves_on_the_same_games(
    seeded_replica, wordle_url, tool_model_dir
):
    first, sent0 = _play(seeded_replica, wordle_url, tool_model_dir, 0)
    again, _ = _play(seeded_replica, wordle_url, tool_model_dir, 0)
    other, sent1 = _play(seeded_replica, wordle_url, tool_model_dir, 1)
    # draw 0 sends the seeds every earlier evaluation sent, and replays the same games
    firsts = {s * 16 for s in eval_seeds(count=GAMES)}
    assert firsts <= set(sent0) and all(x // 16 in eval_seeds(count=GAMES) for x in sent0)
    assert again["per_seed"] == first["per_seed"]
    # draw 1: none of draw 0's seeds, other moves on the same games
    assert not set(sent1) & set(sent0)
    assert other["per_seed"] != first["per_seed"]
    assert (first["episodes"], other["episodes"]) == (GAMES, GAMES)


def test_the_run_pools_its_draws_game_by_game(seeded_replica, wordle_url, tool_model_dir):
    """``HeldOutEvals`` with two draws: each game's reward is its mean over the draws, the
    standard error is over the games, and the counts cover every play."""
    one = [_play(seeded_replica, wordle_url, tool_model_dir, d)[0] for d in (0, 1)]
    recorded = []
    target = EvalRequest(seeded_replica[0], tool_model_dir, wordle_url, "m", 64)
    evals = HeldOutEvals(
        EvalSettings(episodes=GAMES, draws=2),
        wordle.TASK,
        target,
        Rollouts(None),
        lambda *a: recorded.append(a),
    )
    evals.play("before", 0, None, GAMES, draws=2)
    block = evals.blocks["before"]
    pairs = zip(one[0]["per_seed"], one[1]["per_seed"], strict=True)
    means = [round(statistics.fmean(pair), 4) for pair in pairs]
    assert block["per_seed"] == means and block["draws"] == 2
    assert block["episodes"] == 2 * GAMES
    assert block["reward_se"] == pytest.approx(statistics.stdev(means) / math.sqrt(GAMES), abs=1e-4)
    reasons = {
        k: one[0]["invalid_reasons"].get(k, 0) + one[1]["invalid_reasons"].get(k, 0)
        for k in set(one[0]["invalid_reasons"]) | set(one[1]["invalid_reasons"])
    }
    assert block["invalid_reasons"] == {k: v for k, v in sorted(reasons.items()) if v}
    assert block["valid_guess_rate"] == pytest.approx(
        (one[0]["valid_guess_rate"] + one[1]["valid_guess_rate"]) / 2, abs=1e-4
    )
    assert recorded[0][0] == "before" and recorded[0][3] is block


@pytest.mark.parametrize("serving", [1, 2])
def test_an_evaluation_sends_each_serving_replica_at_most_its_share_at_once(
    seeded_replica, wordle_url, tool_model_dir, serving
):
    """The games played at once are ``serving replicas x per_replica``: the replica never holds
    more requests than that, and two replicas are sent more than one replica's share."""
    target = EvalRequest(seeded_replica[0], tool_model_dir, wordle_url, "m", 64)
    evals = HeldOutEvals(
        EvalSettings(episodes=GAMES, per_replica=3),
        wordle.TASK,
        target,
        Rollouts(None, serving_count=lambda: serving),
        lambda *a: None,
    )
    INFLIGHT["peak"] = 0
    evals.play("before", 0, None, GAMES)
    assert 3 * (serving - 1) < INFLIGHT["peak"] <= 3 * serving
    assert evals.blocks["before"]["episodes"] == GAMES


def _block(rewards: list[float]) -> dict:
    games = [
        EpisodeResult(i, 1, 1, EpisodeStats(accepted=1, guesses=["crane"], done=True), r, "won")
        for i, r in enumerate(rewards)
    ]
    return summarize(games) | {"per_seed": rewards}


def test_more_draws_shrink_the_paired_standard_error_of_the_same_games():
    """Games of different difficulty played with sampling noise: pooling 4 draws before and after
    halves the noise part of the paired standard error; the mean difference stays near the
    true gain."""
    rng = random.Random(3)
    difficulty = [rng.uniform(0.1, 0.4) for _ in range(400)]

    def draw(gain):
        return _block([d + gain + rng.gauss(0, 0.15) for d in difficulty])

    one = paired_difference(draw(0.0)["per_seed"], draw(0.02)["per_seed"])
    four = paired_difference(
        pool_draws([draw(0.0) for _ in range(4)])["per_seed"],
        pool_draws([draw(0.02) for _ in range(4)])["per_seed"],
    )
    assert four["reward_diff_se"] < 0.6 * one["reward_diff_se"]
    assert abs(four["reward_diff"] - 0.02) < 3 * four["reward_diff_se"]


def test_bad_draws_are_refused_with_the_fix():
    with pytest.raises(EvalConfigError, match="eval_draws=0.*--eval-draws"):
        EvalSettings(draws=0)
    with pytest.raises(EvalConfigError, match="eval_per_replica=0.*--eval-per-replica"):
        EvalSettings(per_replica=0)
    with pytest.raises(ValueError, match="same games"):
        pool_draws([_block([0.1, 0.2]), _block([0.1, 0.2, 0.3])])
    with pytest.raises(ValueError, match="draw >= 0"):
        sampling_seed(900_000, 0, -1)
    with pytest.raises(ValueError, match="game seed in 0..2"):
        sampling_seed(1 << 28, 0, 1)  # its draw-0 seeds would reach draw 1's
    assert sampling_seed(900_000, 3) == 900_000 * 16 + 3  # draw 0: the seeds used until now
    assert (
        len({sampling_seed(s, t, d) for s in eval_seeds() for t in range(7) for d in range(3)})
        == 512 * 7 * 3
    )
