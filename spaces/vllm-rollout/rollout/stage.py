"""The staging file between the sync loop and the vLLM worker (a safetensors file, no pickle).

The sync loop writes it BEFORE pausing generation (so the pause holds only the apply), into a
local folder (``/dev/shm`` when it exists: memory speed), and passes its path to the worker
extension through ``/collective_rpc`` (which carries strings only). Two kinds:

- ``dense``: whole checkpoint tensors, bf16, under their checkpoint names (the reload path).
- ``sparse``: per tensor ``<name>::idx`` (int64[M], flat positions) and ``<name>::val`` (bf16[M],
  absolute new values) (the in-place path); the full shapes are in the metadata.

Metadata (str -> str): ``format`` = ``deltasync-stage/1``, ``kind``, ``version``, ``shapes`` (JSON
{name: shape}), ``refresh_lm_head`` ("0"/"1") and, for ``sparse``, ``sum_deltas`` (JSON {vLLM
parameter: expected change of its int16 bit sum}). numpy + safetensors only; no torch.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors import TensorSpec, serialize_file

FORMAT = "deltasync-stage/1"
IDX, VAL = "::idx", "::val"


def _spec(dtype: str, a: np.ndarray) -> TensorSpec:
    return TensorSpec(dtype=dtype, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)


def write_stage(
    path: str,
    kind: str,
    version: int,
    dense: dict[str, np.ndarray] | None = None,
    sparse: dict[str, tuple[tuple[int, ...], np.ndarray, np.ndarray]] | None = None,
    refresh_lm_head: bool = False,
    sum_deltas: dict[str, int] | None = None,
) -> int:
    """Write a staging file atomically (temp file + rename). Returns its size in bytes.

    Args:
        path: destination file.
        kind: ``"dense"`` or ``"sparse"``.
        version: the model version the file brings the worker to.
        dense: {name: np.uint16 bf16 bits of the whole tensor} for ``kind="dense"``.
        sparse: {name: (full shape, int64[M] flat indices, np.uint16[M] bf16 bits)} for
            ``kind="sparse"``.
        refresh_lm_head: ask the worker to refresh a tied lm_head after loading.
        sum_deltas: for ``sparse``, {vLLM parameter: expected change of its int16 bit sum}
            (``rollout.plan.sum_deltas``), checked by the worker after the in-place apply.

    Raises:
        ValueError: ``kind`` does not match the data given.
    """
    specs, keep, shapes = {}, [], {}
    if kind == "dense" and dense is not None and sparse is None:
        for name, bits in dense.items():
            a = np.ascontiguousarray(bits, dtype=np.uint16)
            keep.append(a)
            specs[name] = _spec("bfloat16", a)
            shapes[name] = list(a.shape)
    elif kind == "sparse" and sparse is not None and dense is None:
        for name, (shape, idx, val) in sparse.items():
            i = np.ascontiguousarray(idx, dtype=np.int64)
            v = np.ascontiguousarray(val, dtype=np.uint16)
            keep += [i, v]
            specs[name + IDX] = _spec("int64", i)
            specs[name + VAL] = _spec("bfloat16", v)
            shapes[name] = list(shape)
    else:
        raise ValueError(
            f"expected kind 'dense' with dense= or 'sparse' with sparse=, got {kind!r}"
        )
    meta = {
        "format": FORMAT,
        "kind": kind,
        "version": str(version),
        "shapes": json.dumps(shapes, separators=(",", ":")),
        "refresh_lm_head": "1" if refresh_lm_head else "0",
    }
    if sum_deltas is not None:
        meta["sum_deltas"] = json.dumps(sum_deltas, separators=(",", ":"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    serialize_file(specs, tmp, metadata=meta)
    del keep  # the buffers behind data_ptr had to stay alive until here
    os.replace(tmp, path)
    return os.path.getsize(path)


def default_stage_dir() -> str:
    """``/dev/shm/deltasync-stage`` where /dev/shm exists (RAM), else the temp folder's."""
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return os.path.join(base or tempfile.gettempdir(), f"deltasync-stage-{os.getuid()}")


def unlink_stage(path: str) -> None:
    """Delete a staging file; one that is gone already is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
