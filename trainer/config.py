"""The trainer's settings, one typed section per part of the run. Environment variables are read
here and nowhere else.

:class:`TrainConfig` holds the sections; each part of the run is handed only its own:

==============  =====================================  ==========================================
section         class                                  given to
==============  =====================================  ==========================================
``run``         :class:`RunSettings`                   the stack (bucket, folders), the summary
``secrets``     :class:`Secrets`                       the bucket and the fleet (never logged)
``fleet``       :class:`FleetSettings`                 the replica pool and router, the env URL
``grpo``        :class:`GRPOSettings`                  ``trainer.loop.grpo.build_trainer``
``publish``     ``deltasync.publisher.PublisherConfig`` the publisher (anchors, retention, diff)
``local_model`` :class:`LocalModelSettings`            the task's own model (``--model tiny``)
``eval``        :class:`EvalSettings`                  the held-out evaluations
``adapter``     :class:`AdapterSettings`               ``trainer.loop.trained_weights``
``local``       :class:`LocalSettings`                 the children started on this machine
==============  =====================================  ==========================================

The command line and the ``make`` variables are flat (``--max-steps``, ``STEPS``): :data:`FLAGS`
maps each flag onto its section and field, and ``--help`` lists them by section.

With no bucket and no URLs (``make train``), everything runs on this machine: the task's local
model (``--model tiny``) created here, a bucket folder under ``runs/<run_id>/bucket``, and a
Wordle server and a vLLM replica started as child processes on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

from deltasync import cpu_dtype
from deltasync.cpu_dtype import DtypeChoice
from deltasync.publisher_config import PublisherConfig
from trainer.settings import (
    ADAPTERS,
    DEFAULT_HUB_MODEL,
    HUB_WARM_START_GAMES,
    TINY,
    AdapterConfigError,
    AdapterSettings,
    EvalConfigError,
    EvalSettings,
    FleetSettings,
    GRPOConfigError,
    GRPOSettings,
    LocalModelSettings,
    LocalSettings,
    NetConfigError,
    RunConfigError,
    RunSettings,
    Secrets,
)
from trainer.task.base import Task, load_task

__all__ = [  # the sections and their errors, re-exported for callers of the whole config
    "ADAPTERS",
    "DEFAULT_HUB_MODEL",
    "FLAGS",
    "HUB_CPU_DEFAULTS",
    "HUB_CPU_FULL_LEARNING_RATE",
    "HUB_WARM_START_GAMES",
    "TINY",
    "AdapterConfigError",
    "AdapterSettings",
    "EvalConfigError",
    "EvalSettings",
    "FleetSettings",
    "GRPOConfigError",
    "GRPOSettings",
    "LocalSettings",
    "NetConfigError",
    "RunConfigError",
    "RunSettings",
    "Secrets",
    "TrainConfig",
    "from_args",
    "hub_cpu_defaults",
    "train_dtype",
]

log = logging.getLogger("trainer")

# A hub model (or model folder) trained without CUDA takes these for every flag not given on the
# command line or in the environment (``from_args``): the recipe that learned on a 2-core machine
# (SmolLM2-135M-Instruct; docs/BENCHMARKS.md section 11, "Toward learning on 2 cores"; the runs that
# chose each value: docs/JOURNAL.md, "The trainer's defaults and the runs behind them").
HUB_CPU_DEFAULTS = {
    # a 135 M-parameter model trains ~100-200 tokens a second on 2 cores and an episode is ~900
    # tokens, so a step holds a few groups of 4
    "num_generations": 4,
    "per_device_train_batch_size": 8,
    "token_budget": 6144,
    # bf16 autocast over fp32 master weights where bf16 is native on this CPU (faster there, ~26x
    # slower where emulated); ``hub_cpu_defaults`` sets it from ``deltasync.cpu_dtype``
    "autocast": True,
    "max_steps": 40,  # the recipe was still learning when to stop at 30 steps
    "eval_episodes": 128,  # a paired standard error of ~0.013 before against after
    "eval_every": 10,
    "eval_curve_episodes": 32,
    "turn_credit": 1.0,  # each call's own credit raised the held-out valid share the most
    "reward": "game",  # the game's own reward gained the most on held-out games of those tried
}
# ... and full weights at 6e-5 there: the smallest rate tried at which 40 steps on 2 cores moved the
# held-out games (docs/JOURNAL.md); an adapter keeps TrainConfig's own default.
HUB_CPU_FULL_LEARNING_RATE = 6e-5


@dataclass
class TrainConfig:
    """Settings of one training run, by section (see the module docstring). Build it from flat
    flag names with :meth:`from_flags` (what the command line does); model-dependent defaults
    (``grpo.learning_rate``, ``grpo.tie_answer_rows``) are resolved on construction."""

    run: RunSettings = field(default_factory=RunSettings)
    secrets: Secrets = field(default_factory=Secrets, repr=False)
    fleet: FleetSettings = field(default_factory=FleetSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    publish: PublisherConfig = field(default_factory=PublisherConfig)
    local_model: LocalModelSettings = field(default_factory=LocalModelSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    adapter: AdapterSettings = field(default_factory=AdapterSettings)
    local: LocalSettings = field(default_factory=LocalSettings)

    def __post_init__(self) -> None:
        local, full = self.run.trains_local_model, self.adapter.kind is None
        if self.grpo.learning_rate is None:
            self.grpo.learning_rate = 2e-4 if local else (1e-6 if full else 1e-5)
        if self.grpo.tie_answer_rows is None:
            self.grpo.tie_answer_rows = local and full
        task = self.task()
        self.eval.check_seeds(task.eval_seed_count)
        if self.grpo.turn_credit and task.turn_rewards is None:
            raise GRPOConfigError(
                f"--turn-credit {self.grpo.turn_credit}: expected a task with per-turn rewards "
                f"(Task.turn_rewards), found none in task {task.name!r}; use --turn-credit 0"
            )
        if self.grpo.reward is None and task.rewards:
            self.grpo.reward = task.rewards[0]
        if self.grpo.reward is not None and self.grpo.reward not in task.rewards:
            raise GRPOConfigError(
                f"--reward {self.grpo.reward}: expected one of the rewards task {task.name!r} "
                f"pays ({', '.join(task.rewards) or 'none to choose from'}); "
                + (f"use e.g. --reward {task.rewards[0]}" if task.rewards else "drop --reward")
            )
        self.local_model = dataclasses.replace(self.local_model, seed=self.run.seed)  # one seed
        rebuilds = self.grpo.off_policy != "off" or self.grpo.off_policy_stats
        if rebuilds and not full:
            raise AdapterConfigError(
                f"--off-policy {self.grpo.off_policy} (or --off-policy-stats true) with --adapter "
                f"{self.adapter.kind}: expected a full-weight run, found an adapter run; the "
                "generating policy is rebuilt from full-weight versions only. Use --off-policy "
                "off for adapter runs"
            )

    def task(self) -> Task:
        """The run's :class:`~trainer.task.base.Task` (``run.task``).

        Raises:
            trainer.task.TaskError: the task cannot be loaded."""
        return load_task(self.run.task)

    def record(self) -> dict:
        """Every setting that shapes the run, by section, as ``summary.json`` records it under
        ``settings`` (the secrets left out; values JSON-safe: anything else as its ``str``)."""
        sections = {
            f.name: dataclasses.asdict(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name != "secrets"
        }
        return json.loads(json.dumps(sections, default=str))

    @classmethod
    def from_flags(cls, **flags) -> TrainConfig:
        """The config from flat flag names (``max_steps=30``, ``adapter="lora"``; :data:`FLAGS`),
        the rest at their defaults.

        Raises:
            TypeError: a name that is not a flag.
            AdapterConfigError, EvalConfigError, GRPOConfigError: a value the run cannot use.
        """
        unknown = sorted(set(flags) - set(FLAGS))
        if unknown:
            raise TypeError(f"not trainer flags: {unknown}; the flags are {sorted(FLAGS)}")
        by_section: dict[str, dict] = {}
        for flag, value in flags.items():
            section, name, _ = FLAGS[flag]
            by_section.setdefault(section, {})[name] = value
        types = typing.get_type_hints(cls)
        return cls(**{s: types[s](**kw) for s, kw in by_section.items()})

    def flag(self, name: str):
        """The value of flag ``name`` (:data:`FLAGS`), e.g. ``cfg.flag("max_steps")``."""
        section, field_name, _ = FLAGS[name]
        return getattr(getattr(self, section), field_name)


# flag -> (section, field, environment variable or None); the command line, the Makefile's
# variables and :meth:`TrainConfig.from_flags` all use these names. Secrets have no flag.
FLAGS: dict[str, tuple[str, str, str | None]] = {
    "bucket": ("run", "bucket", "BUCKET"),
    "run_id": ("run", "run_id", "RUN_ID"),
    "model": ("run", "model", "MODEL"),
    "task": ("run", "task", "TASK"),
    "hub_warm_start_games": ("run", "hub_warm_start_games", None),
    "hub_warm_start_turns": ("run", "hub_warm_start_turns", None),
    "runs_root": ("run", "runs_root", None),
    "cache_dir": ("run", "cache_dir", None),
    "output_dir": ("run", "output_dir", None),
    "seed": ("run", "seed", None),
    "net": ("run", "net", "NET"),
    "run_key": ("run", "run_key", "RUN_KEY"),
    "hf_token": ("secrets", "hf_token", "HF_TOKEN"),
    "rollout_api_key": ("secrets", "rollout_api_key", "ROLLOUT_API_KEY"),
    "env_api_key": ("secrets", "env_api_key", "WORDLE_API_KEY"),
    "vllm_url": ("fleet", "vllm_url", "VLLM_URL"),
    "env_url": ("fleet", "env_url", "ENV_URL"),
    "fleet_wait_s": ("fleet", "wait_s", None),
    "fleet_health_interval_s": ("fleet", "health_interval_s", None),
    "fleet_discover_interval_s": ("fleet", "discover_interval_s", None),
    "max_steps": ("grpo", "max_steps", "STEPS"),
    **{
        name: ("grpo", name, None)
        for name in (
            "learning_rate",
            "num_generations",
            "scale_rewards",
            "tie_answer_rows",
            "per_device_train_batch_size",
            "max_completion_length",
            "max_tool_calling_iterations",
            "max_staleness",
            "max_inflight_tasks",
            "queue_maxsize",
            "token_budget",
            "weight_sync_steps",
            "bf16",
            "autocast",
            "off_policy",
            "tis_cap",
            "off_policy_stats",
            "turn_credit",
            "reward",
            "max_dropped_fraction",
            "max_dropped_steps",
        )
    },
    "anchor_every": ("publish", "anchor_every", None),
    "keep_anchors": ("publish", "keep_anchors", None),
    "diff_on": ("publish", "diff_on", None),
    "takeover": ("publish", "takeover", None),
    "new_run": ("publish", "new_run", None),
    "adaptive_cadence": ("publish", "adaptive_cadence", None),
    "hub_plan": ("publish", "hub_plan", None),
    "warm_start_games": ("local_model", "games", None),
    "warm_start_epochs": ("local_model", "epochs", None),
    "model_hidden_size": ("local_model", "hidden_size", None),
    "model_layers": ("local_model", "layers", None),
    "eval_episodes": ("eval", "episodes", None),
    "eval_every": ("eval", "every", None),
    "eval_curve_episodes": ("eval", "curve_episodes", None),
    "eval_temperature": ("eval", "temperature", None),
    "eval_draws": ("eval", "draws", None),
    "eval_per_replica": ("eval", "per_replica", None),
    "adapter": ("adapter", "kind", "ADAPTER"),
    "lora_rank": ("adapter", "rank", None),
    "lora_alpha": ("adapter", "alpha", None),
    "lora_target_modules": ("adapter", "target_modules", None),
    "adapter_name": ("adapter", "name", None),
    "dashboard": ("local", "dashboard", None),
    "dashboard_port": ("local", "dashboard_port", None),
    "replica_sync_every": ("local", "replica_sync_every", "SYNC_EVERY"),
}
_SECRETS = ("hf_token", "rollout_api_key", "env_api_key")  # from the environment only


def _default(flag: str):
    """The default of flag ``flag`` (its section field's default)."""
    section, name, _ = FLAGS[flag]
    f = {f.name: f for f in dataclasses.fields(typing.get_type_hints(TrainConfig)[section])}[name]
    return f.default


def hub_cpu_defaults(kw: dict, cuda: bool | None = None) -> dict:
    """``kw`` (the flags given) with ``HUB_CPU_DEFAULTS`` (and, for full weights,
    ``HUB_CPU_FULL_LEARNING_RATE``) for those not given, when the run trains a hub model (not
    ``tiny``) without CUDA (``cuda``: None asks torch); else ``kw``. ``autocast`` only where bf16
    is native on this CPU (``deltasync.cpu_dtype.native_dtype``; elsewhere float32),
    ``turn_credit`` only for a task with per-turn rewards (``Task.turn_rewards``), ``reward`` only
    for a task that pays it (``Task.rewards``).

    Raises:
        deltasync.cpu_dtype.CpuDtypeError: ``DELTASYNC_CPU_DTYPE`` holds an unknown dtype."""
    probe = RunSettings(bucket=kw.get("bucket"), model=kw.get("model"))
    if probe.trains_local_model:
        return kw
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return kw
    full = {"learning_rate": HUB_CPU_FULL_LEARNING_RATE} if kw.get("adapter") is None else {}
    defaults = dict(HUB_CPU_DEFAULTS)
    defaults["autocast"] = cpu_dtype.native_dtype(cuda=False).bf16  # emulated bf16: float32
    task = _loaded_task(kw.get("task") or RunSettings.task)
    if task is None or task.turn_rewards is None:
        del defaults["turn_credit"]  # a task without per-turn rewards trains as GRPO does
    if task is None or defaults["reward"] not in task.rewards:
        del defaults["reward"]  # a task that does not pay it trains on its own first
    return {**defaults, **full, **kw}


def _loaded_task(task: str) -> Task | None:
    """Task ``task``, or None where it cannot be loaded: :class:`TrainConfig` reports that when
    the run builds its config, so here it has no per-turn or episode rewards to choose."""
    from trainer.task.base import TaskError

    try:
        return load_task(task)
    except TaskError:
        return None


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, found {s!r}")


def _kind(flag: str) -> Callable[[str], object]:
    """The parser of flag ``flag``'s values (``X | None``: ``X``'s)."""
    section, name, _ = FLAGS[flag]
    hint = typing.get_type_hints(typing.get_type_hints(TrainConfig)[section])[name]
    optional = typing.get_args(hint)  # (X, NoneType) for ``X | None``
    hint = optional[0] if optional else hint
    return _parse_bool if hint is bool else hint


def field_docs(cls) -> dict[str, str]:
    """``{field: its description}`` from the ``Attributes:`` section of a settings class's
    docstring (Google style: ``name: text``, continuation lines indented further), as ``--help``
    shows them; {} where the class documents none."""
    docs: dict[str, str] = {}
    lines = (cls.__doc__ or "").split("\n")
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return docs
    indent, name = None, None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:
            break  # the section ended
        head, sep, text = line.strip().partition(": ")
        if depth == indent and sep and head.isidentifier():
            name, docs[head] = head, text
        elif name is not None:
            docs[name] += " " + line.strip()
    return {k: v.replace("``", "") for k, v in docs.items()}


def from_args(argv: list[str] | None = None) -> TrainConfig:
    """Build the config from command-line flags (``--max-steps 30``, one per :data:`FLAGS` entry,
    listed by section in ``--help``), falling back to the environment variables the flags name,
    which the Makefile passes: ``BUCKET``, ``MODEL``, ``VLLM_URL``, ``ENV_URL``, ``RUN_ID``,
    ``STEPS`` (max_steps), ``ADAPTER``; then to the fields' defaults. Secrets (``HF_TOKEN``,
    ``ROLLOUT_API_KEY``, ``WORDLE_API_KEY``) come from the environment only. With a bucket and
    no run id, the run id is the bucket's last path part. A hub model trained without CUDA takes ``HUB_CPU_DEFAULTS``
    for the flags not given (:func:`hub_cpu_defaults`).

    Raises:
        SystemExit: (code 2, from argparse) a flag or a variable whose value does not parse, or
            settings a section refuses (its message is printed).
    """
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.split("\n\n")[0])
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag, (section, _, var) in FLAGS.items():
        if flag in _SECRETS:  # a secret has no flag: command lines are visible to every local user
            continue
        if section not in groups:
            doc = typing.get_type_hints(TrainConfig)[section].__doc__ or ""
            groups[section] = p.add_argument_group(section, doc.strip().split("\n")[0])
        default = f"default: {f'${var}, else ' if var else ''}{_default(flag)}"
        doc = field_docs(typing.get_type_hints(TrainConfig)[section]).get(FLAGS[flag][1])
        groups[section].add_argument(
            "--" + flag.replace("_", "-"),
            type=_kind(flag),
            default=None,  # not given: the variable, else the field's default
            help=(f"{doc} ({default})" if doc else default).replace("%", "%%"),
        )
    ns = p.parse_args(argv)
    kw = {}
    for flag, (_, _, var) in FLAGS.items():
        raw = os.environ.get(var, "") if var else ""
        if raw.strip():
            try:
                kw[flag] = _kind(flag)(raw)
            except (ValueError, argparse.ArgumentTypeError):
                what = {int: "an integer", float: "a number", _parse_bool: "true/false"}
                p.error(
                    f"{var}: expected {what.get(_kind(flag), 'a string')}, found {raw!r}; "
                    f"fix it, or unset it for the default ({_default(flag)!r})"
                )
    kw.update({k: v for k, v in vars(ns).items() if v is not None})
    given = dict(kw)
    try:
        kw = hub_cpu_defaults(kw)
        cfg = TrainConfig.from_flags(**kw)
    except ValueError as e:  # a section refused a value (AdapterConfigError, CpuDtypeError, ...)
        p.error(str(e))
    log.info("%s", model_defaults_line(cfg, given))
    return cfg


