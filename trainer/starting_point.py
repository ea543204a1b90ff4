"""The model a run starts from: the warm-started local model or a Hub model, and, for a run whose
bucket already holds versions, those weights (restart)."""

from __future__ import annotations

import logging
import os
import shutil

from deltasync.store import Store
from trainer.settings import TINY, LocalModelSettings, RunSettings
from trainer.task.base import Task, TaskError

log = logging.getLogger("trainer")


def initial_model(
    run: RunSettings, task: Task, local_model: LocalModelSettings
) -> tuple[str, float]:
    """The model a new run starts from and the seconds spent building it: for ``tiny``, the
    task's own local model (``task.local_model``, built with ``local_model``, cached); for
    a hub id or a folder, the model with a tool-capable chat template
    (``trainer.task.chat_format.with_tool_template``) and, when ``run.hub_warm_start_game_count``
    asks for games and the task has a teacher, its warm start (``task.warm_start``, cached).

    Raises:
        trainer.task.chat_format.ChatTemplateError: the model's template has no tools and is not
            ChatML.
        trainer.task.TaskError: ``--model tiny`` with a task that has no local model.
    """
    model, cache = run.model_id(), run.cache
    if run.trains_local_model and model != TINY:  # the local model's folder, built before
        return os.path.abspath(model), 0.0
    if model != TINY:
        from trainer.task.chat_format import tool_template_folder, with_tool_template

        with_tools = with_tool_template(model, tool_template_folder(model, cache))
        games = run.hub_warm_start_game_count(template_swapped=with_tools != model)
        if not games or task.warm_start is None:
            return with_tools, 0.0
        return task.warm_start(run, with_tools, games)
    if task.local_model is None:
        raise TaskError(
            f"--model tiny with task {task.name!r}: expected a task with a local model, found "
            "none; pass --model <hub id or model folder>"
        )
    return task.local_model(run, local_model)


def resume_point(run: RunSettings, store: Store, model: str) -> str:
    """The model folder TRL loads: ``model``, or for a full-weight run that already has versions,
    a copy whose weights are the bucket's newest version (restart; the optimizer state starts
    fresh). An adapter run's versions are adapters: TRL loads the base ``model`` unchanged and the
    trainer restores the newest adapter into it (``trainer.loop.adapter.restore_from_bucket``)."""
    from deltasync.subscriber import DeltaSubscriber, HeldWeights

    sub = DeltaSubscriber(store)
    manifest = sub.read_manifest()
    if manifest is None or manifest.latest is None or manifest.adapter is not None:
        sub.close()
        return model
    held = HeldWeights()
    sub.sync(held)
    sub.close()
    resume = os.path.abspath(os.path.join(run.run_dir, "resume"))
    _write_checkpoint(model, held, resume)
    log.info("resuming run %s from bucket version %d (%s)", run.run_id, held.version, resume)
    return resume


def _write_checkpoint(src: str, held, dst: str) -> None:
    """Copy a model folder's config/tokenizer to ``dst`` with the held weights as safetensors."""
    from huggingface_hub import snapshot_download
    from safetensors.torch import save_file

    if not os.path.isdir(src):
        src = snapshot_download(src, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja"])
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    for fn in os.listdir(src):
        if not fn.endswith(".safetensors") and not fn.endswith(".index.json"):
            p = os.path.join(src, fn)
            if os.path.isfile(p):
                shutil.copy(p, dst)
    save_file({n: t.contiguous() for n, t in held.to_torch().items()}, f"{dst}/model.safetensors")
