"""Worker-side apply paths (run inside the vLLM worker process, called by the extension).

- ``reload``: whole checkpoint tensors (every shard of each touched fused parameter, see
  ``rollout.apply_plan``) go through vLLM's layerwise reload (``Worker.reload_weights`` with a
  weights iterator), which re-runs each touched module's weight processing (the CPU build's GEMM
  repacking included); a tied lm_head is refreshed afterwards. Works on every device.
- ``in-place``: sparse (index, value) patches in checkpoint coordinates through vLLM's
  ``load_checkpoint_weight_patches`` (fused/TP slicing by the model's own loaders, no copy of the
  model kept), then, with one worker, every touched parameter's bit sum checked on the device
  (``checked_patch``). Unquantized bf16 models on GPU only.

Neither path is transactional inside vLLM: when one raises, the caller (the sync loop) keeps
generation paused and reloads every tensor from its verified copy before resuming.
torch and vLLM are imported here only; this module is never imported by the sync loop.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from typing import Any

import torch

from .apply_plan import DEFAULT_PACKED_MODULES, module_key
from .staging import FORMAT, IDX, VAL

log = logging.getLogger("rollout.worker_apply")

# Warnings vLLM's layerwise reload emits for every module a PARTIAL reload leaves alone on purpose.
_PARTIAL_RELOAD_NOISE = ("Failed to load weights", "Following weights were not loaded")


class StageFileError(ValueError):
    """A staging file is not one this extension wrote, or misses shards of a fused parameter."""


class InPlaceCheckError(RuntimeError):
    """After an in-place apply, a parameter's bit sum moved by another amount than the patches
    say: vLLM wrote some values elsewhere (e.g. a non-contiguous layout, vLLM #57130). The
    weights are unknown; the sync loop reloads every tensor from its verified copy."""


# A row of at most this many int16 values sums exactly in int32 (65535 * 32768 < 2**31).
_INT32_ROW = 65535
# {parameter: bit sum} after the last in-place apply, which is the next apply's "before" (only
# the sync loop changes weights); cleared by a reload and by a failed check. One model per worker.
_SUMS_AFTER_LAST_APPLY: dict[str, int] = {}


def bit_sum(p: torch.Tensor) -> int:
    """The sum of a tensor's bits read as int16, exact, computed on its device in any layout:
    rows summed in int32 (twice as fast as one int64 reduction on an H100: 2.1 against 4.0 ms
    for 622 M elements), then the row sums in int64."""
    v = p.detach().view(torch.int16)
    if v.dim() >= 2 and v.shape[-1] <= _INT32_ROW:
        return int(v.sum(-1, dtype=torch.int32).sum(dtype=torch.int64))
    return int(v.sum(dtype=torch.int64))


def bit_sums(model: torch.nn.Module, names, cache: dict[str, int] | None = None) -> dict[str, int]:
    """{parameter name: :func:`bit_sum`}, taken from ``cache`` where it has the name. Names the
    model does not have are left out."""
    params = dict(model.named_parameters())
    cache = cache or {}
    return {n: cache[n] if n in cache else bit_sum(params[n]) for n in names if n in params}


def checked_patch(
    model: torch.nn.Module, sum_deltas: dict[str, int], patch, cache: dict[str, int] | None = None
) -> int:
    """Run ``patch()`` (the in-place apply) and check, on the device, that every parameter's
    int16 bit sum moved by ``sum_deltas[name]`` (``rollout.apply_plan.sum_deltas``). A checksum,
    not a digest: it catches values written to the wrong place or not at all, unless the errors
    cancel (a write to the wrong place is invisible only where it lands on another changed
    element with the same old value; where every element of a parameter changes, a permutation
    is).

    Args:
        cache: sums after the previous apply (the weights have not changed since), used as the
            "before" sums so that the paused window holds one pass, not two; updated with the
            "after" sums, and emptied when the check fails.

    Returns:
        The number of parameters checked (names the model lacks are not: they are logged).

    Raises:
        InPlaceCheckError: a parameter moved by another amount.
    """
    before = bit_sums(model, sum_deltas, cache)
    missing = sorted(set(sum_deltas) - set(before))
    if missing:
        log.warning("in-place check: the model has no parameters %s; not checked", missing[:3])
    patch()
    after = bit_sums(model, before)
    wrong = [
        (n, sum_deltas[n], after[n] - before[n])
        for n in before
        if after[n] - before[n] != sum_deltas[n]
    ]
    if cache is not None and wrong:
        cache.clear()
    elif cache is not None:
        cache.update(after)
    if wrong:
        raise InPlaceCheckError(
            f"in-place apply changed {len(wrong)} parameters' bit sums by other amounts than the "
            f"patches (name, expected, found): {wrong[:3]}; reloading from the verified copy"
        )
    return len(before)


def describe(worker: Any) -> dict:
    """What the sync loop needs to choose an apply path (see ``rollout.apply_plan.ModelInfo``)."""
    model = worker.model_runner.get_model()
    mc = worker.vllm_config.model_config
    hf = getattr(mc, "hf_text_config", None) or mc.hf_config
    moe = any("MoE" in type(m).__name__ for m in model.modules())
    packed = getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED_MODULES
    return {
        "device": torch.device(worker.device).type if hasattr(worker, "device") else "cpu",
        "dtype": str(mc.dtype),
        "quantization": mc.quantization,
        "moe": moe,
        "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "packed_modules_mapping": {k: list(v) for k, v in packed.items()},
        "architecture": type(model).__name__,
    }


def read_stage(path: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Load a staging file to CPU tensors. Raises StageFileError for a foreign file."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise StageFileError(
                f"{path}: expected format {FORMAT!r}, found {meta.get('format')!r}"
            )
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open API)
    return meta, tensors


def check_fused_complete(names: list[str], packed: dict[str, list[str]]) -> None:
    """Raise StageFileError unless every touched fused parameter has all its shards in ``names``
    (a layerwise reload of a partial fused parameter leaves the rest as uninitialised memory)."""
    have = set(names)
    for n in names:
        key = module_key(n, packed)
        fused = key.rpartition(".")[2]
        if fused not in packed:
            continue
        module, _, param = n.rpartition(".")
        parent = module.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        missing = [
            f"{prefix}{s}.{param}" for s in packed[fused] if f"{prefix}{s}.{param}" not in have
        ]
        if missing:
            raise StageFileError(
                f"reload of {n} into {key} lacks its other shards {missing}; include every shard "
                "of a fused parameter (rollout.apply_plan.plan_reload does)"
            )


class _DropPartialReloadNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(s in str(record.msg) for s in _PARTIAL_RELOAD_NOISE)


@contextmanager
def _quiet_partial_reload():
    names = (
        "vllm.model_executor.model_loader.reload.layerwise",
        "vllm.model_executor.model_loader.reload.inplace",
    )
    flt = _DropPartialReloadNoise()
    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addFilter(flt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Re-run a tied lm_head's weight processing (the CPU build repacks it into its own GEMM
    handle, which a reload of ``embed_tokens`` does not refresh). Returns whether it ran."""
    lm_head = getattr(model, "lm_head", None)
    qm = getattr(lm_head, "quant_method", None)
    if lm_head is None or qm is None:
        return False
    qm.process_weights_after_loading(lm_head)
    return True


def apply_reload(worker: Any, path: str) -> dict:
    """Reload the dense tensors of a staging file through vLLM's layerwise reload.

    Returns:
        {"version", "tensors", "read_s", "reload_s", "lm_head_refreshed"}.

    Raises:
        StageFileError: not a dense staging file, or a fused parameter's shards are incomplete
            (raised before anything is loaded).
    """
    t0 = time.perf_counter()
    meta, tensors = read_stage(path)
    if meta.get("kind") != "dense":
        raise StageFileError(f"{path}: expected a dense staging file, found {meta.get('kind')!r}")
    model = worker.model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED_MODULES
    check_fused_complete(list(tensors), packed)
    _SUMS_AFTER_LAST_APPLY.clear()  # the reload changes weights the sums do not follow
    t1 = time.perf_counter()
    with _quiet_partial_reload():
        worker.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    refreshed = meta.get("refresh_lm_head") == "1" and refresh_tied_lm_head(model)
    t2 = time.perf_counter()
    return {
        "version": int(meta["version"]),
        "tensors": len(tensors),
        "read_s": t1 - t0,
        "reload_s": t2 - t1,
        "lm_head_refreshed": bool(refreshed),
    }


def apply_in_place(worker: Any, path: str) -> dict:
    """Apply the sparse patches of a staging file with ``load_checkpoint_weight_patches``.

    With one worker (no tensor parallelism) every touched parameter's bit sum is checked on the
    device afterwards against the staged ``sum_deltas`` (:func:`checked_patch`).

    Returns:
        {"version", "tensors", "checked", "elements", "read_s", "patch_s"}.

    Raises:
        StageFileError: not a sparse staging file.
        InPlaceCheckError: the check failed (the weights are then unknown).
        ValueError: from vLLM, for NaN values or out-of-range/duplicate indices (raised before
            anything is written).
    """
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    t0 = time.perf_counter()
    meta, tensors = read_stage(path)
    if meta.get("kind") != "sparse":
        raise StageFileError(f"{path}: expected a sparse staging file, found {meta.get('kind')!r}")
    shapes = json.loads(meta["shapes"])
    device = worker.device if hasattr(worker, "device") else "cpu"
    patches, elements = [], 0
    for name, shape in shapes.items():
        idx, val = tensors[name + IDX], tensors[name + VAL]
        elements += idx.numel()
        patches.append(
            CheckpointWeightPatch(
                name=name,
                shape=tuple(shape),
                dtype=torch.bfloat16,
                values=val.to(device, non_blocking=True),
                indices=idx.to(device, non_blocking=True),
            )
        )
    t1 = time.perf_counter()
    model = worker.model_runner.get_model()
    sums = json.loads(meta.get("sum_deltas") or "{}")
    tp = getattr(getattr(worker.vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
    if tp == 1 and sums:  # a rank of a TP group holds slices: its sums are not the whole's
        checked = checked_patch(
            model,
            sums,
            lambda: load_checkpoint_weight_patches(model, patches),
            _SUMS_AFTER_LAST_APPLY,
        )
    else:
        _SUMS_AFTER_LAST_APPLY.clear()  # weights change unchecked: the sums no longer hold
        load_checkpoint_weight_patches(model, patches)
        checked = 0
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
    return {
        "version": int(meta["version"]),
        "tensors": len(patches),
        "checked": checked,
        "elements": elements,
        "read_s": t1 - t0,
        "patch_s": time.perf_counter() - t1,
    }


def _linear_weight(module: torch.nn.Module, dtype: torch.dtype, device) -> torch.Tensor:
    """The weight a linear module computes with, ``[N, K]``, read back through its own kernel:
    the identity through ``quant_method.apply`` (the CPU build's packed oneDNN/SGL weights
    included, whose parameters are then empty). Exact: each output is one weight times 1.0 plus
    zeros, accumulated in float32 or wider, for any finite weight."""
    k = (
        int(module.weight.shape[1])
        if module.weight.numel()
        else int(module.input_size_per_partition)
    )
    eye = torch.eye(k, dtype=dtype, device=device)
    with torch.no_grad():
        out = module.quant_method.apply(module, eye)
    return (out[0] if isinstance(out, tuple) else out).t()


def served_digests(worker: Any) -> dict:
    """xxh3-64 digests of the bf16 bits of every checkpoint tensor the engine serves, read from
    what it computes with, for the full-weights check (``rollout.sync_loop.SyncLoop.
    check_served``) against the digests the manifest's payloads carry.

    Linear modules (fused ``qkv_proj`` / ``gate_up_proj`` split into their checkpoint shards
    by ``output_sizes``, and an untied ``lm_head``, its vocabulary padding cut) are read back
    through their kernel (:func:`_linear_weight`); every other parameter (embedding, norms) is
    read as it is. A float32 engine's weights are cast to bf16, exact for values that came from
    bf16. One worker only (a rank of a tensor-parallel group holds slices).

    Returns:
        {"digests": {checkpoint name: 16 hex digits}, "read_s": seconds}.

    Raises:
        ValueError: tensor parallelism (more than one worker).
    """
    from deltasync.bf16 import digest

    tp = getattr(getattr(worker.vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"served_digests: expected one worker, found tensor parallel {tp}")
    t0 = time.perf_counter()
    model = worker.model_runner.get_model()
    dtype = worker.vllm_config.model_config.dtype
    device = worker.device if hasattr(worker, "device") else "cpu"
    packed = getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED_MODULES
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    read_back: set[str] = set()
    for mname, module in model.named_modules():
        leaf = mname.rsplit(".", 1)[-1]
        is_linear = hasattr(module, "input_size_per_partition") and hasattr(module, "quant_method")
        is_head = leaf == "lm_head" and not tied and hasattr(module, "quant_method")
        if not (is_linear or is_head):
            continue
        w = _linear_weight(module, dtype, device)
        read_back.add(f"{mname}.weight")
        if is_head:
            rows = int(getattr(module, "org_vocab_size", w.shape[0]))
            out[f"{mname}.weight"] = w[:rows]
            continue
        sizes = list(getattr(module, "output_sizes", None) or [w.shape[0]])
        shards = packed.get(leaf)
        if shards and len(shards) == len(sizes):
            prefix = mname[: -len(leaf)]
            for shard, part in zip(shards, torch.split(w, sizes, dim=0), strict=True):
                out[f"{prefix}{shard}.weight"] = part
        else:
            out[f"{mname}.weight"] = w
    for pname, p in model.named_parameters():
        if pname in read_back or pname in out or not p.numel():
            continue
        if pname.endswith("embed_tokens.weight"):
            rows = int(getattr(model.get_submodule(pname[: -len(".weight")]), "org_vocab_size", 0))
            p = p[:rows] if rows else p
        out[pname] = p
    digests = {
        n: digest(t.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy())
        for n, t in out.items()
    }
    return {"digests": digests, "read_s": time.perf_counter() - t0}
