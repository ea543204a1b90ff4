"""The vLLM worker extension, passed as ``--worker-extension-cls rollout.extension.DeltaSyncExtension``.

vLLM mixes this class into its worker; the sync loop calls its methods through the dev-mode
``POST /collective_rpc`` route on the internal port, with string arguments only (paths of staging
files, never tensors). Method names carry a ``deltasync_`` prefix so they cannot collide with the
worker's own (vLLM refuses an extension that redefines a worker attribute). Importing this module
imports no torch or vLLM; each method imports ``rollout.apply`` inside the worker process.
"""

from __future__ import annotations

import logging

log = logging.getLogger("rollout.extension")


class DeltaSyncExtension:
    """Worker methods for delta sync. ``self`` is vLLM's worker (``model_runner``, ``device``,
    ``vllm_config``, ``reload_weights``). Each method returns a JSON-able dict and lets errors
    propagate (``/collective_rpc`` then answers 500 and the sync loop recovers)."""

    def deltasync_describe(self) -> dict:
        """Device, dtype, quantization, MoE, tied embeddings and packed modules of the model."""
        from .apply import describe

        return describe(self)

    def deltasync_apply(self, path: str, mode: str) -> dict:
        """Apply the staging file at ``path`` with ``mode`` = ``"reload"`` or ``"in-place"``.

        Raises:
            ValueError: an unknown mode; StageFileError / vLLM errors from the apply itself.
        """
        from .apply import apply_in_place, apply_reload

        if mode == "reload":
            out = apply_reload(self, path)
        elif mode == "in-place":
            out = apply_in_place(self, path)
        else:
            raise ValueError(f"expected mode 'reload' or 'in-place', found {mode!r}")
        log.info("deltasync apply %s v%s: %s", mode, out["version"], out)
        return out
