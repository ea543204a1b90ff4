"""The training job: TRL's AsyncGRPOTrainer on Wordle, publishing every update to the bucket.

``python -m trainer`` (or ``make train``). The local default creates a tiny model, starts the
Wordle Space and a vLLM replica as children, trains for ``max_steps`` steps, and prints a summary.
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
from trainer.loop.grpo import build_trainer
from trainer.loop.learning_curve import EvalEvery, HeldOutEvals
from trainer.loop.metrics import BucketMetricsCallback, quiet_progress
from trainer.stack import RunStack
from trainer.start_model import initial_model, resume_point
from trainer.summary import build_summary


def run(cfg: TrainConfig, callbacks=(), publisher_hook=None, before_stop=None) -> dict:
    """Train; returns the summary (also printed and written to ``runs/<run_id>/summary.json``).

    The story: the model to start from -> the run stack (bucket, Wordle server, publisher,
    replica, dashboard, fleet, router) -> the evaluation before (when the replica serves the
    first version) -> GRPO with a learning-curve point every ``eval_every`` steps -> the
    evaluation after -> the summary. The stack stops in reverse order on every path.

    Args:
        cfg: the configuration.
        callbacks: factories ``f(stack: RunStack) -> transformers.TrainerCallback`` (e.g. the
            fault injection of ``trainer.local.e2e``).
        publisher_hook: ``f(stack)`` called once the publisher exists.
        before_stop: ``f(stack, summary)`` called after training, before the stack stops; it may
            add to the summary.
    """
    trl_compat.apply()
    if ranks.world() > 1 and ranks.rank() != 0:
        return ranks.run_other_rank(lambda model_path: build_trainer(cfg, model_path)[0])
    t_start = time.time()
    with RunStack(cfg) as stack:
        base_model, warm_start_s = initial_model(cfg)
        stack.start(resume_point(cfg, stack.store, base_model), publisher_hook)
        steps_log = os.path.join(stack.logs_dir, "steps.jsonl")
        metrics_cb = BucketMetricsCallback(
            stack.store, cfg.run_id, stack.publisher, log_path=steps_log
        )
        evals = HeldOutEvals(cfg, stack, metrics_cb)
        ranks.share_model_path(stack.model_path)  # the other ranks build their trainers now
        trainer, _, tagger = build_trainer(
            cfg,
            stack.model_path,
            stack.publisher,
            stack.replica_version,
            evals.before,
            stack.router.affinity.versions_of,
        )
        metrics_cb.tagger, metrics_cb.fleet = tagger, stack.pool.snapshot
        trainer.add_callback(metrics_cb)
        trainer.add_callback(EvalEvery(cfg.eval_every, cfg.max_steps, evals.curve_point))
        for make_callback in callbacks:
            trainer.add_callback(make_callback(stack))
        quiet_progress(trainer)
        t_train = time.time()
        trainer.train()
        stack.publisher.close()  # idempotent with TRL's destroy(): flush the last publish
        train_s = time.time() - t_train
        evals.after(trainer.state.global_step)
        start = dict(initial_model=base_model, warm_start_s=warm_start_s, train_s=train_s)
        summary = build_summary(
            stack, trainer, tagger, metrics_cb, evals, start | {"t_start": t_start}
        )
        if before_stop is not None:
            before_stop(stack, summary)
        summary["wall_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
