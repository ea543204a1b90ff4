"""The seam between the trainer and an environment: :class:`Task`, what the trainer needs from one.

The trainer's loop, fleet and stack know an environment only through a :class:`Task`: the rows
TRL trains on, the OpenEnv client TRL plays each episode with (its tool methods become the tool
schema) or the reward functions of a single-turn task, the server the local default starts, the
held-out evaluation, the per-episode counts each step logs, and the optional warm start. Wordle
(``trainer.task.wordle``) is the one shipped; ``--task module:NAME`` loads another
(:func:`load_task`). README "Your own environment" walks through writing one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltasync.status import TaskFigure
from trainer.trust import TrustedUrls

# The environment server's URL, handed to TRL's spawned rollout process (set by the run stack,
# read by a task's environment client or reward function).
ENV_URL_VAR = "DELTASYNC_ENV_URL"
# The episode reward the run trains on (``--reward``, one of ``Task.rewards``), handed the same way.
REWARD_VAR = "DELTASYNC_TASK_REWARD"
# The environment server's key (``Secrets.env_api_key``), handed the same way: the user's own
# variable, which the run stack also sets from a config built in Python; sent only to ENV_URL.
ENV_KEY_VAR = "WORDLE_API_KEY"


class TaskError(ValueError):
    """A task that cannot be loaded or that is missing what the run needs."""


@dataclass(frozen=True)
class EnvServer:
    """How the local default starts a task's environment server on 127.0.0.1.

    Attributes:
        name: the child's name (its log file is ``runs/<run>/logs/<name>.log``).
        args: the Python arguments, e.g. ``("-m", "wordle_env.server.app")``.
        cwd: the working folder, put first on the child's ``PYTHONPATH``.
        env: extra environment variables; ``PORT`` is set to a free port, and the server answers
            ``GET /health`` with 200 once it is ready.
    """

    name: str
    args: tuple[str, ...]
    cwd: str
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class EvalRequest:
    """What a held-out evaluation plays through (built by the run, handed to ``Task.evaluate``).

    Attributes:
        replica_url: the fleet router's base URL (OpenAI-compatible ``/v1``).
        model_path: the model folder whose tokenizer renders the prompts.
        env_url: the environment server's URL.
        model_name: the model name the requests carry (an adapter's served name; None: the
            replica's served model).
        max_tokens: completion tokens per assistant turn (the GRPO setting).
        draw: which sampling draw to play (0: the default). A task whose evaluation samples
            derives its per-request sampling seeds from the episode's seed and this draw, so the
            same draw replays the same tokens on the same weights (the paired comparison's
            common random numbers) and another draw samples other tokens on the same episodes
            (``EvalSettings.draws``).
        workers: episodes played at once (``HeldOutEvals`` sizes it to the serving replicas).
        headers: headers every request to ``replica_url`` carries: the run's key of the fleet
            router (``Authorization``, ``trainer.fleet.router.FleetRouter.headers``); never
            shown (``repr``).
        env_headers: headers of the connection to ``env_url`` (a private environment Space's
            ``Authorization``: :func:`space_headers`); never shown.
    """

    replica_url: str
    model_path: str
    env_url: str
    model_name: str | None
    max_tokens: int
    draw: int = 0
    workers: int = 16
    headers: dict[str, str] | None = field(default=None, repr=False)
    env_headers: dict[str, str] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Task:
    """What the trainer needs from an environment. Everything TRL's spawned rollout process uses
    (``environment_factory``, ``reward_funcs``) must be importable at module level.

    Attributes:
        name: the task's name (``--task``, the summary).
        dataset: ``f(rows, seed) -> datasets.Dataset``: the training rows, each a ``prompt``
            (chat messages) and the keyword arguments of the environment's ``reset``. All
            completions of one GRPO group come from one row.
        server: the environment server the local default starts (None: ``--env-url`` is needed).
        environment_factory: TRL's ``environment_factory``: a class whose ``reset(**row)`` starts
            an episode and whose public methods are the tools; TRL adds its ``get_reward()`` to
            the rewards. None for a single-turn task scored by ``reward_funcs``.
        reward_funcs: TRL reward functions ``f(prompts, completions, **row) -> list[float]``.
        eval_seeds: ``f(count) -> list``: the held-out episodes' seeds (kept out of ``dataset``).
        eval_seed_count: how many held-out seeds there are at most.
        evaluate: ``f(request: EvalRequest, seeds, temperature, per_seed) -> dict``: plays the
            seeds through the replica; the block has ``episodes``, ``reward_mean``,
            ``reward_se`` and, with ``per_seed``, each episode's reward in ``seeds`` order (for
            the paired comparison), plus any task figures (win rate, ...).
        check_context: ``f(replica_url, model_path, max_tokens, headers=None) -> int``: raises
            when the longest episode does not fit the replica's context (``headers``: the
            request's ``EvalRequest.headers``, the router's key); None: not checked.
        episode_counts: ``f(completion) -> {name: count}``: counts of one training episode (its
            messages after the prompt), summed over each step's games.
        turn_rewards: ``f(completion) -> [float | None]``: each assistant turn's own reward in
            one training episode (its messages after the prompt), in order, None where a turn
            has none (``--turn-credit``, ``trainer.loop.advantages.TurnCredit``); None: the
            task has no per-turn rewards.
        step_figures: ``f(counts, games) -> dict``: the step's figures from the summed counts,
            by the names of :attr:`figures` (e.g. Wordle's ``valid_rate``); None where not
            measured.
        figures: the task's own figures (``deltasync.status.TaskFigure``: name, label, unit,
            whether higher is better, measured on the training steps and/or the evaluations), in
            the order the step line, the summary and the dashboard show them. A figure that
            ``step_figures`` or ``evaluate`` returns but that is not declared is still recorded,
            with one warning (``trainer.loop.metrics``).
        rewards: the episode rewards the task's environment can pay (``--reward``; the run hands
            the chosen one to the task in ``$DELTASYNC_TASK_REWARD``), the first the default;
            () where it pays one only.
        attach: ``f(trainer, run, grpo)``: task-specific steps on TRL's trainer (e.g. the local
            Wordle model's answer rows tied to their spelling); None: nothing.
        warm_start: ``f(run, model_path, games) -> (model folder, seconds)``: a pretrained
            model's warm start on ``games`` teacher games before GRPO (when its chat template
            had no tools), or None where the task has none (the model is trained as it is).
        local_model: ``f(run, warm_start_settings) -> (model folder, seconds)``: the task's own
            small model for the local default (``--model tiny``), built from the run's
            ``warm_start`` section; None: the task needs ``--model``.
    """

    name: str
    dataset: Callable[[int, int], Any]
    eval_seeds: Callable[[int], list]
    eval_seed_count: int
    evaluate: Callable[..., dict]
    server: EnvServer | None = None
    environment_factory: type | None = None
    reward_funcs: Sequence[Callable] = ()
    check_context: Callable[..., int] | None = None
    episode_counts: Callable[[list], dict[str, int]] | None = None
    step_figures: Callable[[dict[str, int], int], dict] | None = None
    figures: tuple[TaskFigure, ...] = ()
    turn_rewards: Callable[[list], list[float | None]] | None = None
    rewards: tuple[str, ...] = ()
    attach: Callable[[Any, Any, Any], None] | None = None
    warm_start: Callable[[Any, str, int], tuple[str, float]] | None = None
    local_model: Callable[[Any, Any], tuple[str, float]] | None = None

    def __post_init__(self) -> None:
        if (self.environment_factory is None) == (not self.reward_funcs):
            raise TaskError(
                f"task {self.name!r}: expected either an environment_factory (tool episodes) or "
                "reward_funcs (single-turn), found "
                + ("both" if self.environment_factory is not None else "neither")
            )
        names = [f.name for f in self.figures]
        if len(set(names)) != len(names):
            raise TaskError(f"task {self.name!r}: expected figure names once each, found {names}")


def space_headers(url: str, hf_token: str | None, trust: TrustedUrls) -> dict[str, str]:
    """``Authorization: Bearer <hf_token>`` for a private Space the run trusts: ``https://`` on a
    ``*.hf.space`` host the user gave (``ENV_URL``, ``VLLM_URL``) or ``make spaces`` deployed
    for this run (``trainer.trust.TrustedUrls.may_send_hf_token``); else no header. The HF
    token (usually account-wide, write) never goes to another host, nor over plain http."""
    if hf_token and trust.may_send_hf_token(url):
        return {"Authorization": f"Bearer {hf_token}"}
    return {}


def env_headers(
    url: str, env_api_key: str | None, hf_token: str | None, trust: TrustedUrls
) -> dict[str, str]:
    """Headers of a connection to the environment server at ``url``: ``Bearer <env_api_key>``
    when a key is configured and the user gave ``url`` (``ENV_URL``, or the server the run
    started itself), else the HF token for a private Space the run trusts (:func:`space_headers`),
    else none. A public Space with a key needs no HF token, a private one has no key, so the key
    comes first."""
    if env_api_key:
        return {"Authorization": f"Bearer {env_api_key}"} if trust.given(url) else {}
    return space_headers(url, hf_token, trust)


# The tasks shipped, by name: "module:attribute" of their Task.
TASKS = {"wordle": "trainer.task.wordle:TASK"}


def load_task(spec: str) -> Task:
    """The :class:`Task` named ``spec``: a name of :data:`TASKS` or ``"package.module:NAME"``
    (your own, importable, e.g. ``my_env.task:TASK``).

    Raises:
        TaskError: the name is unknown, the module cannot be imported, or the attribute is not a
            Task; the message says what was expected and what was found.
    """
    target = TASKS.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(
            f"--task {spec!r}: expected one of {', '.join(sorted(TASKS))} or 'package.module:NAME' "
            "naming a trainer.task.base.Task"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(
            f"--task {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    task = getattr(module, attr, None)
    if not isinstance(task, Task):
        raise TaskError(
            f"--task {spec!r}: expected {module_name}.{attr} to be a trainer.task.base.Task, found "
            f"{type(task).__name__}"
        )
    return task
