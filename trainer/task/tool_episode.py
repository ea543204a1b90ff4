"""One held-out episode of a tool task as the generic evaluation played it
(:class:`ToolEpisode`; ``trainer.task.tool_eval``), what ``Task.eval_figures`` reads. Also
importable from ``trainer.task.base``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ToolEpisode:
    """One held-out episode of a tool task, as the generic evaluation played it
    (``trainer.task.tool_eval``), handed to ``Task.eval_figures``.

    Attributes:
        seed: the episode's seed (one of ``Task.eval_seeds``).
        env: the task's environment instance after the episode (its own state: score, moves, ...;
            its connection closed when it is a context manager).
        messages: the episode's messages after the prompt, as TRL's rollout builds them: each
            assistant turn (``tool_calls`` parsed by TRL's response parser) and each tool reply.
        turns: assistant turns generated.
        calls: tool calls the model made (TRL's count: a call that failed included).
        tool_errors: of those, the calls that raised or named no tool (TRL replies
            ``{"error": ...}`` and the episode goes on).
        end: why the episode ended: ``done`` (the environment's ``done`` attribute turned
            true after a call; the turn's later calls are not run), ``no_call`` (a turn made no
            tool call, e.g. text that is not a well-formed call: the model stopped),
            ``turn_limit`` (``EvalRequest.max_turns`` turns, each with calls).
        reward: the episode's evaluation reward (``Task.eval_reward``, else ``get_reward()``).
        error_turns: turns with at least one of the ``tool_errors``.
    """

    seed: int
    env: Any
    messages: list[dict]
    turns: int
    calls: int
    tool_errors: int
    end: str
    reward: float
    error_turns: int = 0
