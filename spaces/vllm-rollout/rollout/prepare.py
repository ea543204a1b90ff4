"""Preparing a verified pull for the pause: the staging file the worker applies.

Runs BEFORE generation pauses, so the pause holds only the apply. On the in-place path a delta
pull onto a served version becomes its merged sparse patches, with the expected change of every
vLLM parameter's bit sum; otherwise (the reload path, an anchor, nothing served yet, or a new value
that is a NaN: vLLM's "unchanged" mark) whole tensors of every module the pull touched, grouped so
that fused parameters reload complete (``rollout.plan.plan_reload``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from deltasync.follow import Pulled
from deltasync.subscriber import HeldWeights, merge_patches

from .plan import ModelInfo, plan_reload, sum_deltas
from .stage import write_stage


@dataclass
class Staged:
    """A verified pull, staged and ready for the pause.

    Attributes:
        pulled: the verified steps (``held`` is at ``pulled.version``).
        from_version: the version vLLM served before (None: nothing).
        stage_s: seconds spent merging and writing the staging file.
        path: the staging file.
        mode: ``in-place`` (sparse patches) or ``reload`` (whole tensors).
        tensors: checkpoint tensors in the file.
    """

    pulled: Pulled
    from_version: int | None
    stage_s: float
    path: str
    mode: str
    tensors: int


def _is_nan_bits(bits: np.ndarray) -> bool:
    return bool(np.any((bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)))


def stage_pull(
    pulled: Pulled,
    held: HeldWeights,
    info: ModelInfo,
    apply_path: str,
    served_version: int | None,
    path: str,
) -> Staged:
    """Write the staging file at ``path`` that brings vLLM from ``served_version`` to
    ``held.version`` (``held`` already holds the pulled steps).

    Args:
        pulled: what the poll verified.
        held: the CPU copy, at the pulled version.
        info: the served model (its fused modules, tied embeddings).
        apply_path: the replica's apply path (``in-place`` or ``reload``).
        served_version: the version vLLM serves now (None: nothing yet).
        path: where to write the staging file.
    """
    t0 = time.perf_counter()
    version = held.version
    anchored = pulled.kind == "anchor"
    names = list(held.tensors)
    onto_served = not anchored and served_version is not None
    if apply_path == "in-place" and onto_served:
        merged = merge_patches(held, pulled.applied)
        if not any(_is_nan_bits(p.values) for p in merged):
            sparse = {p.name: (p.shape, p.indices, p.values) for p in merged}
            sums = sum_deltas(merged, info.packed_modules_mapping)
            write_stage(path, "sparse", version, sparse=sparse, sum_deltas=sums)
            stage_s = time.perf_counter() - t0
            return Staged(pulled, served_version, stage_s, path, "in-place", len(sparse))
    touched = sorted({p.name for ps in pulled.applied for p in ps}) if onto_served else names
    rp = plan_reload(touched, names, info.packed_modules_mapping, info.tie_word_embeddings)
    dense = {n: held.tensors[n] for n in rp.names}
    write_stage(path, "dense", version, dense=dense, refresh_lm_head=rp.refresh_lm_head)
    return Staged(pulled, served_version, time.perf_counter() - t0, path, "reload", len(dense))
