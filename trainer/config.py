"""The trainer's settings, one typed section per part of the run. Environment variables are read
here and nowhere else.

:class:`TrainConfig` holds the sections; each part of the run is handed only its own:

==============  =====================================  ==========================================
section         class                                  given to
==============  =====================================  ==========================================
``run``         :class:`RunSettings`                   the stack (bucket, folders), the summary
``secrets``     :class:`Secrets`                       the bucket and the fleet (never logged)
``fleet``       :class:`FleetSettings`                 the replica pool and router, the Wordle URL
``grpo``        :class:`GRPOSettings`                  ``trainer.loop.grpo.build_trainer``
``publish``     ``deltasync.publisher.PublisherConfig`` the publisher (anchors, retention, diff)
``warm_start``  ``trainer.task.warm_start.WarmStartConfig`` the local model's warm start
``eval``        :class:`EvalSettings`                  the held-out evaluations
``adapter``     :class:`AdapterSettings`               ``trainer.loop.trained_weights``
``local``       :class:`LocalSettings`                 the children started on this machine
==============  =====================================  ==========================================

The command line and the ``make`` variables are flat (``--max-steps``, ``STEPS``): :data:`FLAGS`
maps each flag onto its section and field, and ``--help`` lists them by section.

With no bucket and no URLs (``make train``), everything runs on this machine: a tiny model
created locally, a bucket folder under ``runs/<run_id>/bucket``, and a Wordle server and a vLLM
replica started as child processes on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

from deltasync.publisher_config import PublisherConfig
from trainer.task.warm_start import WarmStartConfig
from trainer.task.wordle_task import EVAL_SEED_COUNT, space_headers

DEFAULT_HUB_MODEL = "Qwen/Qwen3-0.6B"
TINY = "tiny"
ADAPTERS = ("lora",)  # the adapter kinds a run can train (``AdapterSettings.kind``)
# Modules vLLM cannot serve a LoRA on (TRL's ``validate_lora_for_vllm_sync`` refuses them too).
_NOT_LORA_TARGETS = ("lm_head", "embed_tokens")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # the replica's ADAPTER_NAME rule
_VERSIONED = re.compile(r".*-v[0-9]+")
# Teacher games of the warm start of a hub model that has never been shown a tool
# (``RunSettings.hub_warm_start_games``): about 6 minutes of SFT for SmolLM2-135M on 2 cores,
# after which 32 of 32 sampled first calls parsed and 27 were valid words
# (``trainer.task.hub_warm_start.HubWarmStartConfig``).
HUB_WARM_START_GAMES = 96
# A hub model (or model folder) trained without CUDA: settings that fit a 2-core machine, used for
# every one of these flags not given on the command line or in the environment (``from_args``). A
# 135 M-parameter model trains ~100 tokens a second there and its episodes are ~1,300 tokens; the
# replica plays a 5-guess game in ~10 s. docs/BENCHMARKS.md section 11.
HUB_CPU_DEFAULTS = {
    "num_generations": 4,
    "per_device_train_batch_size": 8,
    "token_budget": 6144,
    "eval_episodes": 64,
    "eval_curve_episodes": 16,
}


class EvalConfigError(ValueError):
    """An evaluation setting (``eval_episodes``, ``eval_curve_episodes``) asks for more games than
    there are held-out seeds; the message says the limit and how to fix it."""


class GRPOConfigError(ValueError):
    """A GRPO setting (``scale_rewards``) has a value the run cannot use; the message says the
    accepted values."""


class AdapterConfigError(ValueError):
    """An adapter setting (``adapter``, ``lora_*``, ``adapter_name``) has a value the run cannot
    use; the message says what was expected, what was found and how to fix it."""


@dataclass
class RunSettings:
    """The run, its bucket and the model it starts from.

    Attributes:
        bucket: run URI (``user/run`` means ``hf://buckets/user/run``; or hf://, s3://, file://, a
            folder). None: ``runs/<run_id>/bucket`` (the local default).
        run_id: the run's name (bucket manifest, local folders).
        model: hub id or local folder; ``tiny`` creates a ~2.7 M-parameter Qwen3 locally. Default:
            ``tiny`` for the local run, ``Qwen/Qwen3-0.6B`` with a bucket.
        hub_warm_start_games: teacher games a hub model (or model folder) is fine-tuned on before
            GRPO (``trainer.task.hub_warm_start``; cut to their first 3 calls; 0: none). None:
            ``HUB_WARM_START_GAMES`` when the model's chat template has no tools (it has never
            been shown one: SmolLM2-135M-Instruct wrote 0 parsable calls in 512 games), else 0
            (Qwen3 keeps its own tool calling).
        runs_root: folder of local run folders (``<runs_root>/<run_id>``: model, bucket, logs).
        cache_dir: where warm-started models are cached (None: ``<runs_root>/cache``).
        output_dir: TRL's output folder (None: ``<run_dir>/trainer``).
        seed: seed of the model init, the warm start, the data order and the games.
    """

    bucket: str | None = None
    run_id: str = "wordle-local"
    model: str | None = None
    hub_warm_start_games: int | None = None
    runs_root: str = "runs"
    cache_dir: str | None = None
    output_dir: str | None = None
    seed: int = 0

    @property
    def local(self) -> bool:
        """Whether this is the embedded default (nothing remote)."""
        return self.bucket is None

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_root, self.run_id)

    @property
    def cache(self) -> str:
        """The warm-start cache folder (``cache_dir``, else ``<runs_root>/cache``)."""
        return self.cache_dir or os.path.join(self.runs_root, "cache")

    def bucket_uri(self) -> str:
        """The bucket URI (``user/run`` shorthand expanded by ``deltasync.store.resolve_uri``)."""
        from deltasync.store import resolve_uri

        if self.bucket is None:
            return os.path.abspath(os.path.join(self.run_dir, "bucket"))
        return resolve_uri(self.bucket)

    def model_id(self) -> str:
        return self.model or (TINY if self.local else DEFAULT_HUB_MODEL)

    def hub_warm_start_game_count(self, template_swapped: bool) -> int:
        """Teacher games of a hub model's warm start (see ``hub_warm_start_games``);
        ``template_swapped``: the model's own template had no tools."""
        if self.hub_warm_start_games is not None:
            return self.hub_warm_start_games
        return HUB_WARM_START_GAMES if template_swapped else 0


