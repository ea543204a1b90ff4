"""Workarounds for TRL 1.16.0's AsyncGRPOTrainer on machines without CUDA, all in one place.

TRL 1.16.0 assumes a CUDA trainer in three places (checked by reading its source and running it on
CPU):

1. ``AsyncGRPOTrainer.__init__`` calls ``get_peak_flops_per_device``, which calls
   ``torch.cuda.get_device_name()`` (AssertionError without CUDA). We replace it with one that
   returns None (MFU metrics off) when CUDA is unavailable.
2. The trainer forces ``attn_implementation="tree_fa3"``, whose kernel ``_flash_attn()`` fetches a
   CUDA FlashAttention-3 build from the Hub. We give ``packing._flash_attn`` a CPU stand-in with the
   same ``flash_attn_varlen_func`` signature, computed with ``torch.nn.functional.
   scaled_dot_product_attention`` one packed segment at a time (exact; fine for small models).

3. ``add_fused_lm_head`` (``trl.trainer.utils``) scores only the trained positions where Triton
   runs (CUDA, XPU) and every position elsewhere (to keep tile shapes fixed for compiled backends
   such as Neuron). On an eager CPU, scoring every position through the 5k-row LM head is most of
   a GRPO step: 89% of a Wordle row's positions are prompt and tool text (``batch/
   masked_token_frac`` 0.89). We make ``trl.trainer.utils._use_triton`` answer True for CPU
   tensors, so the fused head takes its "compact" branch (only the positions whose label is not
   -100, scattered back as zeros); the kernel module keeps its own check, so the tiles still run
   as torch ops. The log-probabilities of trained positions are the same either way.

A fourth, the rollout child's ``add_response_schema``, accepts only known chat templates: the local
model carries TRL's own Qwen3 template (``trainer.task.wordle.model``), so nothing is patched for
it.

A fifth is not CPU-specific: the rollout child buffers up to 16 finished GRPO groups waiting to be
scored (``score_queue_maxsize``, not exposed by ``AsyncGRPOConfig``) on top of ``queue_maxsize``;
generation runs that far ahead, the samples come out 4-5 versions stale, and on a 2-core machine
vLLM's generation takes the CPU the training step needs. :func:`bound_score_queue` sets it.

Two more serve adapter runs (``ADAPTER=lora``, ``trainer.loop.adapter``), where our weight
transfer is injected, so TRL takes its merged sync path: :func:`keep_adapter_unmerged` stops it
folding the adapter into the base weights around each sync (we publish the adapter alone, and a
merge then unmerge in float arithmetic leaves the base weights changed by rounding: 62,450 of
2.67 M fp32 elements of the local model after one round trip), and :func:`set_request_model`
makes the rollout worker request the stable adapter name instead of the base model's path.

One more lets the rollout worker authenticate to the run's fleet router (which requires the run's
key, ``trainer.fleet.router``): TRL's rollout child opens one ``aiohttp.ClientSession`` with no
headers and posts ``/v1/completions`` through it, and AsyncGRPOConfig has no headers setting.
:func:`send_request_headers` swaps the worker's loop class (``AsyncRolloutWorker._loop_cls``, the
hook TRL's own ``openenv_harness`` uses) for :class:`RequestHeadersLoop`, which puts the headers
on that session as the child creates it (aiohttp's public ``ClientSession.headers``, sent with
every request), and passes them through ``_loop_kwargs`` (pickled into the child, never in its
environment or a log). Nothing of TRL's request code is copied.

One more serves turn-level credit (``--turn-credit``, ``trainer.loop.advantages.TurnCredit``):
TRL's packer (``packing.TreeRow.pack``) gives every trained token of a sample the sample's one
``advantage``; :func:`per_token_advantages` lets a sample carry a ``(T,)`` array instead, read at
each trained token's position.

``apply()`` checks the TRL version and that each patched attribute exists, and raises
``TRLCompatError`` if TRL changed under us: revisit these patches when upgrading TRL.
"""

from __future__ import annotations

import logging
import sys

import torch

log = logging.getLogger("trainer.loop.trl_compat")
TRL_VERSION = "1.16.0"


class TRLCompatError(RuntimeError):
    """The installed TRL differs from the one these workarounds were written for."""


