"""The trainer's one typed configuration. Environment variables are read here and nowhere else.

With no bucket and no URLs (``make train``), everything runs on this machine: a tiny model
created locally, a bucket folder under ``runs/<run_id>/bucket``, and a Wordle server and a vLLM
replica started as child processes on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from urllib.parse import urlparse

DEFAULT_HUB_MODEL = "Qwen/Qwen3-0.6B"
TINY = "tiny"
ADAPTERS = ("lora",)  # the adapter kinds a run can train (``adapter``)
# Modules vLLM cannot serve a LoRA on (TRL's ``validate_lora_for_vllm_sync`` refuses them too).
_NOT_LORA_TARGETS = ("lm_head", "embed_tokens")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # the replica's ADAPTER_NAME rule
_VERSIONED = re.compile(r".*-v[0-9]+")
# Held-out evaluation seeds (``trainer.task.wordle_task.eval_seeds``): their targets are kept out of
# the warm start and of GRPO's data. An evaluation plays the first ``eval_episodes`` of them, at
# most EVAL_SEED_COUNT: 512 seeds hold out 484 of the 3,568 answers.
EVAL_SEED_FIRST = 900_000
EVAL_SEED_COUNT = 512
# Teacher games of the warm start of a hub model that has never been shown a tool
# (``TrainConfig.hub_warm_start_games``): about 6 minutes of SFT for SmolLM2-135M on 2 cores,
# after which 32 of 32 sampled first calls parsed and 27 were valid words
# (``trainer.task.hub_warm_start.HubWarmStartConfig``).
HUB_WARM_START_GAMES = 96
# A hub model (or model folder) trained without CUDA: settings that fit a 2-core machine, used for
# every one of these not given on the command line or in the environment (``from_args``). A
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
class TrainConfig:
    """Settings of one training run (units in the names or comments).

    Attributes:
        bucket: run URI (``user/run`` means ``hf://buckets/user/run``; or hf://, s3://, file://, a
            folder). None: ``runs/<run_id>/bucket`` (the local default).
        run_id: the run's name (bucket manifest, local folders).
        model: hub id or local folder; ``tiny`` creates a ~0.5 M-parameter Qwen3 locally. Default:
            ``tiny`` for the local run, ``Qwen/Qwen3-0.6B`` with a bucket.
        vllm_url: the rollout fleet: comma-separated replica base URLs (their ``/v1`` OpenAI API),
            and/or ``auto`` (every replica that announces its URL in a fresh bucket heartbeat
            joins; see ``trainer.fleet``). None: ``auto`` with a bucket; for the local default, one
            replica started here (and others that follow the local bucket join).
        fleet_wait_s: how long rollouts wait while no replica serves before they fail, seconds.
        fleet_health_interval_s: seconds between the fleet's health checks of each replica
            (HTTP ``/health``; no Hub call).
        fleet_discover_interval_s: seconds between reads of the replicas' heartbeats in a remote
            bucket (one listing, an API call, and one read per replica each time; replicas write
            theirs 60 s apart there). On a local bucket: every health check.
        env_url: the Wordle environment server's URL. None: start one locally.
        max_steps: optimizer steps (55 for the local default: with the warm start, the whole
            run fits 15 minutes on 2 cores at 6-8 s a step and gains about +0.02 on held-out
            games; 100 steps gained +0.030 in one run, about 17 minutes; docs/BENCHMARKS.md
            section 6).
        learning_rate: AdamW learning rate. None: 2e-4 for the ~2.7 M-parameter local model (at
            1e-5 its bf16 weights, which the replica serves, barely move: an update smaller than
            half a bf16 ulp of a weight is lost in the rounding; the handout experiment's policy
            gradient used 3e-4), 1e-6 for hub models (RL-typical), 1e-5 for a LoRA adapter on a
            hub model (an adapter starts at zero and needs larger steps than full weights).
        num_generations: completions per GRPO group (they all play the same word).
        scale_rewards: how a group's rewards become advantages, as TRL's ``GRPOConfig`` names it:
            ``none`` (the default): ``r - mean`` (``trainer.loop.advantages``); ``group``:
            ``(r - mean) / std`` over the group, what TRL's async worker does. Centred, a group
            whose games differ by a yellow letter weighs far less than one where a game won
            (local run, 512 held-out games, one run each: paired gain +0.004 +- 0.009 with
            ``group``, +0.011 +- 0.010 with ``none``; runs vary by more than that SE: docs/
            BENCHMARKS.md section 6).
        tie_answer_rows: GRPO changes the local model's answer rows only along their spelling
            (``trainer.loop.spelling_tie``), so what it learns on training words reaches held-out
            words (with ``none``, one run each: +0.011 -> +0.021 +- 0.010; five runs with it
            average about +0.02). None: on for the local model
            (``tiny``) when it trains full weights, off otherwise (a hub tokenizer does not hold
            the answers as single tokens).
        per_device_train_batch_size: episodes generated concurrently and queued for the trainer
            (TRL's ``samples_per_step``). How many a step trains on is set by ``token_budget``.
        max_completion_length: tokens per assistant turn (TRL applies it to each turn): a
            ``guess`` call is 10 tokens with the local tokenizer and about 25 with Qwen3's.
        max_tool_calling_iterations: tool calls per game, at most (6 guesses + 1 invalid move).
        max_staleness: drop rollouts generated by a policy more than this many versions behind
            (versions as really served by the replica, see ``rollout_tagging``). 4, TRL's default:
            an episode of 7 turns takes about one step to generate, waits up to one step in the
            queue, and the replica serves the newest version about a second after it is published,
            so consumed samples are typically 1-2 versions old (the local default: 0 dropped of
            3,784). The same bound drains a replica from the fleet while it is more than this many
            versions behind the newest publish (``trainer.fleet``), so that it is not sent rollouts
            whose samples would be dropped.
        max_inflight_tasks: episodes generated concurrently. None: one step's worth
            (``per_device_train_batch_size``), which with ``queue_maxsize`` bounds how far
            generation runs ahead of training and so the share of samples discarded as stale.
        queue_maxsize: scored samples buffered for the trainer. None: one step's worth
            (``per_device_train_batch_size``), so the next step's games are generated while the
            trainer runs this one (with one group, generation stopped during every step and the
            trainer then waited for it: 5 s of every 8 s step, 18 games per step).
        warm_start_games: solver games in the local model's warm start (``trainer.task.warm_start``).
            The distinct games, more than the epochs, set what the warm start reaches: 4,500
            games (+100 s) took held-out wins 0.32 -> 0.48 through the replica, and with
            ``--max-steps 38`` the run still fits 15 minutes and ends at 0.51, but GRPO then
            gained nothing measurable on top (+0.005 +- 0.010; consistent share down 0.03); on a
            GPU 12,000 games reach 0.81 (docs/BENCHMARKS.md section 6). The default keeps 3,000.
        model_hidden_size: hidden size of the local model (``tiny``; Qwen3, head_dim 64).
        model_layers: decoder layers of the local model.
        warm_start_epochs: passes over them.
        cache_dir: where warm-started models are cached (None: ``<runs_root>/cache``).
        eval_episodes: held-out games played through the replica before the first GRPO step and
            after the last, compared game by game (0: no evaluation; at most the 512 held-out
            seeds). 512: the paired difference's standard error is about 0.010 (0.015 at 256,
            0.017-0.025 at 128, measured), so a gain of +0.02 shows at 2 SE; 512 games take
            about 35 s on 2 cores.
        eval_every: optimizer steps between learning-curve evaluations (0: none).
        eval_curve_episodes: held-out games of each learning-curve evaluation (the first ones of
            the ``eval_episodes`` seeds).
        eval_temperature: sampling temperature of the evaluation, the policy's own (1.0). Greedy
            (0) is misleading for a small model: where ~3,000 words share the mass, the single
            likeliest token can be a non-word (measured: ``"word": ""`` calls at turn 3).
        token_budget: tokens per training row (TRL's token-budget batching), which sets the games
            per optimizer step: a local-model episode forwards about 330 tokens once its group
            shares the prompt, so 24,576 holds about 70 (8 or 9 GRPO groups of 8; at 8,192 a step
            trained on 18). Set explicitly so TRL does not query the replica's ``/v1/models``
            before the replica has its first version.
        weight_sync_steps: optimizer steps between publishes.
        anchor_every: versions between full anchors in the bucket. None: the publisher's own
            default (``deltasync.publisher.PublisherConfig``), so the value lives in one place.
        keep_anchors: retention: anchors (and the deltas after them) kept in the bucket. None:
            the publisher's default.
        diff_on: where the publisher diffs (``deltasync.publisher.PublisherConfig.diff_on``):
            ``auto`` on the device that holds the weights (a GPU keeps one bf16 copy of the model
            for it), ``host`` (no GPU memory; under FSDP2, rank 0 is handed whole tensors, so a
            large model may not fit a second copy on its GPU), ``device``.
        bf16: train with bf16 autocast (GPU); the CPU default trains in fp32 and publishes bf16.
        output_dir: TRL's output folder.
        dashboard: start the Gradio dashboard for the local run (port ``dashboard_port``).
        takeover: take over the bucket run even if another trainer's lease looks fresh.
        seed: seed of the model init, the data order and the games.
        runs_root: folder of local run folders (``<runs_root>/<run_id>``: model, bucket, logs).
        hf_token: for hf:// buckets and private Spaces; from ``HF_TOKEN``, never logged.
        rollout_api_key: the replica's ``ROLLOUT_API_KEY`` (replicas outside Spaces); from
            ``ROLLOUT_API_KEY``, never logged.
        adapter: None: train and publish every weight (the default). ``lora``: train a LoRA
            adapter on the frozen model (PEFT, through TRL's ``peft_config``) and publish only the
            adapter's tensors, each version a PEFT adapter the replicas load under a versioned
            name (``trainer.loop.adapter``). From ``ADAPTER``.
        lora_rank: the adapter's rank ``r`` (1..512; the local replica's ``MAX_LORA_RANK`` is
            this rounded up to a rank vLLM builds buffers for, TRL's ``round_lora_rank``).
        lora_alpha: LoRA scaling numerator: the update is ``lora_alpha / lora_rank * B @ A``.
        lora_target_modules: comma-separated module names the adapter wraps (not ``lm_head`` or
            ``embed_tokens``: vLLM serves no LoRA there).
        adapter_name: the stable model name rollouts and evaluations request; each replica maps
            it to the newest adapter version it loaded (``{adapter_name}-v{N}``).
        hub_warm_start_games: teacher games a hub model (or model folder) is fine-tuned on before
            GRPO (``trainer.task.hub_warm_start``; cut to their first 3 calls; 0: none). None:
            ``HUB_WARM_START_GAMES`` when the model's chat template has no tools (it has never
            been shown one: SmolLM2-135M-Instruct wrote 0 parsable calls in 512 games), else 0
            (Qwen3 keeps its own tool calling).
    """

    bucket: str | None = field(default=None, metadata={"env": "BUCKET"})
    run_id: str = field(default="wordle-local", metadata={"env": "RUN_ID"})
    model: str | None = field(default=None, metadata={"env": "MODEL"})
    vllm_url: str | None = field(default=None, metadata={"env": "VLLM_URL"})
    fleet_wait_s: float = 900.0
    fleet_health_interval_s: float = 5.0
    fleet_discover_interval_s: float = 60.0
    env_url: str | None = field(default=None, metadata={"env": "ENV_URL"})
    max_steps: int = field(default=55, metadata={"env": "STEPS"})
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
    warm_start_games: int = 3000
    model_hidden_size: int = 192
    model_layers: int = 2
    warm_start_epochs: int = 3
    cache_dir: str | None = None
    eval_episodes: int = 512
    eval_every: int = 10
    eval_curve_episodes: int = 64
    eval_temperature: float = 1.0
    token_budget: int = 24576
    weight_sync_steps: int = 1
    anchor_every: int | None = None
    keep_anchors: int | None = None
    diff_on: str = "auto"
    bf16: bool = False
    output_dir: str | None = None
    dashboard: bool = True
    dashboard_port: int = 7861
    takeover: bool = False
    seed: int = 0
    runs_root: str = "runs"
    hf_token: str | None = field(default=None, repr=False, metadata={"env": "HF_TOKEN"})
    rollout_api_key: str | None = field(
        default=None, repr=False, metadata={"env": "ROLLOUT_API_KEY"}
    )
    adapter: str | None = field(default=None, metadata={"env": "ADAPTER"})
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    adapter_name: str = "policy"
    hub_warm_start_games: int | None = None

    def __post_init__(self) -> None:
        check_adapter_settings(self)
        check_eval_settings(self)
        if self.scale_rewards not in ("group", "none"):
            raise GRPOConfigError(
                f"scale_rewards={self.scale_rewards!r}: expected 'group' (TRL's (r - mean) / std) or "
                "'none' (r - mean); set --scale-rewards to one of them"
            )

    @property
    def local(self) -> bool:
        """Whether this is the embedded default (nothing remote)."""
        return self.bucket is None

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_root, self.run_id)

    def bucket_uri(self) -> str:
        """The bucket URI (``user/run`` shorthand expanded by ``deltasync.store.resolve_uri``)."""
        from deltasync.store import resolve_uri

        if self.bucket is None:
            return os.path.abspath(os.path.join(self.run_dir, "bucket"))
        return resolve_uri(self.bucket)

    def model_id(self) -> str:
        return self.model or (TINY if self.local else DEFAULT_HUB_MODEL)

    def rollout_headers(self, url: str) -> dict[str, str]:
        """Headers for requests to the replica at ``url``: ``Bearer <rollout_api_key>`` when one
        is configured, else ``Bearer <hf_token>`` for a ``*.hf.space`` URL (a private Space),
        else none. The HF token is never sent to other hosts."""
        if self.rollout_api_key:
            return {"Authorization": f"Bearer {self.rollout_api_key}"}
        return space_headers(url, self.hf_token)

    def tied_answer_rows(self) -> bool:
        """Whether GRPO ties the answer rows to spelling (see ``tie_answer_rows``)."""
        if self.tie_answer_rows is not None:
            return self.tie_answer_rows
        return self.model_id() == TINY and not self.adapter

    def lr(self) -> float:
        """The learning rate (see ``learning_rate``)."""
        if self.learning_rate is not None:
            return self.learning_rate
        if self.model_id() == TINY:
            return 2e-4
        return 1e-5 if self.adapter else 1e-6

    def hub_warm_start_game_count(self, template_swapped: bool) -> int:
        """Teacher games of a hub model's warm start (see ``hub_warm_start_games``);
        ``template_swapped``: the model's own template had no tools."""
        if self.hub_warm_start_games is not None:
            return self.hub_warm_start_games
        return HUB_WARM_START_GAMES if template_swapped else 0

    def target_modules(self) -> list[str]:
        """``lora_target_modules`` as a list of module names."""
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]


