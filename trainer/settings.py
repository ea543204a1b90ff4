"""The settings of each part of a training run, one typed section a part (``trainer.config``
composes them into ``TrainConfig`` and maps the command line onto them). A part imports its own
section from here and is handed only that.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field

from trainer.task.base import env_headers, space_headers
from trainer.trust import TrustedUrls

log = logging.getLogger("trainer")

DEFAULT_HUB_MODEL = "Qwen/Qwen3-0.6B"
OFF_POLICY_MODES = ("off", "tis", "decoupled")  # ``trainer.loop.off_policy``
TINY = "tiny"
ADAPTERS = ("lora",)  # the adapter kinds a run can train (``AdapterSettings.kind``)
# Modules vLLM cannot serve a LoRA on (TRL's ``validate_lora_for_vllm_sync`` refuses them too).
_NOT_LORA_TARGETS = ("lm_head", "embed_tokens")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # the replica's ADAPTER_NAME rule
_VERSIONED = re.compile(r".*-v[0-9]+")
# Teacher games of the warm start of a hub model that has never been shown a tool
# (``RunSettings.hub_warm_start_games``), whole games (``RunSettings.hub_warm_start_turns`` 6):
# about 10 minutes of SFT for SmolLM2-135M on 2 cores, after which nearly all its calls parse
# (``trainer.task.wordle.hub_warm_start.HubWarmStartConfig``; docs/BENCHMARKS.md section 11).
HUB_WARM_START_GAMES = 128


class EvalConfigError(ValueError):
    """An evaluation setting asks for more games than there are held-out seeds
    (``eval_episodes``, ``eval_curve_episodes``) or for no draw (``eval_draws``); the message
    says the limit and how to fix it."""


class GRPOConfigError(ValueError):
    """A GRPO setting (``scale_rewards``) has a value the run cannot use; the message says the
    accepted values."""


class NetConfigError(ValueError):
    """``NET`` names no link profile; the message lists them."""


class RunConfigError(ValueError):
    """A run setting (``hub_warm_start_games``, ``hub_warm_start_turns``) is out of range; the
    message says the range."""


class AdapterConfigError(ValueError):
    """An adapter setting (``adapter``, ``lora_*``, ``adapter_name``) has a value the run cannot
    use; the message says what was expected, what was found and how to fix it."""


# where ``make spaces`` keeps what it generates (tools/deploy_spaces.py), the run key included
DEPLOY_STATE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "spaces"
)


@dataclass
class RunSettings:
    """The run, its bucket and the model it starts from.

    Attributes:
        bucket: run URI (``user/run`` means ``hf://buckets/user/run``; or hf://, s3://, file://, a
            folder). None: ``runs/<run_id>/bucket`` (the local default).
        run_id: the run's name (bucket manifest, local folders). None: the bucket's last part,
            else ``<task>-local`` (``wordle-local``, ``number-guess-local``), so that another
            task's local run never resumes a Wordle run's bucket.
        model: hub id or local folder; ``tiny`` creates a ~2.7 M-parameter Qwen3 locally. Default:
            ``tiny`` for the local run, ``Qwen/Qwen3-0.6B`` with a bucket.
        task: the environment trained on (``trainer.task.base.load_task``): ``wordle``, or
            ``package.module:NAME`` naming your own ``trainer.task.base.Task``.
        hub_warm_start_games: teacher games a hub model (or model folder) is fine-tuned on before
            GRPO (``trainer.task.wordle.hub_warm_start``; each cut to ``hub_warm_start_turns``
            calls; 0: none). None: ``HUB_WARM_START_GAMES`` when the model's chat template has no
            tools (it has never been shown one: SmolLM2-135M-Instruct wrote 0 parsable calls in 512
            games), else 0 (Qwen3 keeps its own tool calling).
        hub_warm_start_turns: calls kept of each teacher game in that warm start (the game is cut
            after the tool reply of the last one; ``HubWarmStartConfig.turns``, part of its cache
            key). 6 (the default): whole games (~1,000 tokens), which teach the words of every
            call, not only the first (docs/JOURNAL.md, "The trainer's defaults"); 3: the first
            calls, ~780 tokens a game.
        runs_root: folder of local run folders (``<runs_root>/<run_id>``: model, bucket, logs).
        cache_dir: where warm-started models are cached (None: ``<runs_root>/cache``).
        output_dir: TRL's output folder (None: ``<run_dir>/trainer``).
        seed: seed of the model init, the warm start, the data order and the games.
        net: a simulated link between this machine's units and the bucket (``deltasync.link``:
            ``spaces``, ``slow`` or ``<latency ms>:<MB/s>``), for the local stack: the trainer's
            bucket traffic and each local replica's go through it, as on Spaces. None: none.
        run_key: the run's private signing key file (``deltasync.signing``, mode 0600): every
            manifest commit is signed with it and replicas given its ``RUN_PUBLIC_KEY`` serve only
            signed versions. None: a local run makes ``<run_dir>/run_key.pem`` (once); a bucket
            run uses the checkout's ``runs/spaces/run_key.pem`` (what ``make spaces`` wrote) when
            there is one, else publishes unsigned.
    """

    bucket: str | None = None
    run_id: str | None = None
    model: str | None = None
    task: str = "wordle"
    hub_warm_start_games: int | None = None
    hub_warm_start_turns: int = 6
    runs_root: str = "runs"
    cache_dir: str | None = None
    output_dir: str | None = None
    seed: int = 0
    net: str | None = None
    run_key: str | None = None

    def __post_init__(self) -> None:
        from deltasync.link import LinkProfileError, link_for

        if self.run_id is None:
            self.run_id = self._default_run_id()

        try:
            link_for(self.net)
        except LinkProfileError as e:
            raise NetConfigError(str(e)) from None
        if self.hub_warm_start_turns < 1:
            raise RunConfigError(
                f"hub_warm_start_turns: expected a count of calls >= 1, found "
                f"{self.hub_warm_start_turns}; pass --hub-warm-start-turns 3 (the first calls) "
                "or 6 (whole games)"
            )
        if self.hub_warm_start_games is not None and self.hub_warm_start_games < 0:
            raise RunConfigError(
                f"hub_warm_start_games: expected 0 (no warm start) or more games, found "
                f"{self.hub_warm_start_games}"
            )

    def _default_run_id(self) -> str:
        """The bucket's last part, else ``<task name>-local`` (``_`` as ``-``).

        Raises:
            trainer.task.base.TaskError: the task cannot be loaded."""
        if self.bucket:
            return self.bucket.rstrip("/").split("/")[-1]
        from trainer.task.base import load_task

        return load_task(self.task).name.replace("_", "-") + "-local"

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

    def signing_key(self):
        """The run key that signs this run's manifests (``deltasync.signing.RunKey``), or None
        (a bucket run without ``run_key`` and without ``runs/spaces/run_key.pem``: unsigned).
        A local run makes ``<run_dir>/run_key.pem`` (mode 0600) the first time.

        Raises:
            deltasync.errors.KeyFileError: the key file is missing (``run_key`` set), readable
                by group or others (fix: ``chmod 600``) or not a key.
        """
        from deltasync.signing import KEY_FILE_NAME, RunKey, load_or_create

        if self.run_key:
            return RunKey.load(self.run_key)
        if self.local:
            return load_or_create(os.path.join(self.run_dir, KEY_FILE_NAME))[0]
        deployed = os.path.join(DEPLOY_STATE_DIR, KEY_FILE_NAME)
        return RunKey.load(deployed) if os.path.exists(deployed) else None

    @property
    def trains_local_model(self) -> bool:
        """Whether the run trains the local model: ``tiny``, or a folder the local model's
        warm start built (it holds ``warm_start.json``; ``make spaces MODEL=<that folder>`` gives
        it to a rollout Space and prints it in the ``make train`` line)."""
        model = self.model_id()
        return model == TINY or os.path.isfile(os.path.join(model, "warm_start.json"))

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
        env_api_key: the environment server's key (a public Wordle Space's secret, which
            ``make spaces`` keeps under ``runs/spaces/``); from ``WORDLE_API_KEY``. Sent only to
            the environment server (``ENV_URL``), on the training episodes' and the held-out
            games' connections (:meth:`env_headers`).
    """

    hf_token: str | None = field(default=None, repr=False)
    rollout_api_key: str | None = field(default=None, repr=False)
    env_api_key: str | None = field(default=None, repr=False)

    def env_headers(self, url: str, trust: TrustedUrls) -> dict[str, str]:
        """Headers of a connection to the environment server at ``url``
        (:func:`~trainer.task.base.env_headers`: its key where the user gave ``url``, else the HF
        token for a private Space the run trusts, else none)."""
        return env_headers(url, self.env_api_key, self.hf_token, trust)

    def rollout_headers(self, url: str, trust: TrustedUrls) -> dict[str, str]:
        """Headers for requests to the replica at ``url``, only where the run's allowlist
        ``trust`` (``trainer.trust``) lets a credential go: ``Bearer <rollout_api_key>``
        when one is configured and ``url`` is one of the run's replicas, else ``Bearer
        <hf_token>`` over ``https`` to a ``*.hf.space`` host the user gave or ``make spaces``
        deployed for this run (a private Space), else none. Both where both apply (a keyed
        replica on a private Space): the HF token then goes as ``X-HF-Authorization``, the header
        the Hub's Space proxy reads before ``Authorization`` (as gradio_client sends it), and the
        key as ``Authorization`` for the replica's front."""
        if self.rollout_api_key:
            if not trust.may_send_key(url):
                return {}
            headers = {"Authorization": f"Bearer {self.rollout_api_key}"}
            hf = space_headers(url, self.hf_token, trust)
            if hf:
                headers["X-HF-Authorization"] = hf["Authorization"]
            return headers
        return space_headers(url, self.hf_token, trust)

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
            games; docs/BENCHMARKS.md section 6 (the main job)).
        learning_rate: AdamW learning rate. None (resolved by :class:`TrainConfig`): 2e-4 for the
            ~2.7 M-parameter local model (at 1e-5 its bf16 weights barely move: an update smaller
            than half a bf16 ulp is lost in the rounding), 1e-6 for hub models (RL-typical; 6e-5
            for full weights without CUDA: ``trainer.config.HUB_CPU_FULL_LEARNING_RATE``), 1e-5
            for a LoRA adapter on a hub model (an adapter starts at zero).
        num_generations: completions per GRPO group (they all play the same word).
        scale_rewards: how a group's rewards become advantages, as TRL's ``GRPOConfig`` names it:
            ``none`` (the default): ``r - mean`` (``trainer.loop.advantages``); ``group``:
            ``(r - mean) / std`` over the group, what TRL's async worker does (docs/BENCHMARKS.md
            section 6 compares them).
        tie_answer_rows: GRPO changes the local model's answer rows only along their spelling
            (``trainer.task.wordle.spelling_tie``), so what it learns on training words reaches
            held-out words. None (resolved by :class:`TrainConfig`): on for the local model trained
            in full, off otherwise (a hub tokenizer does not hold the answers as single tokens).
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
        bf16: load the weights in bf16 and train with bf16 autocast (GPU); the CPU default
            trains in fp32 and publishes bf16.
        autocast: keep the master weights in fp32 and run the forward and backward under bf16
            autocast, also on a CPU (TRL's ``bf16=True`` with ``use_cpu=True``). The published
            bits stay the bf16 rounding of the fp32 master, so deltas stay exact. Faster only
            where bf16 is native (``deltasync.cpu_dtype``: AVX-512 BF16 or AMX, ~92 -> ~66 s a
            SmolLM2-135M step, docs/BENCHMARKS.md section 11), ~26x slower where it is emulated
            (AVX2 alone): a hub model without CUDA gets it on only where it is native.
        off_policy: how stale samples are weighed (``trainer.loop.off_policy``): ``off`` (TRL's
            objective; the default: the best measured at every lag of the lag x mode table,
            docs/BENCHMARKS.md section 15, and it costs no recomputation), ``tis`` (truncated
            importance weight on the trainer-inference mismatch), ``decoupled`` (PPO's ratio
            against the generating version, rebuilt from the bucket, times that weight).
        tis_cap: the truncation of the mismatch weight (Yao et al. 2025: 2).
        off_policy_stats: with ``off_policy="off"``, still rebuild each sample's generating
            policy and log the ``offpolicy/*`` statistics (drift and mismatch by version lag)
            without changing the loss: the recomputation's cost, for comparing modes.
        turn_credit: weight of each move's own reward in the advantage of that move's tokens
            (``trainer.loop.advantages.TurnCredit``; the task's ``turn_rewards``): a token's
            advantage is its episode's plus ``turn_credit * (move reward - the episode's mean
            move reward)``. 0 (the default): every token of an episode shares its advantage, as in
            GRPO. Turn-level credit assignment after MT-GRPO (Zeng et al. 2025, "Reinforcing
            Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment",
            arXiv:2505.11821), centred within the episode rather than across the group.
        reward: which of the task's episode rewards GRPO trains on (``Task.rewards``; Wordle:
            ``best``, the best row's credit with a stop penalty, or ``game``, what the game pays:
            the last row's credit, so stopping on a good row keeps it; both less 0.1 an invalid
            move, ``trainer.task.wordle.game_env.episode_reward``). None (resolved by
            :class:`~trainer.config.TrainConfig`): the task's first.
        max_dropped_fraction: a step whose dropped episodes (the environment failed them: no
            reward, ``trainer.loop.rollout_tagging``) are more than this share of its episodes
            counts as failing; 1: never.
        max_dropped_steps: the run stops (``DroppedEpisodesError``) after this many failing
            steps in a row.
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
    autocast: bool = False
    off_policy: str = "off"
    tis_cap: float = 2.0
    off_policy_stats: bool = False
    turn_credit: float = 0.0
    reward: str | None = None
    max_dropped_fraction: float = 0.5
    max_dropped_steps: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.max_dropped_fraction <= 1 or self.max_dropped_steps < 1:
            raise GRPOConfigError(
                f"max_dropped_fraction={self.max_dropped_fraction}, max_dropped_steps="
                f"{self.max_dropped_steps}: expected a share in [0, 1] and a count >= 1; set "
                "--max-dropped-fraction / --max-dropped-steps"
            )
        if not self.turn_credit >= 0:
            raise GRPOConfigError(
                f"turn_credit={self.turn_credit}: expected a weight of 0 (off) or more; set "
                "--turn-credit to e.g. 1"
            )
        if self.off_policy not in OFF_POLICY_MODES or not self.tis_cap > 1:
            raise GRPOConfigError(
                f"off_policy={self.off_policy!r}, tis_cap={self.tis_cap}: expected one of "
                f"{', '.join(OFF_POLICY_MODES)} and a cap above 1; set --off-policy / --tis-cap"
            )
        if self.scale_rewards not in ("group", "none"):
            raise GRPOConfigError(
                f"scale_rewards={self.scale_rewards!r}: expected 'group' (TRL's (r - mean) / std) "
                "or 'none' (r - mean); set --scale-rewards to one of them"
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
        draws: how many times the before and after evaluations play each of their games, each
            draw with its own sampling seeds (``EvalRequest.draw``; a curve point plays one, paired
            with the pooled before). A game's reward is then its mean over the draws, and the
            paired standard error is taken over the games, so it falls with the sampling noise
            while the held-out words stay the same (``learning_curve.pool_draws``). Each draw
            costs one more evaluation's time.
        per_replica: games played at once per serving replica (each game holds one request
            in flight): an evaluation plays ``min(games, serving replicas * per_replica)`` at
            once, so a one-replica CPU fleet is not sent more games than it serves at once (64 at
            once kept a 2-core replica's health waiting past its timeout, BENCHMARKS §17). Raise it
            for GPU replicas (vLLM batches up to its ``max_num_seqs``).

    Raises:
        EvalConfigError: ``draws`` or ``per_replica`` below 1 (``__post_init__``). ``episodes``
            and ``curve_episodes`` above the task's held-out seeds are clamped to them
            (``check_seeds``, once the task is known).
    """

    episodes: int = 512
    every: int = 10
    curve_episodes: int = 64
    temperature: float = 1.0
    draws: int = 1
    per_replica: int = 16

    def __post_init__(self) -> None:
        if self.per_replica < 1:
            raise EvalConfigError(
                f"eval_per_replica={self.per_replica}: expected 1 or more games at once per "
                "replica; set --eval-per-replica to e.g. 16"
            )
        if self.draws < 1:
            raise EvalConfigError(
                f"eval_draws={self.draws}: expected 1 (each game played once) or more; set "
                "--eval-draws to e.g. 2"
            )

    def check_seeds(self, seed_count: int) -> None:
        """Clamp ``episodes`` and ``curve_episodes`` to the task's ``seed_count`` held-out seeds
        (a larger evaluation would play episodes trained on), saying so in the log once each."""
        for flag, name in (
            ("eval_episodes", "episodes"),
            ("eval_curve_episodes", "curve_episodes"),
        ):
            value = getattr(self, name)
            if value > seed_count:
                setattr(self, name, seed_count)
                log.warning(
                    "%s=%d: the task holds %d held-out evaluation seeds (kept out of training); "
                    "playing %d (set --%s to choose fewer)",
                    flag,
                    value,
                    seed_count,
                    seed_count,
                    flag.replace("_", "-"),
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


@dataclass(frozen=True)
class LocalModelSettings:
    """The run's settings of the task's own small model (``--model tiny``, the local default).
    Each task's ``Task.local_model`` reads the fields that apply to it; None keeps the task's
    default. All of them are part of the task's cache key.

    Attributes:
        games: teacher games of its warm start (None: the task's; Wordle's 3000).
        epochs: passes over them (None: the task's; Wordle's 3).
        hidden_size: the model's hidden size (None: the task's; Wordle's 192).
        layers: its decoder layers (None: the task's; Wordle's 2).
        seed: games, initial weights and data order (the run's ``--seed``).
    """

    games: int | None = None
    epochs: int | None = None
    hidden_size: int | None = None
    layers: int | None = None
    seed: int = 0

    def given(self) -> dict:
        """The fields set, by name (None ones left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class LocalSettings:
    """What the local run starts on this machine besides the replica and the Wordle server.

    Attributes:
        dashboard: start the Gradio dashboard for the local run (port ``dashboard_port``).
        dashboard_port: its port on 127.0.0.1.
        replica_sync_every: a forced lag for the local replicas (their ``SYNC_EVERY``): each pulls
            only once the newest version is this many past the one it serves
            (``deltasync.follow.Follower``); 1: every version. Above ``max_staleness`` the fleet
            drains them.
    """

    dashboard: bool = True
    dashboard_port: int = 7861
    replica_sync_every: int = 1

    def __post_init__(self) -> None:
        if self.replica_sync_every < 1:
            raise ValueError(
                f"replica_sync_every={self.replica_sync_every}: expected 1 or more versions"
            )