class _CpuFlashAttn:
    """CPU stand-in for the flash-attn-3 kernel object used by TRL's tree attention."""

    @staticmethod
    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=None,
        causal=True,
        window_size=(-1, -1),
        **_unused,
    ):
        """Attention of each packed segment over its own K/V path, one SDPA call per segment.

        Args:
            q: (total_q, H, D) queries of all segments laid end to end.
            k, v: (total_k, Hkv, D) keys and values of every segment's root-to-segment path, end
                to end; H must be a multiple of Hkv (grouped-query attention).
            cu_seqlens_q, cu_seqlens_k: (S + 1,) int32 cumulative segment and path lengths.
            max_seqlen_q, max_seqlen_k: unused (flash-attn signature).
            softmax_scale: multiplier of q.k (None: 1/sqrt(D)).
            causal: causal masks align bottom-right (the flash-attn convention when a segment
                is shorter than its path: its queries are the path's last ones).
            window_size: only (-1, -1), no sliding window.

        Returns:
            (total_q, H, D) in q's dtype.

        Raises:
            TRLCompatError: a sliding window was asked for.

        The segments are cut with ``split`` and joined with ``cat`` (one autograd node each);
        writing each result into a slice of a preallocated output instead made the backward
        allocate and fill a zero tensor the size of the whole row per segment and layer: 4.67 s
        of backward for a 24k-token, 129-segment row of the local model's shape on 2 threads,
        1.90 s this way, with bit-identical log-probabilities and gradients
        (``python bench/bench_step.py``; docs/BENCHMARKS.md section 6 (the main job)).
        """
        if window_size not in ((-1, -1), [-1, -1]):
            raise TRLCompatError(f"sliding-window attention is not supported on CPU: {window_size}")
        lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        gqa = q.shape[1] != k.shape[1]
        outs = []
        for qi, ki, vi in zip(q.split(lens_q), k.split(lens_k), v.split(lens_k), strict=True):
            lq, lk = qi.shape[0], ki.shape[0]
            if lq == 0:
                outs.append(qi)
                continue
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal and lq > 1 else None
            o = torch.nn.functional.scaled_dot_product_attention(
                qi.transpose(0, 1),
                ki.transpose(0, 1),
                vi.transpose(0, 1),
                attn_mask=mask,
                scale=softmax_scale,
                enable_gqa=gqa,
            )
            outs.append(o.transpose(0, 1).to(q.dtype))
        return torch.cat(outs)


def apply() -> list[str]:
    """Install the workarounds needed on this machine; returns what was patched.

    Raises:
        TRLCompatError: TRL is not version 1.16.0 or lacks a patched attribute.
    """
    import trl
    from trl.experimental.async_grpo import async_grpo_trainer, packing
    from trl.trainer import utils as trl_utils

    if trl.__version__ != TRL_VERSION:
        raise TRLCompatError(
            f"trainer/loop/trl_compat.py was written for trl=={TRL_VERSION}, found {trl.__version__}; "
            "install trl==1.16.0 or re-check each workaround against the new TRL source"
        )
    patched = []
    if torch.cuda.is_available():
        return patched
    targets = (
        (async_grpo_trainer, "get_peak_flops_per_device"),
        (packing, "_flash_attn"),
        (trl_utils, "_use_triton"),
    )
    for mod, attr in targets:
        if not hasattr(mod, attr):
            raise TRLCompatError(
                f"{mod.__name__}.{attr} is gone: TRL changed, re-check trl_compat.py"
            )
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    packing._flash_attn = lambda: _CpuFlashAttn
    use_triton = trl_utils._use_triton
    if not getattr(use_triton, "_deltasync_cpu_compact", False):  # apply() is idempotent

        def compact_on_cpu(device, _original=use_triton):
            return device.type == "cpu" or _original(device)

        compact_on_cpu._deltasync_cpu_compact = True
        trl_utils._use_triton = compact_on_cpu
    patched += [
        "get_peak_flops_per_device -> None (no CUDA)",
        "tree_fa3 kernel -> CPU SDPA",
        "fused LM head scores only trained positions on CPU",
    ]
    log.info("TRL %s CPU workarounds: %s", TRL_VERSION, "; ".join(patched))
    return patched