def check_eval_settings(cfg: TrainConfig) -> None:
    """Refuse evaluations larger than the held-out seed set (their targets are the words kept out
    of the warm start and of GRPO's data: a larger evaluation would play trained-on words).

    Raises:
        EvalConfigError: ``eval_episodes`` or ``eval_curve_episodes`` is above
            ``EVAL_SEED_COUNT``.
    """
    for name in ("eval_episodes", "eval_curve_episodes"):
        value = getattr(cfg, name)
        if value > EVAL_SEED_COUNT:
            raise EvalConfigError(
                f"{name}={value}: there are {EVAL_SEED_COUNT} held-out evaluation seeds (their "
                f"words are kept out of training); set {name} to {EVAL_SEED_COUNT} or less"
            )


def check_adapter_settings(cfg: TrainConfig) -> None:
    """Refuse adapter settings the run cannot use (checked for every config, adapter or not, so
    a bad flag fails before anything starts).

    Raises:
        AdapterConfigError: ``adapter`` is not None or ``lora``; ``lora_rank`` is not 1..512;
            ``lora_alpha`` is not positive; ``lora_target_modules`` is empty or names
            ``lm_head``/``embed_tokens`` or something that is not a module name;
            ``adapter_name`` is not a plain name or ends like a versioned name (``-v3``).
    """
    if cfg.adapter is not None and cfg.adapter not in ADAPTERS:
        raise AdapterConfigError(
            f"ADAPTER: expected one of {', '.join(ADAPTERS)} (or unset for full weights), "
            f"found {cfg.adapter!r}; set ADAPTER=lora or unset it"
        )
    if not 1 <= cfg.lora_rank <= 512:  # 512: the largest rank vLLM serves (TRL's VLLM_LORA_RANKS)
        raise AdapterConfigError(
            f"--lora-rank: expected 1..512 (the ranks vLLM can serve), found {cfg.lora_rank}; "
            "pick a rank in that range (8 or 16 are typical)"
        )
    if cfg.lora_alpha <= 0:
        raise AdapterConfigError(
            f"--lora-alpha: expected a positive number, found {cfg.lora_alpha}; "
            "use e.g. twice the rank (16 for rank 8)"
        )
    targets = cfg.target_modules()
    bad = [m for m in targets if m in _NOT_LORA_TARGETS or not m.isidentifier()]
    if not targets or bad:
        raise AdapterConfigError(
            "--lora-target-modules: expected comma-separated linear-layer names such as "
            f"q_proj,v_proj (not {' or '.join(_NOT_LORA_TARGETS)}: vLLM serves no LoRA there), "
            f"found {cfg.lora_target_modules!r}; remove {bad or 'the blanks'}"
        )
    if not _ADAPTER_NAME.fullmatch(cfg.adapter_name) or _VERSIONED.fullmatch(cfg.adapter_name):
        raise AdapterConfigError(
            "--adapter-name: expected 1-64 letters, digits, '.', '_' or '-' (the first a letter "
            "or digit) not ending in -v<N> (replicas serve versions as NAME-v<N>), found "
            f"{cfg.adapter_name!r}; use e.g. 'policy'"
        )