@dataclass
class Secrets:
    """Tokens, from the environment only (a command line is visible to every local user); never
    logged (``repr=False``) and never written to the bucket.

    Attributes:
        hf_token: for hf:// buckets and private Spaces; from ``HF_TOKEN``.
        rollout_api_key: the replica's ``ROLLOUT_API_KEY`` (replicas outside Spaces); from
            ``ROLLOUT_API_KEY``.
    """

    hf_token: str | None = field(default=None, repr=False)
    rollout_api_key: str | None = field(default=None, repr=False)

    def rollout_headers(self, url: str) -> dict[str, str]:
        """Headers for requests to the replica at ``url``: ``Bearer <rollout_api_key>`` when one
        is configured, else ``Bearer <hf_token>`` for a ``*.hf.space`` URL (a private Space),
        else none. The HF token is never sent to other hosts."""
        if self.rollout_api_key:
            return {"Authorization": f"Bearer {self.rollout_api_key}"}
        return space_headers(url, self.hf_token)

    def store_options(self, uri: str) -> dict:
        """Keyword arguments of ``deltasync.store.Store`` for ``uri``: the HF token for hf://."""
        return {"token": self.hf_token} if uri.startswith("hf://") and self.hf_token else {}


@dataclass
class FleetSettings:
    """The rollout replicas and the Wordle environment they play (``trainer.fleet``).

    Attributes:
        vllm_url: comma-separated replica base URLs (their ``/v1`` OpenAI API), and/or ``auto``
            (every replica that announces its URL in a fresh bucket heartbeat joins). None:
            ``auto`` with a bucket; for the local default, one replica started here (and others
            that follow the local bucket join).
        env_url: the Wordle environment server's URL. None: start one locally.
        wait_s: how long rollouts wait while no replica serves before they fail, seconds.
        health_interval_s: seconds between the fleet's health checks of each replica (HTTP
            ``/health``; no Hub call).
        discover_interval_s: seconds between reads of the replicas' heartbeats in a remote bucket
            (one listing, an API call, and one read per replica each time; replicas write theirs
            60 s apart there). On a local bucket: every health check.
    """

    vllm_url: str | None = None
    env_url: str | None = None
    wait_s: float = 900.0
    health_interval_s: float = 5.0
    discover_interval_s: float = 60.0