def per_token_advantages() -> bool:
    """Let a rollout sample's ``advantage`` be a ``(T,)`` array over its tokens (float32): TRL's
    ``TreeRow.pack`` takes the advantage of trained token ``p`` from ``advantage[p]`` instead of
    one float per sample. A sample with a float is packed as before. Idempotent; returns True
    when it installed the wrapper now.

    The wrapper packs with zeros in place of the arrays, then lays the advantages out in the
    order ``pack`` emits its loss terms (sample by sample, positions ``1..T-1`` whose
    ``completion_mask`` is set) and checks their count against ``token_index``.

    Raises:
        TRLCompatError: TRL is not 1.16.0, or ``TreeRow.pack`` is gone.
    """
    import numpy as np
    import trl
    from trl.experimental.async_grpo import packing

    if trl.__version__ != TRL_VERSION or not hasattr(packing.TreeRow, "pack"):
        raise TRLCompatError(
            f"per-token advantages were written for trl=={TRL_VERSION}'s TreeRow.pack, found trl "
            f"{trl.__version__}; re-check trl_compat.per_token_advantages"
        )
    original = packing.TreeRow.pack
    if getattr(original, "_deltasync_per_token", False):
        return False

    def pack(self):
        advantages = [s["advantage"] for s in self.samples]
        if all(isinstance(a, (int, float)) for a in advantages):
            return original(self)
        for s in self.samples:
            s["advantage"] = 0.0
        try:
            out = original(self)
        finally:
            for s, a in zip(self.samples, advantages, strict=True):
                s["advantage"] = a
        per_token = []
        for s, a in zip(self.samples, advantages, strict=True):
            trained = np.asarray(s["completion_mask"])[1:].astype(bool)
            full = np.broadcast_to(np.asarray(a, dtype=np.float32), (len(trained) + 1,))
            per_token.append(full[1:][trained])
        flat = np.concatenate(per_token) if per_token else np.zeros(0, dtype=np.float32)
        if flat.shape[0] != out["token_index"].shape[0]:
            raise TRLCompatError(
                f"per-token advantages: {flat.shape[0]} trained tokens in the samples, "
                f"{out['token_index'].shape[0]} loss terms packed: TRL's packer changed"
            )
        out["advantages"] = torch.from_numpy(flat.astype(np.float32))
        return out

    pack._deltasync_per_token = True
    packing.TreeRow.pack = pack
    log.info("TRL %s: per-token advantages in TreeRow.pack (turn credit)", TRL_VERSION)
    return True


def bound_score_queue(trainer, groups: int) -> bool:
    """Let at most ``groups`` finished GRPO groups wait for scoring in TRL's rollout child (TRL's
    default is 16), through the worker's constructor arguments (``_loop_kwargs``), before
    ``train()`` spawns the child. Returns False on other ranks (no worker).

    Raises:
        TRLCompatError: TRL's worker no longer takes ``score_queue_maxsize`` this way.
    """
    import inspect

    from trl.experimental.async_grpo import async_rollout_worker

    worker = getattr(trainer, "rollout_worker", None)
    if worker is None:
        return False
    kwargs = getattr(worker, "_loop_kwargs", None)
    params = inspect.signature(async_rollout_worker._AsyncRolloutLoop.__init__).parameters
    if not isinstance(kwargs, dict) or "score_queue_maxsize" not in params:
        raise TRLCompatError(
            "TRL's rollout worker no longer takes score_queue_maxsize through _loop_kwargs: "
            "TRL changed, re-check trl_compat.bound_score_queue"
        )
    kwargs["score_queue_maxsize"] = groups
    return True


def wrap_rollout_worker(trainer, wrap):
    """Replace the rollout worker TRL built (rank 0) with ``wrap(worker)``, and point TRL's
    rollout queue at the wrapper's ``rollout_buffer``. Done after construction and before
    ``train()``: TRL builds its own ``AsyncRolloutWorker`` from many arguments, and re-building it
    ourselves would copy them. Returns the wrapper (None on other ranks).

    Raises:
        TRLCompatError: the trainer lacks ``rollout_worker`` / ``rollout_queue`` (TRL changed).
    """
    for attr in ("rollout_worker", "rollout_queue"):
        if not hasattr(trainer, attr):
            raise TRLCompatError(
                f"AsyncGRPOTrainer.{attr} is gone: TRL changed, re-check trl_compat"
            )
    if trainer.rollout_worker is None:
        return None
    wrapper = wrap(trainer.rollout_worker)
    trainer.rollout_worker = wrapper
    trainer.rollout_queue = wrapper.rollout_buffer
    return wrapper


def keep_adapter_unmerged(model) -> None:
    """Make ``model.merge_adapter()`` and ``model.unmerge_adapter()`` do nothing on this PEFT
    model (instance attributes; other models are untouched). TRL's merged weight sync calls them
    around ``send_weights``; an adapter run publishes the adapter alone, and the round trip would
    change the frozen base weights by rounding, so the trainer would drift from the base the
    replicas serve.

    Raises:
        TRLCompatError: ``model`` is not a PEFT model, or TRL's sync no longer merges this way.
    """
    import inspect

    from peft import PeftModel
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    if not isinstance(model, PeftModel):
        raise TRLCompatError(f"keep_adapter_unmerged needs a PeftModel, found {type(model)}")
    source = inspect.getsource(AsyncGRPOTrainer._sync_weight_merged)
    if "model.merge_adapter()" not in source or "model.unmerge_adapter()" not in source:
        raise TRLCompatError(
            "AsyncGRPOTrainer._sync_weight_merged no longer calls merge_adapter/unmerge_adapter: "
            "TRL changed, re-check trl_compat.keep_adapter_unmerged"
        )

    def unmerged(*_args, **_kwargs) -> None:
        """Left unmerged: the adapter is published on its own (trl_compat)."""

    model.merge_adapter = unmerged
    model.unmerge_adapter = unmerged


