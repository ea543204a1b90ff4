"""The seam between the trainer and an environment: :class:`Task`, what the trainer needs from one.

The trainer's loop, fleet and stack know an environment only through a :class:`Task`: the rows
TRL trains on, the OpenEnv client TRL plays each episode with (its tool methods become the tool
schema) or the reward functions of a single-turn task, the server the local default starts, the
held-out evaluation (a tool task's is generic: ``trainer.task.tool_eval``; the task gives its
seeds, rows and figures), the per-episode counts each step logs, and the optional warm start. Wordle
(``trainer.task.wordle.task``) is the one shipped; ``--task module:NAME`` loads another
(:func:`load_task`). README "Your own environment" walks through writing one.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltasync.status import TaskFigure
from trainer.task.tool_episode import ToolEpisode
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
    """What a held-out evaluation plays through (built by the run, handed to
    :meth:`Task.run_evaluation`).

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
        max_turns: assistant turns an episode may take at most, 1..16 (a tool task's generic
            evaluation, ``trainer.task.tool_eval``, runs each turn's calls, so an episode makes
            as many rounds of calls as TRL's ``max_tool_calling_iterations``, which the run
            passes).
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
    max_turns: int = 7
    headers: dict[str, str] | None = field(default=None, repr=False)
    env_headers: dict[str, str] | None = field(default=None, repr=False)