@dataclass
class GRPOSettings:
    """TRL's AsyncGRPOTrainer and the update (``trainer.loop.grpo``).

    Attributes:
        max_steps: optimizer steps (55 for the local default: with the warm start, the whole
            run fits 15 minutes on 2 cores at 6-8 s a step and gains about +0.02 on held-out
            games; docs/BENCHMARKS.md section 6).
        learning_rate: AdamW learning rate. None (resolved by :class:`TrainConfig`): 2e-4 for the
            ~2.7 M-parameter local model (at 1e-5 its bf16 weights barely move: an update smaller
            than half a bf16 ulp is lost in the rounding), 1e-6 for hub models (RL-typical),
            1e-5 for a LoRA adapter on a hub model (an adapter starts at zero).
        num_generations: completions per GRPO group (they all play the same word).
        scale_rewards: how a group's rewards become advantages, as TRL's ``GRPOConfig`` names it:
            ``none`` (the default): ``r - mean`` (``trainer.loop.advantages``); ``group``:
            ``(r - mean) / std`` over the group, what TRL's async worker does (docs/BENCHMARKS.md
            section 6 compares them).
        tie_answer_rows: GRPO changes the local model's answer rows only along their spelling
            (``trainer.loop.spelling_tie``), so what it learns on training words reaches held-out
            words. None (resolved by :class:`TrainConfig`): on for the local model trained in
            full, off otherwise (a hub tokenizer does not hold the answers as single tokens).
        per_device_train_batch_size: episodes generated concurrently and queued for the trainer
            (TRL's ``samples_per_step``). How many a step trains on is set by ``token_budget``.
        max_completion_length: tokens per assistant turn (TRL applies it to each turn): a
            ``guess`` call is 10 tokens with the local tokenizer and about 25 with Qwen3's.
        max_tool_calling_iterations: tool calls per game, at most (6 guesses + 1 invalid move).
        max_staleness: drop rollouts generated by a policy more than this many versions behind
            (versions as really served, ``trainer.loop.rollout_tagging``); 4, TRL's default. The
            same bound drains a replica from the fleet while it is more than this many versions
            behind the newest publish.
        max_inflight_tasks: episodes generated concurrently. None: ``per_device_train_batch_size``.
        queue_maxsize: scored samples buffered for the trainer. None:
            ``per_device_train_batch_size``, so the next step's games are generated while the
            trainer runs this one.
        token_budget: tokens per training row (TRL's token-budget batching), which sets the games
            per optimizer step (24,576 holds about 70 local-model episodes). Set explicitly so
            TRL does not query the replica's ``/v1/models`` before it has its first version.
        weight_sync_steps: optimizer steps between publishes.
        bf16: train with bf16 autocast (GPU); the CPU default trains in fp32 and publishes bf16.
    """

    max_steps: int = 55
    learning_rate: float | None = None
    num_generations: int = 8
    scale_rewards: str = "none"
    tie_answer_rows: bool | None = None
    per_device_train_batch_size: int = 64
    max_completion_length: int = 32
    max_tool_calling_iterations: int = 7
    max_staleness: int = 4
    max_inflight_tasks: int | None = None
    queue_maxsize: int | None = None
    token_budget: int = 24576
    weight_sync_steps: int = 1
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.scale_rewards not in ("group", "none"):
            raise GRPOConfigError(
                f"scale_rewards={self.scale_rewards!r}: expected 'group' (TRL's (r - mean) / std) or "
                "'none' (r - mean); set --scale-rewards to one of them"
            )


@dataclass
class EvalSettings:
    """The held-out evaluations through the replica (``trainer.loop.learning_curve``).

    Attributes:
        episodes: held-out games played before the first GRPO step and after the last, compared
            game by game (0: none; at most the 512 held-out seeds). 512: the paired difference's
            standard error is about 0.010, so a gain of +0.02 shows at 2 SE; ~35 s on 2 cores.
        every: optimizer steps between learning-curve evaluations (0: none).
        curve_episodes: held-out games of each learning-curve evaluation (the first ones).
        temperature: sampling temperature, the policy's own (1.0). Greedy (0) is misleading for a
            small model: the single likeliest token can be a non-word.

    Raises (on construction):
        EvalConfigError: ``episodes`` or ``curve_episodes`` above ``EVAL_SEED_COUNT`` (a larger
            evaluation would play words trained on).
    """

    episodes: int = 512
    every: int = 10
    curve_episodes: int = 64
    temperature: float = 1.0

    def __post_init__(self) -> None:
        for flag, value in (
            ("eval_episodes", self.episodes),
            ("eval_curve_episodes", self.curve_episodes),
        ):
            if value > EVAL_SEED_COUNT:
                raise EvalConfigError(
                    f"{flag}={value}: there are {EVAL_SEED_COUNT} held-out evaluation seeds (their "
                    f"words are kept out of training); set {flag} to {EVAL_SEED_COUNT} or less"
                )