def space_headers(url: str, hf_token: str | None) -> dict[str, str]:
    """``Authorization: Bearer <hf_token>`` for a ``*.hf.space`` URL (a private Space), else no
    header: the HF token is never sent to other hosts."""
    host = urlparse(url).hostname or ""
    if hf_token and host.endswith(".hf.space"):
        return {"Authorization": f"Bearer {hf_token}"}
    return {}


def hub_cpu_defaults(kw: dict, cuda: bool | None = None) -> dict:
    """``kw`` (the settings given) with ``HUB_CPU_DEFAULTS`` for those not given, when the run
    trains a hub model (not ``tiny``) without CUDA (``cuda``: None asks torch); else ``kw``."""
    probe = TrainConfig(**{k: v for k, v in kw.items() if k in ("bucket", "model")})
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


def _kind(hint) -> Callable[[str], object]:
    """The parser of a flag or variable for a field of type ``hint`` (``X | None``: ``X``'s)."""
    optional = typing.get_args(hint)  # (X, NoneType) for ``X | None``
    hint = optional[0] if optional else hint
    return _parse_bool if hint is bool else hint


def from_args(argv: list[str] | None = None) -> TrainConfig:
    """Build the config from command-line flags (``--max-steps 30``, one per field), falling back
    to the environment variables the fields declare (``metadata={"env": ...}``), which the
    Makefile passes: ``BUCKET`` (bucket), ``MODEL`` (model), ``VLLM_URL`` (vllm_url), ``ENV_URL``
    (env_url), ``RUN_ID`` (run_id), ``STEPS`` (max_steps), ``ADAPTER`` (adapter); then to the
    fields' defaults. Secrets (``repr=False``: ``HF_TOKEN`` -> hf_token, ``ROLLOUT_API_KEY`` ->
    rollout_api_key) come from the environment only. With a bucket and no run id, the run id is
    the bucket's last path part. A hub model trained without CUDA takes ``HUB_CPU_DEFAULTS`` for
    the settings not given (:func:`hub_cpu_defaults`).

    Raises:
        SystemExit: (code 2, from argparse) a flag or a variable whose value does not parse, or
            adapter settings :func:`check_adapter_settings` refuses (its message is printed).
    """
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    kinds = {name: _kind(hint) for name, hint in typing.get_type_hints(TrainConfig).items()}
    for f in fields(TrainConfig):
        if f.repr:  # a secret has no flag: command lines are visible to every local user
            var = f"${f.metadata['env']}, else " if "env" in f.metadata else ""
            p.add_argument(
                "--" + f.name.replace("_", "-"),
                type=kinds[f.name],
                default=None,  # not given: the variable, else the field's default
                help=f"default: {var}{f.default}",
            )
    ns = p.parse_args(argv)
    kw = {}
    for f in fields(TrainConfig):
        var = f.metadata.get("env")
        raw = os.environ.get(var, "") if var else ""
        if raw.strip():
            try:
                kw[f.name] = kinds[f.name](raw)
            except (ValueError, argparse.ArgumentTypeError):
                what = {int: "an integer", float: "a number", _parse_bool: "true/false"}
                p.error(
                    f"{var}: expected {what.get(kinds[f.name], 'a string')}, found {raw!r}; "
                    f"fix it, or unset it for the default ({f.default!r})"
                )
    kw.update({k: v for k, v in vars(ns).items() if v is not None})
    if kw.get("bucket") and "run_id" not in kw:
        kw["run_id"] = kw["bucket"].rstrip("/").split("/")[-1]
    kw = hub_cpu_defaults(kw)
    try:
        return TrainConfig(**kw)
    except AdapterConfigError as e:
        p.error(str(e))
