"""LoRA adapter runs: which base model an adapter belongs to, and the PEFT folder a replica loads.

An adapter run publishes only the adapter's tensors (PEFT's ``adapter_model.safetensors`` keys,
bf16) and records in every manifest an :class:`~deltasync.manifest.AdapterInfo`: its kind, its
PEFT config and the digest of the base model it was trained on. Both sides compute that digest
with the same rule (:func:`base_digest_of`), the trainer over the base weights it holds and the
replica over the checkpoint folder it serves, so a replica can refuse an adapter of another base
(:func:`check_base`) before loading anything.

Importing this module does not import torch (torch tensors are converted lazily).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .bf16 import digest, to_bf16_bits
from .errors import AdapterMismatchError, ModelMismatchError, WrongBaseModelError
from .manifest import AdapterInfo, Manifest, model_digest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # every key of get_peft_model_state_dict on a PeftModel
TIED_COPIES = {"lm_head.weight": "model.embed_tokens.weight"}  # tied name -> the stored one
# safetensors dtypes of the weights a base digest covers, as numpy dtypes (BF16: raw bits)
_FLOAT_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64}
_SKIPPED_DTYPES = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}


def float_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float values (numpy f16/f32/f64) to bf16 bits (``np.uint16``, same shape) with
    round-to-nearest-even, as ``torch.Tensor.to(torch.bfloat16)`` does for finite values (f64 is
    rounded to f32 first); NaN becomes 0x7FC0."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def _bf16_bits_or_none(name: str, t: Any) -> np.ndarray | None:
    """The bf16 bits of a floating tensor (torch, or numpy f16/f32/f64, or np.uint16 bits);
    None for an integer or boolean tensor (not a weight)."""
    if isinstance(t, np.ndarray):
        if t.dtype == np.uint16:
            return to_bf16_bits(t)
        if t.dtype.kind == "f":
            return float_to_bf16_bits(t)
        if t.dtype.kind in "biu":
            return None
        raise TypeError(f"{name}: cannot digest a numpy {t.dtype} tensor as bf16")
    if not t.is_floating_point():
        return None
    return to_bf16_bits(t)


def base_digest_of(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str:
    """The digest of a base model's weights that an adapter run records (16 hex digits).

    The rule (the trainer and the replica MUST apply the same): over the floating-point tensors
    under their HF checkpoint names (``model.layers.0.self_attn.q_proj.weight``), each cast to
    bf16 bits and hashed (``deltasync.bf16.digest``), combined with ``model_digest``. Integer and
    boolean tensors are left out. A tied copy (``lm_head.weight`` holding the same bits as
    ``model.embed_tokens.weight``) is left out, so a checkpoint that does not store it and a
    ``state_dict()`` that shows it give the same digest.

    Args:
        named_tensors: {name: tensor} or (name, tensor) pairs: torch tensors of any floating dtype
            and device, numpy f16/f32/f64 arrays, or np.uint16 arrays taken as bf16 bits.

    Raises:
        ModelMismatchError: no floating tensor, or a name given twice.
        TypeError: a numpy array of another kind (complex, object).
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    digests: dict[str, str] = {}
    for name, t in items:
        if name in digests:
            raise ModelMismatchError(f"tensor {name!r} given twice; names must be unique")
        bits = _bf16_bits_or_none(name, t)
        if bits is not None:
            digests[name] = digest(bits)
    for tied, stored in TIED_COPIES.items():
        if tied in digests and digests[tied] == digests.get(stored):
            del digests[tied]
    if not digests:
        raise ModelMismatchError(
            "base_digest_of got no floating-point tensor; pass the base model's weights"
        )
    return model_digest(digests)