@dataclass
class AdapterSettings:
    """Full weights or a LoRA adapter (``trainer.loop.trained_weights`` is the one object the run
    asks).

    Attributes:
        kind: None: train and publish every weight (the default). ``lora``: train a LoRA adapter
            on the frozen model (PEFT, through TRL's ``peft_config``) and publish only the
            adapter's tensors. From ``ADAPTER``.
        rank: the adapter's rank ``r`` (1..512; the local replica's ``MAX_LORA_RANK`` is this
            rounded up to a rank vLLM builds buffers for, TRL's ``round_lora_rank``).
        alpha: LoRA scaling numerator: the update is ``alpha / rank * B @ A``.
        target_modules: comma-separated module names the adapter wraps (not ``lm_head`` or
            ``embed_tokens``: vLLM serves no LoRA there).
        name: the stable model name rollouts and evaluations request; each replica maps it to
            the newest adapter version it loaded (``{name}-v{N}``).

    Raises (on construction, adapter or not, so a bad flag fails before anything starts):
        AdapterConfigError: ``kind`` is not None or ``lora``; ``rank`` is not 1..512; ``alpha``
            is not positive; ``target_modules`` is empty or names ``lm_head``/``embed_tokens``
            or something that is not a module name; ``name`` is not a plain name or ends like a
            versioned name (``-v3``).
    """

    kind: str | None = None
    rank: int = 8
    alpha: int = 16
    target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    name: str = "policy"

    def modules(self) -> list[str]:
        """``target_modules`` as a list of module names."""
        return [m.strip() for m in self.target_modules.split(",") if m.strip()]

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in ADAPTERS:
            raise AdapterConfigError(
                f"ADAPTER: expected one of {', '.join(ADAPTERS)} (or unset for full weights), "
                f"found {self.kind!r}; set ADAPTER=lora or unset it"
            )
        if not 1 <= self.rank <= 512:  # 512: the largest rank vLLM serves (TRL's VLLM_LORA_RANKS)
            raise AdapterConfigError(
                f"--lora-rank: expected 1..512 (the ranks vLLM can serve), found {self.rank}; "
                "pick a rank in that range (8 or 16 are typical)"
            )
        if self.alpha <= 0:
            raise AdapterConfigError(
                f"--lora-alpha: expected a positive number, found {self.alpha}; "
                "use e.g. twice the rank (16 for rank 8)"
            )
        targets = self.modules()
        bad = [m for m in targets if m in _NOT_LORA_TARGETS or not m.isidentifier()]
        if not targets or bad:
            raise AdapterConfigError(
                "--lora-target-modules: expected comma-separated linear-layer names such as "
                f"q_proj,v_proj (not {' or '.join(_NOT_LORA_TARGETS)}: vLLM serves no LoRA "
                f"there), found {self.target_modules!r}; remove {bad or 'the blanks'}"
            )
        if not _ADAPTER_NAME.fullmatch(self.name) or _VERSIONED.fullmatch(self.name):
            raise AdapterConfigError(
                "--adapter-name: expected 1-64 letters, digits, '.', '_' or '-' (the first a "
                "letter or digit) not ending in -v<N> (replicas serve versions as NAME-v<N>), "
                f"found {self.name!r}; use e.g. 'policy'"
            )


