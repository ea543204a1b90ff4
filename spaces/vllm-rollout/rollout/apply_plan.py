"""Apply-path planning, without torch or vLLM: which path a replica uses, and which checkpoint
tensors must be reloaded together.

vLLM fuses some checkpoint tensors into one parameter (q/k/v -> ``qkv_proj``, gate/up ->
``gate_up_proj``; the model's ``packed_modules_mapping``), and its layerwise reload processes a
module only once every element of it is loaded: a reload that touches ``q_proj`` but omits
``k_proj`` leaves the k part of ``qkv_proj`` as uninitialised memory. So the reload path groups
checkpoint names by the vLLM module they feed and reloads whole groups. A tied ``lm_head`` shares
``embed_tokens``' matrix but is repacked separately on CPU, so it must be refreshed whenever the
embedding changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# vLLM's packed_modules_mapping of Llama/Qwen-style models; the replica uses the served model's own
# mapping (reported by the worker extension) and falls back to this one.
DEFAULT_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
EMBED_NAME = "model.embed_tokens.weight"

APPLY_PATHS = ("in-place", "reload")


class UnsupportedModelError(ValueError):
    """The served model cannot take sparse bf16 updates (quantized, fp16/fp8, MoE, ...), or not
    on the apply path asked for (in-place on the CPU build or on float32 weights)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the worker extension reports about the served model (``deltasync_describe``).

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` (the worker's device type).
        dtype: vLLM's model dtype: ``"torch.bfloat16"``, or ``"torch.float32"`` (where bf16 is
            emulated, ``ROLLOUT_DTYPE``): vLLM's weight loaders copy the bf16 values into the
            float32 parameters, exactly, so the reload path serves the version's bits in both.
        quantization: vLLM's quantization method name, or None.
        moe: the model has fused-MoE layers.
        tie_word_embeddings: lm_head shares the embedding matrix.
        packed_modules_mapping: {fused module leaf: [checkpoint module leaves]}.
        architecture: the vLLM model class name.
    """

    device: str
    dtype: str
    quantization: str | None
    moe: bool
    tie_word_embeddings: bool
    packed_modules_mapping: dict[str, list[str]]
    architecture: str = ""

    @classmethod
    def from_json(cls, d: Mapping) -> ModelInfo:
        return cls(
            device=str(d["device"]),
            dtype=str(d["dtype"]),
            quantization=d.get("quantization"),
            moe=bool(d.get("moe", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            packed_modules_mapping={
                k: list(v) for k, v in (d.get("packed_modules_mapping") or {}).items()
            }
            or dict(DEFAULT_PACKED_MODULES),
            architecture=str(d.get("architecture", "")),
        )


def choose_apply_path(info: ModelInfo, requested: str = "auto") -> str:
    """The apply path for a served model: ``"in-place"`` (sparse patches through vLLM's
    ``load_checkpoint_weight_patches``, unquantized bf16 on GPU) or ``"reload"`` (layerwise reload
    of whole touched tensors; the only path on the CPU build, which repacks linear weights, and
    for a model served in float32, whose parameters the in-place bit-sum check cannot read as
    bf16).

    Args:
        info: the worker's report.
        requested: ``"auto"``, ``"in-place"`` or ``"reload"``.

    Raises:
        UnsupportedModelError: a quantized, fp8/fp16 or MoE model (refused at start-up), or
            ``"in-place"`` requested on the CPU build or for a model served in float32.
        ValueError: an unknown ``requested`` value.
    """
    if requested not in ("auto", *APPLY_PATHS):
        raise ValueError(f"expected apply path auto|in-place|reload, found {requested!r}")
    if info.quantization:
        raise UnsupportedModelError(
            f"the served model is quantized ({info.quantization}); deltasync applies exact bf16 "
            "values and cannot patch quantized weights. Serve the bf16 checkpoint "
            "(drop --quantization)"
        )
    if info.dtype not in ("torch.bfloat16", "torch.float32"):
        raise UnsupportedModelError(
            f"expected the model served in bfloat16 or float32, found {info.dtype}; bf16 values "
            "would be rounded. Set ROLLOUT_DTYPE=bfloat16 (or float32, or auto)"
        )
    if info.moe:
        raise UnsupportedModelError(
            f"{info.architecture or 'the model'} has fused-MoE layers, whose backends may reorder "
            "expert weights; checkpoint-coordinate patches are not safe there. Use a dense model"
        )
    on_cpu = info.device == "cpu"
    if requested == "in-place" and on_cpu:
        raise UnsupportedModelError(
            "apply path 'in-place' is impossible on the CPU build: it repacks linear weights into "
            "opaque GEMM handles. Use APPLY_PATH=reload (or auto)"
        )
    if requested == "in-place" and info.dtype != "torch.bfloat16":
        raise UnsupportedModelError(
            f"apply path 'in-place' patches bf16 parameters only; the model is served in "
            f"{info.dtype}. Use APPLY_PATH=reload (or auto), or ROLLOUT_DTYPE=bfloat16"
        )
    if requested != "auto":
        return requested
    return "reload" if on_cpu or info.dtype != "torch.bfloat16" else "in-place"


def module_key(name: str, packed: Mapping[str, list[str]] | None = None) -> str:
    """The vLLM module a checkpoint tensor feeds: ``a.b.q_proj.weight`` -> ``a.b.qkv_proj``."""
    packed = DEFAULT_PACKED_MODULES if packed is None else packed
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, sources in packed.items():
        if leaf in sources:
            return f"{parent}.{fused}" if parent else fused
    return module


def param_name(name: str, packed: Mapping[str, list[str]] | None = None) -> str:
    """The vLLM parameter a checkpoint tensor lands in: ``a.q_proj.weight`` -> ``a.qkv_proj.weight``."""
    return f"{module_key(name, packed)}.{name.rpartition('.')[2]}"


def sum_deltas(patches: Iterable, packed: Mapping[str, list[str]] | None = None) -> dict[str, int]:
    """{vLLM parameter: how much the patches change the sum of its bits read as int16}, from
    checkpoint-coordinate patches with old values (``deltasync.subscriber.Patch.sum_delta``). The
    sum does not depend on where vLLM puts each element (fused shards, transposes, padding), so
    the worker can check an in-place apply against it on the device."""
    out: dict[str, int] = {}
    for p in patches:
        key = param_name(p.name, packed)
        out[key] = out.get(key, 0) + p.sum_delta()
    return out


def reload_groups(
    names: Iterable[str], packed: Mapping[str, list[str]] | None = None
) -> dict[str, list[str]]:
    """Checkpoint names grouped by the vLLM module they feed, {module: [names, in given order]}."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(module_key(n, packed), []).append(n)
    return groups


@dataclass(frozen=True)
class ReloadPlan:
    """What one reload-path apply loads.

    Attributes:
        names: checkpoint names to reload, grouped by module (all shards of every touched fused
            parameter, weight and bias together), in checkpoint order.
        refresh_lm_head: re-run the tied lm_head's weight processing after the reload.
    """

    names: list[str]
    refresh_lm_head: bool


def plan_reload(
    touched: Iterable[str],
    all_names: Iterable[str],
    packed: Mapping[str, list[str]] | None = None,
    tie_word_embeddings: bool = False,
) -> ReloadPlan:
    """Expand touched checkpoint names to everything that must be reloaded with them.

    Args:
        touched: names whose values changed.
        all_names: every checkpoint name of the model, in checkpoint order.
        packed: the model's packed_modules_mapping (default: q/k/v and gate/up).
        tie_word_embeddings: the lm_head shares the embedding.

    Raises:
        KeyError: a touched name is not in ``all_names``.
    """
    all_list = list(all_names)
    groups = reload_groups(all_list, packed)
    touched_set = set(touched)
    unknown = touched_set - set(all_list)
    if unknown:
        raise KeyError(f"touched tensors not in the model: {sorted(unknown)[:5]}")
    keys = {module_key(n, packed) for n in touched_set}
    want = {n for k in keys for n in groups[k]}
    names = [n for n in all_list if n in want]
    return ReloadPlan(names, tie_word_embeddings and EMBED_NAME in touched_set)
