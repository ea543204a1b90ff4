"""``deltasync.cpu_dtype.native_dtype``: bf16 only where it is native (CUDA; a CPU with AVX-512
BF16 or AMX whose PyTorch kernels use AVX-512), float32 elsewhere, each with the flags and the
kernel capability seen; ``DELTASYNC_CPU_DTYPE`` forces either on a CPU, and a bad value is
refused naming the choices; importing the module imports no torch. The processors are simulated
by replacing torch's probes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deltasync.cpu_dtype import ENV, CpuDtypeError, main, native_dtype


@pytest.fixture()
def cpu(monkeypatch):
    """``cpu(avx512_bf16, amx, capability)`` makes torch report that processor."""
    monkeypatch.delenv(ENV, raising=False)

    def set_cpu(avx512_bf16: bool, amx: bool, capability: str) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)

    return set_cpu


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "capability", "dtype"),
    [
        (True, False, "AVX512", "bfloat16"),  # e.g. Zen 4, Cooper Lake
        (False, True, "AVX512", "bfloat16"),  # e.g. Sapphire Rapids (AMX)
        (False, False, "AVX2", "float32"),  # AVX2 alone: bf16 emulated
        (False, False, "AVX512", "float32"),  # AVX-512 kernels, no bf16 instructions
        (True, True, "AVX2", "float32"),  # the flags, but kernels lowered to AVX2
    ],
)
def test_bf16_only_where_the_processor_has_it_and_the_kernels_use_it(
    cpu, avx512_bf16, amx, capability, dtype
):
    cpu(avx512_bf16, amx, capability)
    choice = native_dtype(cuda=False, env={})
    assert choice.dtype == dtype and choice.bf16 == (dtype == "bfloat16")
    native = "native" if choice.bf16 else "emulated"
    assert choice.reason == (
        f"bf16 {native} on this CPU: avx512_bf16 {'yes' if avx512_bf16 else 'no'}, "
        f"amx {'yes' if amx else 'no'}, kernels {capability}"
    )


def test_cuda_is_bf16_and_a_lowered_capability_is_named(cpu):
    cpu(True, False, "AVX2")
    assert native_dtype(cuda=True, env={}) == ("bfloat16", "CUDA: bf16 native")
    lowered = native_dtype(cuda=False, env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert lowered.dtype == "float32" and lowered.reason.endswith(
        "kernels AVX2 (ATEN_CPU_CAPABILITY=avx2)"
    )


def test_the_variable_forces_either_dtype_on_a_cpu_and_a_bad_one_is_refused(cpu):
    cpu(False, False, "AVX2")
    forced = native_dtype(cuda=False, env={ENV: "bfloat16"})
    assert forced.dtype == "bfloat16"
    assert forced.reason == f"{ENV}=bfloat16 (this CPU: avx512_bf16 no, amx no, kernels AVX2)"
    cpu(True, True, "AVX512")
    assert native_dtype(cuda=False, env={ENV: " Float32 "}).dtype == "float32"
    assert native_dtype(cuda=False, env={ENV: "auto"}).dtype == "bfloat16"
    with pytest.raises(CpuDtypeError, match=f"{ENV}: expected auto, bfloat16 or float32.*'fp16'"):
        native_dtype(cuda=False, env={ENV: "fp16"})


def test_the_command_prints_the_choice(cpu, capsys, monkeypatch):
    cpu(False, False, "AVX2")
    main(["--json"])
    assert json.loads(capsys.readouterr().out) == {
        "dtype": "float32",
        "reason": "bf16 emulated on this CPU: avx512_bf16 no, amx no, kernels AVX2",
    }
    monkeypatch.setenv(ENV, "half")
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2 and f"{ENV}: expected" in capsys.readouterr().err


def test_importing_it_imports_no_torch():
    code = "import sys, deltasync.cpu_dtype; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
