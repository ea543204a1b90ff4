"""The training job: TRL's AsyncGRPOTrainer on the run's task (Wordle by default), publishing every
update to the bucket.

``python -m trainer`` (or ``make train``). The local default creates the task's local model
(``--model tiny``), starts the task's environment server and a vLLM replica as children, trains
for ``max_steps`` steps, and prints a summary.
Restart: a run whose bucket already holds versions resumes from the newest one (the model weights
are rebuilt from the bucket's newest anchor and deltas; the optimizer state starts fresh) and
continues the version sequence with an anchor.
"""

from __future__ import annotations

import json
import os
import time

from trainer.config import TrainConfig
from trainer.loop import ranks, trl_compat
from trainer.loop.grpo import Serving, build_trainer
from trainer.loop.learning_curve import EvalEvery, HeldOutEvals
from trainer.loop.metrics import BucketMetricsCallback, quiet_progress
from trainer.loop.trained_weights import trained_weights
from trainer.stack import RunStack
from trainer.starting_point import initial_model, resume_point
from trainer.summary import build_summary
from trainer.task.base import EvalRequest


def run(cfg: TrainConfig, callbacks=(), publisher_hook=None, before_stop=None) -> dict:
    """Train; returns the summary (also printed and written to ``runs/<run_id>/summary.json``).

    The story: the model to start from -> the run stack (bucket, environment server, publisher,
    replica, dashboard, fleet, router) -> the evaluation before (when the replica serves the
    first version) -> GRPO with a learning-curve point every ``eval.every`` steps -> the
    evaluation after -> the summary. The stack stops in reverse order on every path. Each part
    is handed its own section of ``cfg`` and what an earlier step returned (the router's URL).

    Args:
        cfg: the configuration (read, never written).
        callbacks: factories ``f(stack: RunStack) -> transformers.TrainerCallback`` (e.g. the
            fault injection of ``trainer.e2e``).
        publisher_hook: ``f(stack)`` called once the publisher exists.
        before_stop: ``f(stack, summary)`` called after training, before the stack stops; it may
            add to the summary.
    """
    trl_compat.apply()
    task, weights = cfg.task(), trained_weights(cfg.adapter)
    if ranks.world() > 1 and ranks.rank() != 0:
        return ranks.run_other_rank(
            lambda model_path: build_trainer(cfg.grpo, cfg.run, weights, model_path, task).trainer
        )
    t_start = time.time()
    with RunStack(cfg, weights, task) as stack:
        base_model, warm_start_s = initial_model(cfg.run, task, cfg.local_model)
        model_path = resume_point(cfg.run, stack.store, base_model)
        rollouts = stack.start(model_path, publisher_hook)
        metrics = BucketMetricsCallback.for_run(stack, rollouts.publisher, task)
        played_at = EvalRequest(
            rollouts.url,
            model_path,
            stack.env_url,
            weights.served_name,
            cfg.grpo.max_completion_length,
            max_turns=cfg.grpo.max_tool_calling_iterations,
            headers=rollouts.headers,
            env_headers=stack.env_headers(),
        )
        evals = HeldOutEvals(cfg.eval, task, played_at, rollouts, record=metrics.add_eval)
        ranks.share_model_path(model_path)  # the other ranks build their trainers now
        serving = Serving(rollouts, on_first_apply=evals.before)
        grpo = build_trainer(cfg.grpo, cfg.run, weights, model_path, task, serving)
        metrics.tagger = grpo.tagger  # the training games and staleness of each step
        trainer = grpo.trainer
        trainer.add_callback(metrics)
        trainer.add_callback(EvalEvery(cfg.eval.every, cfg.grpo.max_steps, evals.curve_point))
        for make_callback in callbacks:
            trainer.add_callback(make_callback(stack))
        quiet_progress(trainer)
        t_train = time.time()
        trainer.train()  # the evaluation "before" runs inside, once v0 is served
        rollouts.publisher.close()  # idempotent with TRL's destroy(): flush the last publish
        train_s = time.time() - t_train
        evals.after(trainer.state.global_step)
        start = dict(initial_model=base_model, warm_start_s=warm_start_s, train_s=train_s)
        digest = weights.trained_digest(trainer)
        summary = build_summary(cfg, start, digest, [stack, grpo.tagger, metrics, evals, weights])
        if before_stop is not None:
            before_stop(stack, summary)
        summary["wall_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(cfg.run.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
