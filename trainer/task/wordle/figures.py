"""Wordle's held-out evaluation: an instance of the generic evaluation of tool tasks
(``trainer.task.tool_eval``), which plays each held-out game through the replica with
``WordleToolEnv``, TRL's chat rendering and its response parser, as TRL's rollout plays a
training game. Here: the Wordle figures of the played games (:func:`figures`, the block's names
that the summary, the dashboard and ``trainer.task.wordle.task.FIGURES`` read), the game's own
reward (:func:`eval_reward`) and the context check. ``trainer.task.wordle.task.evaluate`` runs the
whole evaluation from flat arguments (the benches).

Because the games go through the replica that received the deltas, a rise between the evaluation
before the first GRPO step and after the last one shows that the deltas carried the learning.

``make eval`` (``trainer.eval_run``) plays held-out seeds with a finished run's initial model and
its newest bucket version through replicas it starts.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass

import httpx

from trainer.task.chat_format import render_turns
from trainer.task.tool_episode import ToolEpisode
from trainer.task.wordle.credit import guess_value
from trainer.task.wordle.game_env import (
    MAX_TURNS,
    EpisodeStats,
    call_message,
    episode_reward,
    guess_tool,
    prompt_messages,
    reward_kind,
    tool_reply,
)
from wordle_env import rules

# A row worth at least this much credit is a good one to stop on (:func:`stop_rates`): for a
# player whose guesses are random answer words, stopping on the first row worth 0.3 or more
# gives the game's reward 0.31, against 0.18 for never stopping and 0.29 / 0.24 at 0.4 / 0.5
# (20,000 simulated games each, ``wordle_env.rules``).
GOOD_ROW = 0.3


@dataclass
class EpisodeResult:
    """One evaluation game.

    Attributes:
        seed: the game's seed.
        turns: assistant turns generated.
        wellformed: turns that were a ``guess`` call that ran (:func:`episode_result`).
        stats: the game's :class:`~trainer.task.wordle.game_env.EpisodeStats`.
        env_reward: the environment's own reward (1 for a win, else credit of the last accepted
            guess).
        end: why the episode ended: ``won``, ``out_of_guesses``, ``malformed`` (a turn with no
            call: the model stopped), ``invalid`` (two invalid moves in a row), ``turn_limit``.
    """

    seed: int
    turns: int
    wellformed: int
    stats: EpisodeStats
    env_reward: float
    end: str


class ContextTooShortError(ValueError):
    """A full episode does not fit the replica's context length."""


def check_context(replica_url: str, tokenizer_path: str, max_tokens: int, headers=None) -> int:
    """Check, before training, that the longest possible episode fits the replica's
    ``max_model_len`` (from ``GET /v1/models``): otherwise vLLM answers 400 mid-episode and TRL
    retries it for minutes before the rollout worker dies. Returns the worst-case length.

    The worst case (an upper bound) renders the prompt and ``MAX_TURNS`` calls, each answered by the
    game's longest reply, plus ``max_tokens`` more per turn.

    Raises:
        ContextTooShortError: the episode does not fit; says by how much and what to change.
    """
    from transformers import AutoTokenizer

    from wordle_env.game import WordleGame

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    # the longest reply: the board after five guesses that rule out the most letters
    game = WordleGame("fuzzy")
    for word in ("crane", "split", "bogey", "wimpy", "havoc"):
        game.play(f"[{word}]")
    invalid = game.play("[zzzzz]").reply
    longest_reply = tool_reply(invalid, False, game.guesses, game.marks)
    messages = prompt_messages()
    for _ in range(MAX_TURNS):
        messages += [
            call_message("crane"),
            {"role": "tool", "name": "guess", "content": longest_reply},
        ]
    ids = render_turns(tokenizer, messages, [guess_tool()], tokenize=True)
    worst = len(ids) + MAX_TURNS * max_tokens  # as if every turn also ran to its cap
    r = httpx.get(f"{replica_url}/v1/models", headers=headers, timeout=30)
    limit = (r.json().get("data") or [{}])[0].get("max_model_len") if r.status_code == 200 else None
    if limit is not None and worst > limit:
        raise ContextTooShortError(
            f"a full Wordle episode needs up to {worst} tokens, the replica serves "
            f"max_model_len={limit}: raise MAX_MODEL_LEN on the rollout Space to at least {worst}, "
            "or lower --max-completion-length / --max-tool-calling-iterations"
        )
    return worst