def set_request_model(trainer, name: str) -> bool:
    """Make TRL's rollout worker send ``"model": name`` in every request (TRL sends the model's
    ``_name_or_path``, or its own versioned LoRA names when it syncs adapters itself), through
    the worker's constructor arguments (``_loop_kwargs``), before ``train()`` spawns the child.
    Returns False on other ranks (no worker).

    Raises:
        TRLCompatError: TRL's rollout loop no longer takes ``model_name``/``lora_name`` this way.
    """
    import inspect

    from trl.experimental.async_grpo import async_rollout_worker

    worker = getattr(trainer, "rollout_worker", None)
    if worker is None:
        return False
    kwargs = getattr(worker, "_loop_kwargs", None)
    params = inspect.signature(async_rollout_worker._AsyncRolloutLoop.__init__).parameters
    if not isinstance(kwargs, dict) or not {"model_name", "lora_name"} <= set(params):
        raise TRLCompatError(
            "TRL's rollout worker no longer takes model_name/lora_name through _loop_kwargs: "
            "TRL changed, re-check trl_compat.set_request_model"
        )
    kwargs["model_name"] = name
    kwargs["lora_name"] = None  # no "-v{N}" suffix: the replica maps the name to its newest
    return True


def _request_headers_loop():
    """:class:`RequestHeadersLoop`, made on first use (importing TRL's rollout worker is slow)
    and kept in this module's globals, so the spawned child finds it by name when it unpickles
    the worker's ``_loop_cls``."""
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    class RequestHeadersLoop(_AsyncRolloutLoop):
        """TRL's rollout loop whose HTTP session sends ``request_headers`` with every request
        (the run's key of the fleet router)."""

        def __init__(self, *args, request_headers: dict[str, str] | None = None, **kwargs):
            self._request_headers = dict(request_headers or {})
            super().__init__(*args, **kwargs)

        @property
        def session(self):
            return self.__dict__.get("_deltasync_session")

        @session.setter
        def session(self, value) -> None:
            if value is not None:  # TRL's ``_run_loops`` sets its session here
                value.headers.update(self._request_headers)
            self.__dict__["_deltasync_session"] = value

    RequestHeadersLoop.__module__ = __name__
    RequestHeadersLoop.__qualname__ = "RequestHeadersLoop"
    return RequestHeadersLoop


def __getattr__(name: str):
    if name == "RequestHeadersLoop":
        cls = globals()["RequestHeadersLoop"] = _request_headers_loop()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def send_request_headers(trainer, headers: dict[str, str]) -> bool:
    """Make TRL's rollout worker send ``headers`` (the fleet router's run key) with every
    request, before ``train()`` spawns its child: its loop class becomes
    :class:`RequestHeadersLoop`, the headers go through ``_loop_kwargs``. Returns False on other
    ranks (no worker) or with no headers.

    Raises:
        TRLCompatError: TRL's worker no longer takes a loop class and its arguments this way, or
            its loop no longer keeps its HTTP session in ``session``.
    """
    import inspect

    from trl.experimental.async_grpo import async_rollout_worker

    worker = getattr(trainer, "rollout_worker", None)
    if worker is None or not headers:
        return False
    base = async_rollout_worker._AsyncRolloutLoop
    kwargs = getattr(worker, "_loop_kwargs", None)
    source = inspect.getsource(base._run_loops)
    if (
        not isinstance(kwargs, dict)
        or getattr(worker, "_loop_cls", None) is not base
        or "self.session = session" not in source
    ):
        raise TRLCompatError(
            "TRL's rollout worker no longer takes _loop_cls/_loop_kwargs with the plain "
            "_AsyncRolloutLoop, or that loop no longer sets self.session: TRL changed, re-check "
            "trl_compat.send_request_headers"
        )
    worker._loop_cls = sys.modules[__name__].RequestHeadersLoop  # module __getattr__
    kwargs["request_headers"] = dict(headers)
    return True