@dataclass
class LocalSettings:
    """What the local run starts on this machine besides the replica and the Wordle server.

    Attributes:
        dashboard: start the Gradio dashboard for the local run (port ``dashboard_port``).
        dashboard_port: its port on 127.0.0.1.
    """

    dashboard: bool = True
    dashboard_port: int = 7861


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
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)
    adapter: AdapterSettings = field(default_factory=AdapterSettings)
    local: LocalSettings = field(default_factory=LocalSettings)

    def __post_init__(self) -> None:
        tiny, full = self.run.model_id() == TINY, self.adapter.kind is None
        if self.grpo.learning_rate is None:
            self.grpo.learning_rate = 2e-4 if tiny else (1e-6 if full else 1e-5)
        if self.grpo.tie_answer_rows is None:
            self.grpo.tie_answer_rows = tiny and full
        self.warm_start = dataclasses.replace(self.warm_start, seed=self.run.seed)  # one seed

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
    "hub_warm_start_games": ("run", "hub_warm_start_games", None),
    "runs_root": ("run", "runs_root", None),
    "cache_dir": ("run", "cache_dir", None),
    "output_dir": ("run", "output_dir", None),
    "seed": ("run", "seed", None),
    "hf_token": ("secrets", "hf_token", "HF_TOKEN"),
    "rollout_api_key": ("secrets", "rollout_api_key", "ROLLOUT_API_KEY"),
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
        )
    },
    "anchor_every": ("publish", "anchor_every", None),
    "keep_anchors": ("publish", "keep_anchors", None),
    "diff_on": ("publish", "diff_on", None),
    "takeover": ("publish", "takeover", None),
    "warm_start_games": ("warm_start", "games", None),
    "warm_start_epochs": ("warm_start", "epochs", None),
    "model_hidden_size": ("warm_start", "hidden_size", None),
    "model_layers": ("warm_start", "layers", None),
    "eval_episodes": ("eval", "episodes", None),
    "eval_every": ("eval", "every", None),
    "eval_curve_episodes": ("eval", "curve_episodes", None),
    "eval_temperature": ("eval", "temperature", None),
    "adapter": ("adapter", "kind", "ADAPTER"),
    "lora_rank": ("adapter", "rank", None),
    "lora_alpha": ("adapter", "alpha", None),
    "lora_target_modules": ("adapter", "target_modules", None),
    "adapter_name": ("adapter", "name", None),
    "dashboard": ("local", "dashboard", None),
    "dashboard_port": ("local", "dashboard_port", None),
}
_SECRETS = ("hf_token", "rollout_api_key")  # from the environment only


def _default(flag: str):
    """The default of flag ``flag`` (its section field's default)."""
    section, name, _ = FLAGS[flag]
    f = {f.name: f for f in dataclasses.fields(typing.get_type_hints(TrainConfig)[section])}[name]
    return f.default


def hub_cpu_defaults(kw: dict, cuda: bool | None = None) -> dict:
    """``kw`` (the flags given) with ``HUB_CPU_DEFAULTS`` for those not given, when the run trains
    a hub model (not ``tiny``) without CUDA (``cuda``: None asks torch); else ``kw``."""
    probe = RunSettings(bucket=kw.get("bucket"), model=kw.get("model"))
    if probe.model_id() == TINY:
        return kw
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return kw if cuda else {**HUB_CPU_DEFAULTS, **kw}


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


def from_args(argv: list[str] | None = None) -> TrainConfig:
    """Build the config from command-line flags (``--max-steps 30``, one per :data:`FLAGS` entry,
    listed by section in ``--help``), falling back to the environment variables the flags name,
    which the Makefile passes: ``BUCKET``, ``MODEL``, ``VLLM_URL``, ``ENV_URL``, ``RUN_ID``,
    ``STEPS`` (max_steps), ``ADAPTER``; then to the fields' defaults. Secrets (``HF_TOKEN``,
    ``ROLLOUT_API_KEY``) come from the environment only. With a bucket and no run id, the run id
    is the bucket's last path part. A hub model trained without CUDA takes ``HUB_CPU_DEFAULTS``
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
        groups[section].add_argument(
            "--" + flag.replace("_", "-"),
            type=_kind(flag),
            default=None,  # not given: the variable, else the field's default
            help=f"default: {f'${var}, else ' if var else ''}{_default(flag)}",
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
    if kw.get("bucket") and "run_id" not in kw:
        kw["run_id"] = kw["bucket"].rstrip("/").split("/")[-1]
    kw = hub_cpu_defaults(kw)
    try:
        return TrainConfig.from_flags(**kw)
    except (AdapterConfigError, EvalConfigError, GRPOConfigError) as e:
        p.error(str(e))
