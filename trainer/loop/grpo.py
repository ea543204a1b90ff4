"""Building TRL's AsyncGRPOTrainer for the run: the task's environment (or reward functions) as the
reward, the bucket weight transfer, the bounded rollout queue and the per-sample version stamps."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from trainer.loop import ranks, trl_compat
from trainer.loop.advantages import CentredAdvantages, TurnCredit
from trainer.loop.bucket_transfer import BucketWeightTransfer
from trainer.loop.rollout_tagging import ReplicaVersionTagger
from trainer.loop.rollouts import Rollouts, wait_for_version
from trainer.loop.trained_weights import FullWeights
from trainer.settings import GRPOSettings, RunSettings
from trainer.task.base import Task


class GRPOParts(NamedTuple):
    """What :func:`build_trainer` built: TRL's trainer, the bucket weight transfer it publishes
    through, and the rollout worker's version tagger (staleness, training games)."""

    trainer: Any
    transfer: BucketWeightTransfer
    tagger: ReplicaVersionTagger | None


@dataclass(frozen=True)
class Serving:
    """What rank 0 builds its trainer against (the other ranks have neither): the run's rollout
    side, and what runs once the replicas serve the first published version.

    Attributes:
        rollouts: the run's :class:`Rollouts` (``trainer.stack.RunStack.start``).
        on_first_apply: ``f(version)``, run once the replicas serve the first published version
            and before TRL's rollout worker starts (the evaluation "before").
    """

    rollouts: Rollouts
    on_first_apply: Callable[[int], None] | None = None


def build_trainer(
    grpo: GRPOSettings,
    run: RunSettings,
    weights: FullWeights,
    model_path: str,
    task: Task,
    serving: Serving | None = None,
) -> GRPOParts:
    """TRL's AsyncGRPOTrainer for the run, then what the run attaches to it, each a named step:
    the bucket weight transfer, the version tags on every sample, the task's own steps
    (``task.attach``: e.g. the local Wordle model's answer rows tied to their spelling), centred
    advantages, and the off-policy correction. Ranks other than 0 pass no ``serving``.

    Args:
        grpo: the update's settings; run: the output folder and the seed.
        weights: what the run trains (``trainer.loop.trained_weights``).
        model_path: the model folder TRL loads.
        task: the environment (``trainer.task.base.Task``): its rows, its tool environment or
            reward functions, its own attach step.
        serving: the run's rollouts and its first-version hook (:class:`Serving`; None on ranks
            other than 0).

    Adapter runs: TRL wraps the model with the run's LoRA config (``weights.peft_config()``); the
    transfer publishes the adapter's tensors only, the model stays unmerged, and rollouts request
    ``weights.served_name`` (``weights.prepare_trainer``).

    Raises:
        trainer.config.AdapterConfigError: an adapter run with several processes, or an adapter
            TRL refuses for vLLM.
        deltasync.errors.AdapterMismatchError, deltasync.errors.WrongBaseModelError: the
            trainer's PEFT model is not the adapter the publisher records.
    """
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    weights.check_processes(ranks.world())
    serving = serving or Serving(Rollouts(url=None))
    rollouts, on_first_apply = serving.rollouts, serving.on_first_apply
    transfer = BucketWeightTransfer(
        rollouts.publisher,
        first_apply_fn=lambda v: (
            wait_for_version(rollouts.served_version, v),
            on_first_apply(v) if on_first_apply else None,
        ),
    )
    n_rows = max(64, grpo.max_steps * grpo.per_device_train_batch_size)
    trainer = AsyncGRPOTrainer(
        model=model_path,
        # a tool environment's get_reward is the reward; a single-turn task has reward functions
        reward_funcs=list(task.reward_funcs),
        args=_grpo_config(grpo, run, rollouts.url),
        train_dataset=task.dataset(n_rows, run.seed),
        environment_factory=task.environment_factory,
        weight_transfer=transfer,
        peft_config=weights.peft_config(),
    )
    transfer.step_fn = lambda: trainer.state.global_step  # recorded in each manifest entry
    weights.prepare_trainer(trainer, transfer, rollouts.publisher)
    trl_compat.bound_score_queue(trainer, groups=1)
    trl_compat.send_request_headers(trainer, rollouts.headers)  # the router's run key
    tagger = _attach_version_tags(trainer, grpo, transfer, rollouts, task)
    if task.attach is not None:
        task.attach(trainer, run, grpo)
    if grpo.scale_rewards == "none" and trainer.rollout_queue is not None:
        trainer.rollout_queue = CentredAdvantages(trainer.rollout_queue)
    if grpo.off_policy != "off" or grpo.off_policy_stats:
        _attach_correction(trainer, grpo, model_path, rollouts)  # after centring: it scales them
    if grpo.turn_credit and trainer.rollout_queue is not None:  # last: the others take floats
        trl_compat.per_token_advantages()
        trainer.rollout_queue = TurnCredit(
            trainer.rollout_queue, task.turn_rewards, grpo.turn_credit, trainer._metrics["train"]
        )
    return GRPOParts(trainer, transfer, tagger)