def base_named_tensors(peft_named: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """The base weights of a PEFT model under their checkpoint names, for :func:`base_digest_of`:
    ``base_model.model.``, ``.base_layer`` and ``.original_module`` removed from each name, the
    adapter's own tensors (``lora_*``, ``modules_to_save``) left out. Pass
    ``peft_model.named_parameters()`` or ``peft_model.state_dict().items()``."""
    for name, t in peft_named:
        if ".lora_" in name or ".modules_to_save." in name:
            continue
        name = name.removeprefix(PEFT_PREFIX)
        name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
        yield name, t


def read_safetensors(path: str) -> Iterable[tuple[str, str, np.ndarray]]:
    """The tensors of one safetensors file as (name, safetensors dtype, read-only numpy view of
    the file, memory-mapped); BF16 and other dtypes numpy lacks come as their raw bits.

    Raises:
        ModelMismatchError: the file is not a valid safetensors file (truncated, bad header).
    """
    try:
        data = np.memmap(path, np.uint8, mode="r")
        (hlen,) = np.frombuffer(data[:8], "<u8")
        header = json.loads(bytes(data[8 : 8 + int(hlen)]))
        entries = [
            (name, str(t["dtype"]), [int(s) for s in t["shape"]], *map(int, t["data_offsets"]))
            for name, t in sorted(header.items())
            if name != "__metadata__"
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise ModelMismatchError(
            f"{path} is not a valid safetensors file ({e}); the checkpoint is damaged: "
            "download it again"
        ) from e
    body = data[8 + int(hlen) :]
    for name, dtype, shape, begin, end in entries:
        np_dtype = _FLOAT_DTYPES.get(dtype, np.uint8)
        want = np.dtype(np_dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= len(body) or (dtype in _FLOAT_DTYPES and end - begin != want):
            raise ModelMismatchError(
                f"{path}: tensor {name} ({dtype} {shape}) has bytes [{begin}, {end}) that do "
                f"not fit its shape or the file ({len(body)} bytes); download it again"
            )
        values = body[begin:end].view(np_dtype)
        yield name, dtype, values.reshape(shape) if dtype in _FLOAT_DTYPES else values


def base_digest_of_folder(path: str) -> str:
    """:func:`base_digest_of` the checkpoint in folder ``path``: every tensor of its
    ``*.safetensors`` files (the folder itself, not sub-folders), under the names they are
    stored with. Reads the files memory-mapped, one tensor at a time.

    Raises:
        FileNotFoundError: the folder holds no ``*.safetensors`` file.
        ModelMismatchError: a file is not valid safetensors, or names a tensor twice.
        ValueError: a tensor's dtype is neither a float (F16/BF16/F32/F64) nor an integer/bool.
    """
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors file in {path}; point MODEL at a Hugging Face checkpoint folder"
        )

    def tensors():
        for f in files:
            for name, dtype, values in read_safetensors(os.path.join(path, f)):
                if dtype in _SKIPPED_DTYPES:
                    continue
                if dtype not in _FLOAT_DTYPES:
                    raise ValueError(
                        f"{f}: tensor {name} is {dtype}; a base digest covers F16/BF16/F32/F64 "
                        "weights only: serve an unquantized checkpoint"
                    )
                yield name, values

    return base_digest_of(tensors())


def check_base(adapter: AdapterInfo, base_digest: str, served: str | None = None) -> None:
    """Refuse an adapter trained on another base model than the one served.

    Args:
        adapter: the run's ``Manifest.adapter``.
        base_digest: :func:`base_digest_of_folder` of the served model.
        served: the served model's name or folder, for the message.

    Raises:
        WrongBaseModelError: the digests differ.
    """
    if adapter.base_digest == base_digest:
        return
    what = f" ({served})" if served else ""
    raise WrongBaseModelError(
        f"the adapter was trained on base model {adapter.base_model!r} (base digest "
        f"{adapter.base_digest}), but this replica serves a model{what} with base digest "
        f"{base_digest}; start the replica with the base model the adapter was trained on "
        f"(MODEL={adapter.base_model})"
    )


def check_adapter(found: AdapterInfo | None, expected: AdapterInfo | None, where: str) -> None:
    """Refuse to go on with a run whose adapter is not the expected one (kind, base digest and
    PEFT config, see ``AdapterInfo.identity``); None on either side means a full-weight run.

    Raises:
        AdapterMismatchError: they differ (or one side is a full-weight run).
    """
    if found is None and expected is None:
        return
    if found is not None and expected is not None and found.identity() == expected.identity():
        return

    def describe(a: AdapterInfo | None) -> str:
        if a is None:
            return "a full-weight run (no adapter)"
        keys = ("r", "lora_alpha", "target_modules")
        cfg = {k: a.peft_config.get(k) for k in keys}
        return f"a {a.kind} adapter {cfg} on base {a.base_model!r} ({a.base_digest})"

    raise AdapterMismatchError(
        f"{where} is {describe(found)}; expected {describe(expected)}: publish to a new run root "
        "for another adapter or base, or start with the same adapter settings to continue"
    )


def run_adapter(manifest: Manifest, kind: str | None, where: str) -> AdapterInfo | None:
    """The adapter of the run, checked to be of the ``kind`` a reader serves (None: full weights).

    Raises:
        AdapterMismatchError: a full-weight reader on an adapter run, or the reverse.
    """
    found = manifest.adapter.kind if manifest.adapter else None
    if found != kind:
        raise AdapterMismatchError(
            f"{where} is {'a ' + found + ' adapter run' if found else 'a full-weight run'}; "
            f"this reader expects {'a ' + kind + ' adapter run' if kind else 'full weights'}: "
            f"start it with {'ADAPTER=' + found if found else 'no ADAPTER'} or point it at "
            "another run root"
        )
    return manifest.adapter


def check_adapter_names(names: Iterable[str]) -> None:
    """Refuse tensor names that are not PEFT adapter keys (``base_model.model.…lora_A.weight``),
    e.g. a full model published into an adapter run.

    Raises:
        ModelMismatchError: a name lacks the ``base_model.model.`` prefix.
    """
    bad = sorted(n for n in names if not n.startswith(PEFT_PREFIX))
    if bad:
        raise ModelMismatchError(
            f"an adapter run publishes PEFT adapter keys (base_model.model.…lora_A.weight), "
            f"found {bad[:3]}; publish get_peft_model_state_dict(model), not the whole model"
        )


def write_peft_folder(tensors: Mapping[str, Any], adapter: AdapterInfo, dst: str) -> str:
    """Write a PEFT adapter folder that vLLM (``/v1/load_lora_adapter``) and PEFT load:
    ``adapter_config.json`` (``adapter.peft_config``) and ``adapter_model.safetensors`` (bf16).

    Written into a temporary sibling folder (``{dst}.tmp-…``), flushed to disk, then renamed to
    ``dst``: a reader never sees a half-written folder, and a crash before the rename leaves no
    ``dst`` (only a ``.tmp-`` sibling, which may be deleted).

    Args:
        tensors: {PEFT key: tensor}: np.uint16 bf16 bits, numpy floats, or torch tensors.
        adapter: the run's adapter.
        dst: the folder to create; must not exist.

    Returns:
        ``dst``.

    Raises:
        FileExistsError: ``dst`` exists (remove it first, once no loaded adapter reads it).
    """
    from safetensors import TensorSpec, serialize_file

    if os.path.exists(dst):
        raise FileExistsError(
            f"{dst} exists; write each adapter version to a new folder, or remove the old one "
            "once its adapter name is unloaded"
        )
    bits = {}
    for name, t in tensors.items():
        b = _bf16_bits_or_none(name, t)
        if b is None:
            raise TypeError(f"{name}: an adapter tensor must be floating point, found {t.dtype}")
        bits[name] = np.ascontiguousarray(b)
    tmp = f"{dst.rstrip(os.sep)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(adapter.peft_config, f, indent=2, sort_keys=True)
            _sync(f)
        specs = {
            n: TensorSpec(
                dtype="bfloat16", shape=list(b.shape), data_ptr=b.ctypes.data, data_len=b.nbytes
            )
            for n, b in bits.items()
        }
        weights = os.path.join(tmp, ADAPTER_WEIGHTS)
        serialize_file(specs, weights, metadata={"format": "pt"})
        with open(weights, "rb+") as f:
            _sync(f)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())