# The generic evaluation's own figures (``trainer.task.tool_eval``), declared for every task that
# uses it (added to ``Task.figures`` after the task's own).
TOOL_FIGURES = (
    TaskFigure(
        name="turns_mean",
        label="turns an episode",
        unit="turns",
        higher_is_better=None,
        steps=False,
    ),
    # tool calls that raised or named no tool, of all calls (TRL's tools/failure_frequency)
    TaskFigure(
        name="tool_error_rate",
        label="tool errors",
        unit="share",
        higher_is_better=False,
        steps=False,
    ),
)


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
            the paired comparison), plus any task figures (win rate, ...). None for a tool task:
            the generic evaluation (``trainer.task.tool_eval``) plays each held-out episode
            through the replica with the task's ``environment_factory``, built as
            ``environment_factory(env_url=..., env_headers=...)`` (TRL builds it with no
            arguments; an instance that is a context manager is closed after its episode),
            TRL's chat rendering and response parser, and :attr:`eval_row`; its seeds are
            integers in 0..2**28-1 (``trainer.task.eval_http.sampling_seed``). Either this or
            :attr:`eval_row` with :attr:`environment_factory` is needed. Called through
            :meth:`run_evaluation`.
        eval_row: ``f(seed) -> dict``: the held-out episode's row, as ``dataset``'s rows: its
            ``prompt`` and what the environment's ``reset(**row)`` takes (TRL passes it the
            whole row); the generic evaluation only.
        eval_figures: ``f(episodes: list[ToolEpisode]) -> dict``: the task's figures of a
            generic evaluation, by the names of :attr:`figures` (e.g. a win rate); None: the
            generic block only (``episodes``, ``reward_mean``, ``reward_se``, ``turns_mean``,
            ``tool_error_rate``: :data:`TOOL_FIGURES`), whose names it cannot override.
        eval_reward: ``f(env) -> float``: an episode's evaluation reward from its environment
            after play (e.g. what the game itself pays); None: ``env.get_reward()``.
        space: the environment's Space folder (a Dockerfile and a README with the Space's card),
            relative to the repository or absolute, that ``make spaces TASK=...`` deploys; None:
            the task has no Space of its own (``--env-url`` names a running server).
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
            with one warning (``trainer.loop.metrics``). A task with the generic evaluation
            gets :data:`TOOL_FIGURES` added after its own (those it declares itself kept).
        rewards: the episode rewards the task's environment can pay (``--reward``; the run hands
            the chosen one to the task in ``$DELTASYNC_TASK_REWARD``), the first the default;
            () where it pays one only.
        attach: ``f(trainer, run, grpo)``: task-specific steps on TRL's trainer (e.g. the local
            Wordle model's answer rows tied to their spelling); None: nothing.
        warm_start: ``f(run, model_path, games) -> (model folder, seconds)``: a pretrained
            model's warm start on ``games`` teacher games before GRPO (when its chat template
            had no tools), or None where the task has none (the model is trained as it is).
        local_model: ``f(run, local_model_settings) -> (model folder, seconds)``: the task's own
            small model for the local default (``--model tiny``), built with the run's
            ``trainer.settings.LocalModelSettings`` (the fields given override the task's
            defaults); None: the task needs ``--model``.
    """

    name: str
    dataset: Callable[[int, int], Any]
    eval_seeds: Callable[[int], list]
    eval_seed_count: int
    evaluate: Callable[..., dict] | None = None
    eval_row: Callable[[int], dict] | None = None
    eval_figures: Callable[[list[ToolEpisode]], dict] | None = None
    eval_reward: Callable[[Any], float] | None = None
    space: str | None = None
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
        if self.evaluate is None:
            self._check_generic_evaluation()
            own = {f.name for f in self.figures}
            extra = tuple(f for f in TOOL_FIGURES if f.name not in own)
            object.__setattr__(self, "figures", (*self.figures, *extra))
        names = [f.name for f in self.figures]
        if len(set(names)) != len(names):
            raise TaskError(f"task {self.name!r}: expected figure names once each, found {names}")

    def _check_generic_evaluation(self) -> None:
        """A task without ``evaluate`` needs what the generic evaluation plays: an
        ``environment_factory`` that takes ``env_url`` and ``env_headers``, and ``eval_row``."""
        if self.environment_factory is None or self.eval_row is None:
            found = "no environment_factory" if self.environment_factory is None else "no eval_row"
            raise TaskError(
                f"task {self.name!r}: expected an evaluate function, or an environment_factory "
                f"and an eval_row for the generic evaluation of tool tasks, found {found}; give "
                "Task(evaluate=...) or Task(eval_row=f(seed) -> {'prompt': ..., **reset_kwargs})"
            )
        try:
            params = inspect.signature(self.environment_factory).parameters.values()
        except (TypeError, ValueError):
            return  # a builtin or C callable: no signature to check; a call will tell
        names = {p.name for p in params}
        if any(p.kind is p.VAR_KEYWORD for p in params) or {"env_url", "env_headers"} <= names:
            return
        raise TaskError(
            f"task {self.name!r}: expected environment_factory(env_url=None, env_headers=None) "
            "(the generic evaluation connects each held-out episode to the run's server), found "
            f"{getattr(self.environment_factory, '__name__', self.environment_factory)}"
            f"{inspect.signature(self.environment_factory)}; add both keyword arguments (None: "
            "what TRL's rollout builds with no arguments)"
        )

    def run_evaluation(
        self, request: EvalRequest, seeds: list, temperature: float, per_seed: bool = False
    ) -> dict:
        """Play the held-out ``seeds`` through ``request``'s replica: the task's own
        :attr:`evaluate` when it has one, else the generic evaluation of tool tasks
        (``trainer.task.tool_eval.evaluate_tool_task``).

        Args:
            request: what the episodes play through (replica, model, environment server, ...).
            seeds: the held-out episodes' seeds (:attr:`eval_seeds`).
            temperature: sampling temperature (0: greedy).
            per_seed: add ``per_seed``: each episode's reward in ``seeds`` order.

        Returns:
            the evaluation block: ``episodes``, ``reward_mean``, ``reward_se``, the task's
            figures (and, generic, ``turns_mean``, ``tool_error_rate``), ``per_seed`` if asked.

        Raises:
            trainer.task.eval_http.EvalError: (generic evaluation) the replica did not answer
                usably, or an episode had no reward; an error of the environment's construction
                or ``reset`` is raised as it is. A task's own ``evaluate`` raises its own.
        """
        if self.evaluate is not None:
            return self.evaluate(request, seeds, temperature, per_seed)
        from trainer.task.tool_eval import evaluate_tool_task

        return evaluate_tool_task(self, request, seeds, temperature, per_seed)


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
TASKS = {
    "wordle": "trainer.task.wordle.task:TASK",
    "number_guess": "examples.number_guess.task:TASK",
}


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