def model_defaults_line(cfg: TrainConfig, given: dict) -> str:
    """One line naming the settings the model chose, not the user: ``HUB_CPU_DEFAULTS`` for a
    hub model without CUDA (:func:`hub_cpu_defaults`), and the learning rate and answer-row tie
    that ``TrainConfig.__post_init__`` sets by model and adapter; ``given``: the flags and
    variables the user set. Each is overridden by its flag. Then the dtype the run trains in and
    why (:func:`train_dtype`)."""
    hub_cpu = cfg.run.trains_local_model is False and hub_cpu_defaults(dict(given)) != given
    chosen = [k for k in HUB_CPU_DEFAULTS if hub_cpu and k not in given]
    chosen += [
        k for k in ("learning_rate", "tie_answer_rows") if k not in given and k not in chosen
    ]
    where = "the local model" if cfg.run.trains_local_model else cfg.run.model_id()
    where += " without CUDA (HUB_CPU_DEFAULTS)" if hub_cpu else ""
    pairs = ", ".join(f"--{k.replace('_', '-')} {_flag_value(cfg, k)}" for k in chosen)
    dtype = train_dtype(cfg.grpo)
    return (
        f"settings chosen for {where}: {pairs or 'none'} (a flag overrides each); "
        f"training dtype {dtype.dtype} ({dtype.reason})"
    )


def train_dtype(grpo: GRPOSettings, cuda: bool | None = None) -> DtypeChoice:
    """The dtype the forward and backward compute in, and why, in one line: ``bfloat16`` under
    ``--bf16`` (bf16 weights) or ``--autocast`` (bf16 autocast over float32 master weights), else
    ``float32``; the reason adds whether bf16 is native on this machine
    (``deltasync.cpu_dtype.native_dtype``; ``cuda``: None asks torch).

    Raises:
        deltasync.cpu_dtype.CpuDtypeError: ``DELTASYNC_CPU_DTYPE`` holds an unknown dtype.
    """
    machine = cpu_dtype.native_dtype(cuda)
    if grpo.bf16:
        how = "--bf16: bf16 weights"
    elif grpo.autocast:
        how = "--autocast: bf16 autocast over float32 master weights"
    else:
        how = "neither --autocast nor --bf16"
    return DtypeChoice(
        "bfloat16" if grpo.bf16 or grpo.autocast else "float32", f"{how}; {machine.reason}"
    )


def _flag_value(cfg: TrainConfig, flag: str):
    section, name, _ = FLAGS[flag]
    return getattr(getattr(cfg, section), name)
