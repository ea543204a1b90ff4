"""The staging file between the sync loop and the vLLM worker, and how a verified pull becomes one.

The sync loop writes it BEFORE pausing generation (so the pause holds only the apply), into a
local folder (``/dev/shm`` when it exists: memory speed), and passes its path to the worker
extension through ``/collective_rpc`` (which carries strings only; the worker reads it with
``rollout.worker_apply.read_stage``). A safetensors file, no pickle, of one of two kinds:

- ``dense``: whole checkpoint tensors, bf16, under their checkpoint names (the reload path).
- ``sparse``: per tensor ``<name>::idx`` (int64[M], flat positions) and ``<name>::val`` (bf16[M],
  absolute new values) (the in-place path); the full shapes are in the metadata.

Metadata (str -> str): ``format`` = ``deltasync-stage/1``, ``kind``, ``version``, ``shapes`` (JSON
{name: shape}), ``refresh_lm_head`` ("0"/"1") and, for ``sparse``, ``sum_deltas`` (JSON {vLLM
parameter: expected change of its int16 bit sum}).

The folder is private (:func:`private_stage_dir`): the worker applies whatever file the path
names, so a folder another local user could write (a predictable ``/dev/shm`` name they created
first, or one open to group/other) could swap staged weights. It is created mode 0700, an
existing one must be this user's and closed to others' writes (else :class:`StageDirError`; one
they may only read is made 0700), and each
file is created exclusively, mode 0600, before it is written and renamed into place.

Which kind a pull becomes (:func:`stage_pull`): on the in-place path a delta pull onto a served
version becomes its merged sparse patches, with the expected change of every vLLM parameter's bit
sum; otherwise (the reload path, an anchor, nothing served yet, or a new value that is a NaN:
vLLM's "unchanged" mark) whole tensors of every module the pull touched, grouped so that fused
parameters reload complete (``rollout.apply_plan.plan_reload``). numpy + safetensors; no torch.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from safetensors import TensorSpec, serialize_file

from .apply_plan import ModelInfo, plan_reload, sum_deltas

if TYPE_CHECKING:
    from deltasync.follow import Pulled
    from deltasync.subscriber import HeldWeights

FORMAT = "deltasync-stage/1"
IDX, VAL = "::idx", "::val"


class StageDirError(RuntimeError):
    """The staging folder is not private to this user (another owner, group/other access, or
    not a folder); the message says what was expected, what was found and how to fix it."""


def private_stage_dir(path: str) -> str:
    """Make ``path`` (and any missing parent) with mode 0700, or check the existing one: a real
    folder (not a symlink), owned by this user, that no group or other may write; one that
    others may only read (0755, as older replicas made it) is made 0700. Returns ``path``.

    Raises:
        StageDirError: it exists and is not that; the message names the owner and mode found and
            the fix (remove it, ``chmod 700`` it, or set ``STAGE_DIR`` to a folder of your own).
    """
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # made meanwhile: checked below like any existing one
            pass
    st = os.lstat(path)
    uid = os.getuid()
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder"
        problem = f"found {kind}"
    elif st.st_uid != uid:
        problem = f"found it owned by uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):04o})"
    elif stat.S_IMODE(st.st_mode) & 0o022:
        problem = f"found mode {stat.S_IMODE(st.st_mode):04o} (group/other may write it)"
    elif stat.S_IMODE(st.st_mode) & 0o077:  # ours and only readable by others (an older
        os.chmod(path, 0o700)  # replica made it 0755): no one else can have written there
    if problem is not None:
        raise StageDirError(
            f"staging folder {path}: expected a folder owned by uid {uid} with mode 0700 (the "
            f"vLLM worker applies the weights staged there), {problem}. Fix: remove it (it "
            f"holds only staged files) or `chmod 700` it if it is yours, or set STAGE_DIR to a "
            "folder of your own"
        )
    return path


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
            (``rollout.apply_plan.sum_deltas``), checked by the worker after the in-place apply.

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
    folder = private_stage_dir(os.path.dirname(os.path.abspath(path)))
    # created here, O_EXCL and 0600, then filled: no one else's file is ever written or renamed
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".tmp-")
    os.close(fd)
    try:
        serialize_file(specs, tmp, metadata=meta)
        del keep  # the buffers behind data_ptr had to stay alive until here
        os.replace(tmp, path)
    except BaseException:
        unlink_stage(tmp)
        raise
    return os.path.getsize(path)


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
    ``held.version`` (``held`` already holds the pulled steps): the pull's patches when it starts
    at ``served_version``, else whole tensors of every module.

    Args:
        pulled: what the poll verified.
        held: the CPU copy, at the pulled version.
        info: the served model (its fused modules, tied embeddings).
        apply_path: the replica's apply path (``in-place`` or ``reload``).
        served_version: the version vLLM serves now (None: nothing yet).
        path: where to write the staging file.
    """
    # Imported here, not above: the worker (``rollout.worker_apply``) and ``rollout.config`` read
    # this module for the format only, and the subscriber brings the numba codec with it.
    from deltasync.subscriber import merge_patches

    t0 = time.perf_counter()
    version = held.version
    anchored = pulled.kind == "anchor"
    names = list(held.tensors)
    # Patches go onto what vLLM serves only when the pull starts there; any other start (a
    # stage that failed before and was not kept, a caller's mistake) reloads every tensor.
    onto_served = (
        not anchored and served_version is not None and pulled.plan.from_version == served_version
    )
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
