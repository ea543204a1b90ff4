"""LoRA adapter runs (``ADAPTER=lora``): the PEFT config TRL wraps the model with, the adapter
tensors each weight sync publishes, and the base-model digest that ties them to their base.

An adapter run trains a LoRA adapter on the frozen model and publishes, into the same run root as
a full-weight run, only the adapter's tensors: PEFT's ``get_peft_model_state_dict`` keys
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), bf16 on the wire. Every
manifest carries a ``deltasync.manifest.AdapterInfo``: the PEFT config (as PEFT writes
``adapter_config.json``), the base model's name and its digest (``deltasync.adapter.
base_digest_of`` over the base weights). A replica refuses an adapter whose base digest is not
that of the model it serves; it loads each version under ``{adapter_name}-v{N}`` and serves the
stable ``adapter_name`` that rollouts and evaluations request.
"""

from __future__ import annotations

import logging
import os

from trainer.settings import AdapterConfigError, AdapterSettings

log = logging.getLogger("trainer.loop.adapter")

TASK_TYPE = "CAUSAL_LM"


def lora_config(settings: AdapterSettings):
    """The ``peft.LoraConfig`` of the run (rank, alpha and target modules from ``settings``; no
    dropout, no bias: what vLLM serves as a LoRA), for TRL's ``peft_config`` argument. PEFT
    fills in ``base_model_name_or_path`` when it wraps the model."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=settings.modules(),
        lora_dropout=0.0,
        bias="none",
        task_type=TASK_TYPE,
    )


def peft_config_json(config, base_model: str | None = None) -> dict:
    """The JSON PEFT writes to ``adapter_config.json`` for ``config`` (a ``peft.LoraConfig``):
    its ``to_dict()`` with ``inference_mode`` true (as ``PeftModel.save_pretrained`` writes it)
    and sets as sorted lists (so the same settings always give the same manifest);
    ``base_model`` (when given) as ``base_model_name_or_path``."""
    import json

    d = config.to_dict()
    d["inference_mode"] = True
    if base_model is not None:
        d["base_model_name_or_path"] = base_model
    d = {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}
    return json.loads(json.dumps(d))  # enums (task_type, peft_type) as their JSON strings


def base_name(model_path: str) -> str:
    """The base model's name as recorded in the manifest: a hub id as is, a local folder by its
    base name (no local path in the bucket; the replica names its folder the same way)."""
    if os.path.isdir(model_path):
        return os.path.basename(os.path.normpath(model_path)) or "model"
    return model_path


def base_digest(model) -> str:
    """``deltasync.adapter.base_digest_of`` the base weights of ``model``: a PEFT model's (names
    without ``base_model.model.`` and ``.base_layer``, the adapter's tensors left out) or a plain
    transformers model's, over its ``state_dict()`` (a tied ``lm_head.weight`` is left out by
    the rule, as a checkpoint does not store it). Equals ``base_digest_of_folder`` of the folder
    the model was loaded from, which is what a replica serving that folder computes."""
    from deltasync.adapter import base_digest_of, base_named_tensors

    return base_digest_of(base_named_tensors(model.state_dict().items()))


def adapter_info(settings: AdapterSettings, model_path: str):
    """The run's ``deltasync.manifest.AdapterInfo``, for the publisher, computed before the
    trainer exists without building a model: the base digest is
    ``deltasync.adapter.base_digest_of_folder`` over the checkpoint's safetensors files (read
    memory-mapped, one tensor at a time; what a replica serving that folder computes, and equal
    to :func:`base_digest` of the model loaded from it). TRL's model, the one model the run
    builds, is checked against it at the first sync (:func:`check_trainer_model`).

    Raises:
        AdapterConfigError: ``settings.kind`` is not ``lora``.
        FileNotFoundError: the checkpoint holds no safetensors file.
    """
    from deltasync.adapter import base_digest_of_folder
    from deltasync.manifest import AdapterInfo

    if settings.kind != "lora":
        raise AdapterConfigError(f"adapter_info: expected ADAPTER=lora, found {settings.kind!r}")
    name = base_name(model_path)
    folder = model_path
    if not os.path.isdir(folder):  # a hub id: the files TRL loads (the same hub cache)
        from huggingface_hub import snapshot_download

        folder = snapshot_download(model_path, allow_patterns=["*.safetensors", "*.json"])
    digest = base_digest_of_folder(folder)
    info = AdapterInfo(
        kind="lora",
        peft_config=peft_config_json(lora_config(settings), name),
        base_model=name,
        base_digest=digest,
    )
    log.info("adapter run: LoRA r=%d on %s (base digest %s)", settings.rank, name, digest)
    return info


def adapter_tensors(model) -> dict:
    """The adapter's tensors as PEFT saves them (``get_peft_model_state_dict`` of the active
    adapter): {``base_model.model.….lora_A.weight``: tensor (rank, in) / ``lora_B`` (out,
    rank)}, detached, in the training dtype; the publisher rounds them to bf16."""
    from peft import get_peft_model_state_dict

    name = model.active_adapters[0]
    return {n: t.detach() for n, t in get_peft_model_state_dict(model, adapter_name=name).items()}


def adapter_digest(model) -> str:
    """Model digest (``deltasync.manifest.model_digest``) of ``model``'s adapter tensors as bf16:
    equal to the manifest's ``digest`` of a version published from this state. For an adapter
    run's summary: ``replica_bit_exact`` compares the final version's digest with this."""
    from deltasync.bf16 import digest, to_bf16_bits
    from deltasync.manifest import model_digest

    return model_digest({n: digest(to_bf16_bits(t)) for n, t in adapter_tensors(model).items()})


def check_trainer_model(model, info) -> None:
    """Check that the trainer's PEFT model is the adapter the publisher records (``info``, the
    publisher's ``adapter``): TRL's ``validate_lora_for_vllm_sync`` (a plain LoRA vLLM can
    serve), the same PEFT settings and the same base weights (by digest).

    Raises:
        AdapterConfigError: TRL refuses the adapter for vLLM (its message says why).
        deltasync.errors.AdapterMismatchError: the model's LoRA settings differ from ``info``'s,
            or ``info`` is None (a publisher of full weights).
        deltasync.errors.WrongBaseModelError: its base weights are not the ones ``info`` names.
    """
    from trl.experimental.async_grpo.async_grpo_trainer import validate_lora_for_vllm_sync

    from deltasync.adapter import check_adapter, check_base
    from deltasync.manifest import AdapterInfo

    try:
        config = validate_lora_for_vllm_sync(model)
    except ValueError as e:
        raise AdapterConfigError(f"{e} (fix the --lora-* settings)") from e
    own_digest = base_digest(model)
    found = AdapterInfo(
        kind="lora",
        peft_config=peft_config_json(config),
        base_model=info.base_model if info is not None else base_name(model.name_or_path),
        base_digest=info.base_digest if info is not None else own_digest,
    )
    check_adapter(found, info, "the trainer's PEFT model")
    check_base(info, own_digest, "the trainer's model")


def restore_from_bucket(model, publisher) -> int | None:
    """Restart of an adapter run: load the run's newest published adapter (bf16, as the replicas
    hold it) into ``model``'s adapter, so training goes on from there (the optimizer state starts
    fresh, as for full weights). Returns the version restored, None for a new run.

    Raises:
        deltasync.errors.ModelMismatchError: the bucket's adapter keys are not this model's.
    """
    from peft import set_peft_model_state_dict

    from deltasync.errors import ModelMismatchError
    from deltasync.subscriber import DeltaSubscriber, HeldWeights

    manifest = publisher.manifest
    if manifest is None or manifest.latest is None:
        return None
    sub, held = DeltaSubscriber(publisher.store), HeldWeights()
    try:
        sub.sync(held)
    finally:
        sub.close()
    own = adapter_tensors(model)
    if set(held.tensors) != set(own):
        diff = sorted(set(held.tensors) ^ set(own))[:3]
        raise ModelMismatchError(
            f"the run's adapter v{held.version} and the trainer's adapter name different tensors "
            f"(e.g. {diff}); resume with the run's LoRA settings or use a new run root"
        )
    tensors = {n: t.to(own[n].dtype) for n, t in held.to_torch().items()}
    set_peft_model_state_dict(model, tensors, adapter_name=model.active_adapters[0])
    log.info("adapter restored from bucket version %d", held.version)
    return held.version


def max_lora_rank(settings: AdapterSettings) -> int:
    """The ``--max-lora-rank`` a replica needs for this run's adapter: ``rank`` rounded up to a
    rank vLLM builds buffers for (TRL's ``round_lora_rank``: 4 -> 8, 12 -> 16).

    Raises:
        AdapterConfigError: the rank is larger than any vLLM serves.
    """
    from trl.experimental.async_grpo.async_grpo_trainer import round_lora_rank

    try:
        return round_lora_rank(settings.rank)
    except ValueError as e:
        raise AdapterConfigError(f"--lora-rank: {e}") from e