def _grpo_config(grpo: GRPOSettings, run: RunSettings, rollout_url: str | None):
    """TRL's ``AsyncGRPOConfig`` from the run's settings."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    step_samples = grpo.per_device_train_batch_size
    return AsyncGRPOConfig(
        output_dir=run.output_dir or os.path.join(run.run_dir, "trainer"),
        max_steps=grpo.max_steps,
        learning_rate=grpo.learning_rate,
        num_generations=grpo.num_generations,
        per_device_train_batch_size=grpo.per_device_train_batch_size,
        max_completion_length=grpo.max_completion_length,
        max_tool_calling_iterations=grpo.max_tool_calling_iterations,
        max_staleness=grpo.max_staleness,
        # Bounded generation: at most one step's worth of episodes in flight and one step's worth
        # of scored samples queued: the next step is generated while this one trains, and little
        # is generated that will be discarded as stale.
        max_inflight_tasks=grpo.max_inflight_tasks or step_samples,
        queue_maxsize=grpo.queue_maxsize or step_samples,
        chat_template_kwargs={"enable_thinking": False},
        # the local model: recomputation costs more than it saves; a hub model (SmolLM2-135M, 30
        # layers) kept ~9 GB of activations for a 6,144-token row and a LoRA run was killed for
        # memory on the 24 GiB machine: recomputed there
        gradient_checkpointing=not run.trains_local_model,
        token_budget=grpo.token_budget,
        weight_sync_steps=grpo.weight_sync_steps,
        vllm_server_base_url=rollout_url,
        dtype="bfloat16" if grpo.bf16 else "float32",
        bf16=grpo.bf16 or grpo.autocast,  # fp32 master weights unless grpo.bf16
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=run.seed,
        log_completions=False,
        # several CPU processes: accelerate's MULTI_CPU (DDP over gloo) needs use_cpu, and so does
        # bf16 autocast on a CPU
        use_cpu=(ranks.world() > 1 or grpo.autocast) and not ranks.has_cuda(),
        ddp_find_unused_parameters=False,  # every parameter takes part in the forward
    )


def _attach_version_tags(trainer, grpo: GRPOSettings, transfer, rollouts: Rollouts, task: Task):
    """Wrap TRL's rollout worker so that each sample carries the oldest version that generated
    it (staleness, the training games); returns the tagger (None where there is no worker)."""
    return trl_compat.wrap_rollout_worker(
        trainer,
        lambda inner: ReplicaVersionTagger(
            inner,
            lambda: transfer.last_version,
            rollouts.served_version,
            max_staleness=grpo.max_staleness,
            sample_versions_fn=rollouts.sample_versions,
            episode_counts=task.episode_counts,
        ),
    )


def _attach_correction(trainer, grpo: GRPOSettings, model_path: str, rollouts: Rollouts) -> None:
    """Score stale samples under their generating versions (``trainer.loop.generating_policy``)
    and log the correction's statistics; only where the queue and a publisher exist."""
    if trainer.rollout_queue is None or rollouts.publisher is None:
        return
    from trainer.loop.generating_policy import CorrectionStats, correction_for

    correction = correction_for(
        trainer, grpo, model_path, rollouts.publisher, rollouts.turn_versions
    )
    trainer.rollout_queue = correction
    trainer.add_callback(CorrectionStats(correction))
