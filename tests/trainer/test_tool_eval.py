"""The generic evaluation of a tool task (``trainer.task.tool_eval``) plays each held-out episode
as TRL's rollout plays a training one: the moves reach the real environment server, a call that
fails is answered with its error and the episode goes on, a turn without a call ends it, and the
block comes back in seed order. The replica is a stand-in over HTTP that answers a script keyed
by the request's sampling seed (episode, turn, draw)."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from trainer.task.base import EvalRequest
from trainer.task.chat_format import ChatTemplateError
from trainer.task.eval_http import sampling_seed
from trainer.task.wordle import task as wordle
from trainer.task.wordle.game_env import eval_seeds
from wordle_env import rules, wordlists

from .completions_stub import completions_server

SEEDS = eval_seeds(count=4)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def scripted_replica(tool_model_dir):
    """A ``/v1/completions`` stand-in: the text of each turn is ``state["script"](episode seed,
    turn, draw)``; yields ``(url, state)``, ``state["sent"]`` the ``(sampling seed, prompt ids)``
    of every request and ``state["tokenizer"]`` the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    state: dict = {"sent": [], "tokenizer": tokenizer}
    lock = threading.Lock()

    def answer(payload: dict) -> str:
        seed = payload["seed"]
        with lock:
            state["sent"].append((seed, payload["prompt"]))
        return state["script"]((seed & 0xFFFFFFFF) // 16, seed % 16, seed >> 32)

    with completions_server(answer, tokenizer) as url:
        yield url, state


def _evaluate(replica, wordle_url, model, script, seeds, draw=0, max_turns=7):
    """The generic evaluation of the Wordle task on ``seeds``; returns (block, episodes)."""
    url, state = replica
    state["script"], state["sent"] = script, []
    episodes = []

    def figures(played):
        episodes.extend(played)
        return wordle.TASK.eval_figures(played)

    task = dataclasses.replace(wordle.TASK, eval_figures=figures)
    request = EvalRequest(
        url, model, wordle_url, "m", 64, draw=draw, workers=2, max_turns=max_turns
    )
    block = task.run_evaluation(request, seeds, 1.0, per_seed=True)
    return block, sorted(episodes, key=lambda e: seeds.index(e.seed))


def test_moves_reach_the_server_failed_calls_are_answered_and_a_turn_without_a_call_ends_it(
    scripted_replica, wordle_url, tool_model_dir
):
    seed = SEEDS[0]
    turns = [
        _call("guess", word="crane"),
        _call("hint"),  # no such tool
        _call("guess", letters="crane"),  # the tool raises: unexpected argument
        "I give up.",  # no call: the model stopped
    ]
    block, (episode,) = _evaluate(
        scripted_replica, wordle_url, tool_model_dir, lambda s, t, d: turns[t], [seed]
    )
    # the move reached the server, which marked it against the game's own secret
    target = wordlists.target_for_seed(seed)
    assert episode.env.stats.guesses == ["crane"]
    assert episode.env.stats.marks == [rules.feedback("crane", target)]
    assert episode.reward == pytest.approx(rules.partial_credit(rules.feedback("crane", target)))
    # both failed calls were answered with their error, and the model read it on its next turn
    tokenizer = scripted_replica[1]["tokenizer"]
    prompts = {s: tokenizer.decode(ids) for s, ids in scripted_replica[1]["sent"]}
    assert "{'error': 'unknown tool hint'}" in prompts[sampling_seed(seed, 2)]
    assert "unexpected keyword argument 'letters'" in prompts[sampling_seed(seed, 3)]
    assert [m["role"] for m in episode.messages] == [
        *["assistant", "tool"] * 3,
        "assistant",
    ]
    assert (episode.turns, episode.calls, episode.tool_errors, episode.end) == (4, 3, 2, "no_call")
    # the block counts them: generic and Wordle's figures
    assert block["tool_error_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert block["turns_mean"] == 4
    assert block["wellformed_rate"] == 0.25  # one turn of four was a call that ran
    assert block["bad_end_rate"] == 1.0  # stopped with no call: Wordle's "malformed" end


def test_the_game_over_ends_an_episode_the_turn_limit_cuts_one_and_rewards_keep_seed_order(
    scripted_replica, wordle_url, tool_model_dir
):
    won, cut = SEEDS[1], SEEDS[2]
    other = next(w for w in wordlists.answers() if w != wordlists.target_for_seed(cut))
    others = [w for w in wordlists.answers() if w != wordlists.target_for_seed(cut)][:3]

    def script(seed, turn, draw):
        if seed == won:  # two calls in the first turn: the win ends it, the second never runs
            return _call("guess", word=wordlists.target_for_seed(won)) + _call("guess", word=other)
        return _call("guess", word=others[turn])

    block, episodes = _evaluate(
        scripted_replica, wordle_url, tool_model_dir, script, [won, cut], max_turns=3
    )
    first, second = episodes
    assert (first.end, first.turns, first.calls, first.reward) == ("done", 1, 1, 1.0)
    assert first.env.stats.won and first.env.stats.guesses == [wordlists.target_for_seed(won)]
    assert (second.end, second.turns, second.env.stats.guesses) == ("turn_limit", 3, others)
    assert block["per_seed"] == [1.0, round(second.reward, 4)]
    assert block["win_rate"] == 0.5 and block["episodes"] == 2
    reversed_block, _ = _evaluate(
        scripted_replica, wordle_url, tool_model_dir, script, [cut, won], max_turns=3
    )
    assert reversed_block["per_seed"] == block["per_seed"][::-1]


def test_the_same_draw_replays_the_same_requests_and_another_draw_does_not(
    scripted_replica, wordle_url, tool_model_dir
):
    import random

    words = wordlists.answers()[:200]

    def script(seed, turn, draw):  # like vLLM with a seed: the tokens follow the seed alone
        return _call("guess", word=random.Random(f"{seed}-{turn}-{draw}").choice(words))

    runs = []
    for draw in (0, 0, 1):
        block, episodes = _evaluate(
            scripted_replica, wordle_url, tool_model_dir, script, SEEDS, draw=draw
        )
        sent = sorted(scripted_replica[1]["sent"])
        runs.append((block, [e.messages for e in episodes], sent))
    (first, moves0, sent0), (again, moves1, sent1), (other, moves2, sent2) = runs
    assert sent1 == sent0 and moves1 == moves0 and again["per_seed"] == first["per_seed"]
    assert not {s for s, _ in sent2} & {s for s, _ in sent0}
    assert moves2 != moves0


def test_a_model_whose_calls_trl_cannot_parse_and_a_turn_cap_out_of_range_are_refused(
    scripted_replica, wordle_url, real_model_dir, tool_model_dir
):
    url = scripted_replica[0]
    with pytest.raises(ChatTemplateError, match="response parser knows.*with_tool_template"):
        wordle.TASK.run_evaluation(EvalRequest(url, real_model_dir, wordle_url, "m", 8), SEEDS, 0)
    with pytest.raises(ValueError, match="max_turns in 1..16.*--max-tool-calling-iterations"):
        request = EvalRequest(url, tool_model_dir, wordle_url, "m", 8, max_turns=17)
        wordle.TASK.run_evaluation(request, SEEDS, 0)