def stop_rates(results: list[EpisodeResult]) -> dict:
    """How the model's stopping depends on the row it just read: of the accepted rows after which
    the game went on (not a win, guesses left), the share the model stopped after (its next turn
    was no call) for rows worth at least ``GOOD_ROW`` (``stop_after_good_rate``) and for the rest
    (``stop_after_poor_rate``), and the mean credit of the rows games stopped on (None where
    none). The game pays the last row (``rules.game_reward``), so a player that reads its feedback
    stops more after good rows; one that does not stops alike after both."""
    stops = {True: [0, 0], False: [0, 0]}  # good row -> [stopped after it, rows]
    stopped_on = []
    for r in results:
        last = len(r.stats.marks) - 1
        for i, marks in enumerate(r.stats.marks):
            if i == rules.MAX_GUESSES - 1 or (r.stats.won and i == last):
                continue  # the game was over after this row: nothing to decide
            credit = rules.partial_credit(marks)
            stopped = i == last and r.end == "malformed" and not r.stats.last_invalid
            stops[credit >= GOOD_ROW][0] += stopped
            stops[credit >= GOOD_ROW][1] += 1
            if stopped:
                stopped_on.append(credit)
    rate = {good: round(s / n, 4) if n else None for good, (s, n) in stops.items()}
    return {
        "stop_after_good_rate": rate[True],
        "stop_after_poor_rate": rate[False],
        "stopped_row_credit_mean": round(statistics.fmean(stopped_on), 4) if stopped_on else None,
    }


def summarize(results: list[EpisodeResult]) -> dict:
    """The evaluation block: rates, mean environment reward with its standard error, the stop
    decision's figures (:func:`stop_rates`), etc."""
    n = len(results)
    turns = sum(r.turns for r in results)
    calls = sum(r.wellformed for r in results)
    rewards = [r.env_reward for r in results]
    consistent = sum(r.stats.consistent for r in results)
    checked = sum(r.stats.checked for r in results)
    se = statistics.stdev(rewards) / math.sqrt(n) if n > 1 else 0.0
    values = [guess_value(w) for r in results for w in r.stats.guesses]
    return {
        "episodes": n,
        "wellformed_rate": round(calls / turns, 4) if turns else 0.0,
        "valid_guess_rate": round(sum(r.stats.accepted for r in results) / calls, 4)
        if calls
        else 0.0,
        "reward_mean": round(statistics.fmean(rewards), 4),
        "reward_se": round(se, 4),
        "win_rate": round(sum(r.stats.won for r in results) / n, 4),
        "guesses_mean": round(statistics.fmean(r.stats.accepted for r in results), 3),
        "two_guesses_rate": round(
            sum(r.stats.accepted >= 2 or r.stats.won for r in results) / n, 4
        ),
        "bad_end_rate": round(sum(r.end in ("malformed", "invalid") for r in results) / n, 4),
        # the mechanism: later guesses that fit every earlier feedback row
        # (trainer.task.wordle.board)
        "consistent_rate": round(consistent / checked, 4) if checked else 0.0,
        "invalid_rate": round(sum(r.stats.invalid for r in results) / turns, 4) if turns else 0.0,
        # invalid moves by the environment's reason, summed over the games (``repeated_guess``:
        # a word already tried; ``not_a_word``, ...: wordle_env.rules.INVALID_MOVE_CODES)
        "invalid_reasons": dict(
            sorted(sum((Counter(r.stats.invalid_reasons) for r in results), Counter()).items())
        ),
        "stopped_early_rate": round(sum(not r.stats.done for r in results) / n, 4),
        # where the environment's reward comes from: games with no accepted guess score 0, and an
        # accepted guess scores about its word's value (guess_value) plus what the feedback added
        "no_guess_rate": round(sum(not r.stats.accepted for r in results) / n, 4),
        "guess_value_mean": round(statistics.fmean(values), 4) if values else None,
        "shaped_reward_mean": round(
            statistics.fmean(episode_reward(r.stats, reward_kind()) for r in results), 4
        ),
        **stop_rates(results),
    }


def episode_result(episode: ToolEpisode) -> EpisodeResult:
    """A game the generic evaluation played (its ``WordleToolEnv`` in ``episode.env``) as an
    :class:`EpisodeResult`: its well-formed turns are those whose calls all ran (not the last
    turn when it made no call, nor a turn with a call that failed), its end ``malformed`` when the
    model stopped (``no_call``), and a finished game's end ``won``, ``invalid`` (two invalid moves
    in a row) or ``out_of_guesses``."""
    stats = episode.env.stats
    end = {"no_call": "malformed", "turn_limit": "turn_limit"}.get(episode.end)
    if end is None:  # done
        end = "won" if stats.won else ("invalid" if stats.last_invalid else "out_of_guesses")
    stopped = episode.end == "no_call"
    wellformed = episode.turns - stopped - episode.error_turns
    return EpisodeResult(episode.seed, episode.turns, wellformed, stats, episode.reward, end)


def figures(episodes: list[ToolEpisode]) -> dict:
    """Wordle's figures of the held-out games (``Task.eval_figures``): :func:`summarize` of
    each game's :func:`episode_result`."""
    return summarize([episode_result(e) for e in episodes])


def eval_reward(env) -> float:
    """A held-out game's reward (``Task.eval_reward``): what the game itself paid for the last
    move (``WordleToolEnv.game_reward``: 1 for a win, else the last accepted guess's credit)."""
    return env.game_reward
