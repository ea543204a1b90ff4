"""The generic held-out evaluation of a tool task: each held-out episode played through the
replica as TRL's rollout plays a training episode.

A task gives its seeds (``Task.eval_seeds``), each seed's row (``Task.eval_row``) and its figures
of the played episodes (``Task.eval_figures``), not a loop. Each episode, as TRL 1.16's async
rollout worker (``trl/experimental/async_grpo/async_rollout_worker.py``, ``_generate_loop``,
``_generate_one``, ``_execute_tool_calls``) plays one:

1. ``env = task.environment_factory(env_url=..., env_headers=...)``; ``observation =
   env.reset(**row)``, appended to the content of the prompt's last message (skipped when None);
   the tools are the class's public functions other than ``reset`` / ``get_reward``;
2. each turn renders the whole conversation with the rollout's chat template, its tools and
   ``enable_thinking=False`` (``trainer.task.chat_format.render_turns``), generates on the
   replica's ``/v1/completions`` with the sampling seed of (episode, turn, draw)
   (``trainer.task.eval_http.sampling_seed``) and parses the tokens with TRL's response parser
   (``trl.chat_template_utils.parse_response``);
3. each tool call runs as TRL runs it: an unknown name or a call that raises is answered
   ``{"error": ...}`` and counted, and the episode goes on; the reply is the tool message
   ``{"role": "tool", "name": name, "content": str(result)}``;
4. the episode ends when a turn makes no call (``no_call``), when the environment's ``done``
   attribute turns true after a call (``done``; TRL has no such stop, an evaluation need not
   play past the end), or after ``EvalRequest.max_turns`` turns (``turn_limit``, TRL's
   ``max_tool_calling_iterations``);
5. its reward is ``task.eval_reward(env)``, else ``env.get_reward()``.

The block: ``episodes``, ``reward_mean``, ``reward_se`` (standard error over episodes),
``turns_mean`` (assistant turns an episode), ``tool_error_rate`` (failed calls of all calls, None
without calls), the task's figures and, when asked, ``per_seed`` (rewards in seed order).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trainer.task.chat_format import ChatTemplateError, render_turns, rollout_template
from trainer.task.eval_http import (
    SEEDED_TURNS,
    EvalError,
    ThreadClients,
    post,
    sampling_seed,
    served_model,
)
from trainer.task.tool_episode import ToolEpisode

# TRL's environment methods that are not tools (``_generate_loop``)
NOT_TOOLS = ("reset", "get_reward")
# the generic block's own figures: a task's ``eval_figures`` cannot override them
GENERIC_KEYS = ("episodes", "reward_mean", "reward_se", "turns_mean", "tool_error_rate")


def tool_methods(env) -> list[Callable]:
    """The tools of environment ``env`` as TRL finds them: the public functions of its class
    (listed on the class, so properties are not evaluated) other than ``reset`` and
    ``get_reward``, bound to ``env``, in name order."""
    return [
        getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


def with_observation(prompt: list[dict], observation) -> list[dict]:
    """The prompt with ``reset``'s ``observation`` appended to its last message's content, as
    TRL builds it (a new list; text and multimodal content normalised alike; None: unchanged)."""
    if observation is None:
        return list(prompt)
    last = prompt[-1]
    content = last["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return [*prompt[:-1], {**last, "content": content + observation}]


def run_tool_call(call: dict, tools: dict[str, Callable]) -> tuple[dict, bool]:
    """Run one parsed tool call as TRL's rollout does; returns its tool message and whether it
    failed (an unknown name, or a tool that raised: the message then carries ``{"error": ...}``).
    """
    function = call["function"]
    name = function["name"]
    tool = tools.get(name)
    if tool is None:
        return {
            "role": "tool",
            "name": name,
            "content": str({"error": f"unknown tool {name}"}),
        }, True
    failed = False
    try:
        arguments = function.get("arguments", {})
        if inspect.iscoroutinefunction(tool):
            result = asyncio.run(tool(**arguments))
        else:
            result = tool(**arguments)
    except Exception as error:  # TRL's rule: the model reads the error and goes on
        result, failed = {"error": str(error)}, True
    return {"role": "tool", "name": name, "content": str(result)}, failed


def response_parser(tokenizer):
    """``tokenizer`` with TRL's response parser set, as TRL's rollout worker sets it (unless the
    tokenizer has a response template or schema already).

    Raises:
        ChatTemplateError: TRL knows no response parser for the tokenizer's chat template (its
            rollout worker would stop at start-up the same way).
    """
    from trl.chat_template_utils import add_response_schema

    if (
        getattr(tokenizer, "response_template", None) is not None
        or getattr(tokenizer, "response_schema", None) is not None
    ):
        return tokenizer
    try:
        return add_response_schema(tokenizer)
    except ValueError as e:
        raise ChatTemplateError(
            "expected a chat template TRL's response parser knows (add_response_schema), found "
            f"one it does not ({e}); give the model a tool template TRL knows "
            "(trainer.task.chat_format.with_tool_template), as a run does"
        ) from e


@dataclass
class _Replica:
    """What every episode of one evaluation generates with."""

    url: str
    model: str
    tokenizer: Any
    template: Any
    max_tokens: int
    temperature: float
    draw: int
    clients: ThreadClients

    def turn(self, prompt_ids: list[int], seed: int, turn: int) -> list[int]:
        """The completion tokens of one turn (sampling seed of ``(seed, turn, draw)``).

        Raises:
            EvalError: the replica answered an error or no tokens' field.
        """
        payload = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "return_token_ids": True,
            "seed": sampling_seed(seed, turn, self.draw),
        }
        r = post(self.clients.get(), f"{self.url}/v1/completions", payload)
        if r.status_code != 200:
            raise EvalError(f"replica answered {r.status_code}: {r.text[:200]}")
        return r.json()["choices"][0].get("token_ids") or []


def play_tool_episode(task, request, replica: _Replica, seed: int) -> ToolEpisode:
    """Play the held-out episode of ``seed`` (the module docstring's steps) of ``task`` (a
    ``trainer.task.base.Task``) through ``request`` (its ``EvalRequest``).

    Raises:
        EvalError: the replica answered an error, or the episode has no reward (None).
        Exception: whatever the environment's construction or ``reset`` raised.
    """
    from trl.chat_template_utils import parse_response

    row = task.eval_row(seed)
    env = task.environment_factory(env_url=request.env_url, env_headers=request.env_headers)
    with contextlib.ExitStack() as stack:
        if hasattr(env, "__exit__"):
            stack.enter_context(env)
        messages = with_observation(row["prompt"], env.reset(**row))
        prompt_len = len(messages)
        tools = tool_methods(env)
        by_name = {tool.__name__: tool for tool in tools}
        turns = calls = errors = error_turns = 0
        end = "turn_limit"
        while turns < request.max_turns:
            ids = render_turns(
                replica.tokenizer,
                messages,
                tools,
                tokenize=True,
                generation_prompt=True,
                chat_template=replica.template,
            )
            out_ids = replica.turn(ids, seed, turns)
            turns += 1
            message = parse_response(replica.tokenizer, out_ids, prefix=ids, tools=tools)
            messages.append(message)
            if not message.get("tool_calls"):
                end = "no_call"
                break
            failed_here = 0
            for call in message["tool_calls"]:
                reply, failed = run_tool_call(call, by_name)
                messages.append(reply)
                calls += 1
                failed_here += failed
                if getattr(env, "done", False):
                    end = "done"
                    break
            errors += failed_here
            error_turns += failed_here > 0
            if end == "done":
                break
        reward = task.eval_reward(env) if task.eval_reward is not None else env.get_reward()
    if reward is None:
        raise EvalError(
            f"expected a reward of held-out episode {seed}, found None (the environment dropped "
            "it, e.g. its server did not answer); check the environment server"
        )
    return ToolEpisode(
        seed=seed,
        env=env,
        messages=messages[prompt_len:],
        turns=turns,
        calls=calls,
        tool_errors=errors,
        end=end,
        reward=float(reward),
        error_turns=error_turns,
    )


def tool_block(
    episodes: list[ToolEpisode], figures: dict | None = None, per_seed: bool = False
) -> dict:
    """The evaluation block of ``episodes`` (the module docstring): the generic figures, then
    the task's ``figures`` (by other names), then ``per_seed`` if asked.

    Raises:
        ValueError: no episodes.
    """
    if not episodes:
        raise ValueError("expected at least one held-out episode, found none")
    rewards = [e.reward for e in episodes]
    n, calls = len(episodes), sum(e.calls for e in episodes)
    block = {
        "episodes": n,
        "reward_mean": round(statistics.fmean(rewards), 4),
        "reward_se": round(statistics.stdev(rewards) / math.sqrt(n), 4) if n > 1 else 0.0,
        "turns_mean": round(statistics.fmean(e.turns for e in episodes), 3),
        "tool_error_rate": round(sum(e.tool_errors for e in episodes) / calls, 4)
        if calls
        else None,
    }
    block.update({k: v for k, v in (figures or {}).items() if k not in GENERIC_KEYS})
    if per_seed:
        block["per_seed"] = [round(r, 4) for r in rewards]
    return block


def evaluate_tool_task(
    task,
    request,
    seeds: list[int],
    temperature: float = 0.0,
    per_seed: bool = False,
) -> dict:
    """Play the held-out ``seeds`` of tool task ``task`` through ``request``'s replica,
    ``request.workers`` episodes at once (one HTTP client per thread); returns
    :func:`tool_block` with ``task.eval_figures`` of the episodes.

    Args:
        task: a tool task (``trainer.task.base.Task``) with ``environment_factory`` and
            ``eval_row``.
        request: its ``trainer.task.base.EvalRequest``: the replica, the model folder (its
            tokenizer renders the turns), the environment server, tokens a turn, turns an
            episode, the sampling draw, workers and headers.
        seeds: the episodes' seeds, integers in 0..2**28-1.
        temperature: sampling temperature (0: greedy).
        per_seed: add each episode's reward in ``seeds`` order.

    Raises:
        ValueError: the task has no ``environment_factory`` or ``eval_row`` (``Task`` refuses
            such a task without ``evaluate`` when built), no seeds, or ``request.max_turns``
            outside 1..16.
        ChatTemplateError: TRL has no response parser for the model's chat template.
        EvalError: the replica did not answer usably, or an episode had no reward.
    """
    if task.environment_factory is None or task.eval_row is None:
        raise ValueError(
            f"task {task.name!r}: expected an environment_factory and an eval_row for the "
            "generic evaluation, found "
            + ("no environment_factory" if task.environment_factory is None else "no eval_row")
            + "; give both, or call the task's own evaluate (Task.run_evaluation picks it)"
        )
    if not seeds:
        raise ValueError("expected at least one held-out seed, found none")
    if not 1 <= request.max_turns <= SEEDED_TURNS:
        raise ValueError(
            f"expected max_turns in 1..{SEEDED_TURNS} (each turn has its own sampling seed), "
            f"found {request.max_turns}; lower --max-tool-calling-iterations"
        )
    from transformers import AutoTokenizer

    tokenizer = response_parser(AutoTokenizer.from_pretrained(request.model_path))
    clients = ThreadClients(request.headers)
    replica = _Replica(
        url=request.replica_url,
        model=request.model_name or served_model(request.replica_url, request.headers),
        tokenizer=tokenizer,
        template=rollout_template(tokenizer),
        max_tokens=request.max_tokens,
        temperature=temperature,
        draw=request.draw,
        clients=clients,
    )
    with clients, ThreadPoolExecutor(max(1, request.workers)) as pool:
        episodes = list(pool.map(lambda s: play_tool_episode(task, request, replica, s), seeds))
    figures = task.eval_figures(episodes) if task.eval_figures is not None else None
    return tool_block(episodes, figures, per_seed)
