"""Each Space's image run the way its Dockerfile runs it (no Docker needed; see
dockerfile_image.py for how the image is built): the exec-form CMD runs with the interpreter
running the tests (``.venv/bin/python`` under ``make test``) in the image's working directory with
the image's environment, plus what the Space itself would set (variables, a free ``PORT``, hosts
on 127.0.0.1, ``HF_HUB_OFFLINE``). The CMD's executable must be one the base image provides:
``python`` on vLLM's image would fail on the Space, so it fails here.

The dashboard and Wordle servers must answer 200 (and their HEALTHCHECK must pass); the rollout
launcher must get through its imports to the configuration check; the slow test lets it start
the vLLM child and checks vLLM accepted the command line.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from trainer.local.ports import free_port

from .dockerfile_image import Image

START_TIMEOUT_S = 120.0  # generous: the test machine may be busy


def start(img: Image, argv: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            img.command(argv),
            cwd=img.cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen) -> None:
    """Stop the process group we started (SIGTERM, then SIGKILL)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tail(path: str, n: int = 3000) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-n:]


def wait_http_200(url: str, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"expected the server to answer {url}, found it exited with code {proc.returncode}:\n"
            + tail(log_path)
        )
        try:
            with urllib.request.urlopen(url, timeout=3) as r:
                if r.status == 200:
                    return
                last = r.status
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            last = e
        time.sleep(0.3)
    raise AssertionError(
        f"{url} did not answer 200 in {START_TIMEOUT_S}s ({last}):\n{tail(log_path)}"
    )


def run_healthcheck(img: Image, env: dict[str, str]) -> None:
    argv = shlex.split(img.df.healthcheck)
    out = subprocess.run(
        img.command(argv), cwd=img.cwd, env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, f"HEALTHCHECK failed: {out.stdout}{out.stderr}"


def test_dashboard_image_answers_200(image, tmp_path):
    img = image("dashboard")
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    port = free_port()
    env = img.env(
        BUCKET=str(bucket), PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1", HF_HUB_OFFLINE="1"
    )
    log = str(tmp_path / "dashboard.log")
    proc = start(img, img.df.cmd, env, log)
    try:
        wait_http_200(f"http://127.0.0.1:{port}/", proc, log)
        run_healthcheck(img, env)
        probe = subprocess.run(
            [sys.executable, "-c", "import deltasync; print(deltasync.__file__)"],
            cwd=img.cwd,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert probe.stdout.startswith(img.root), "expected the image's copy of deltasync"
    finally:
        stop(proc)


def test_wordle_image_answers_health(image, tmp_path):
    img = image("wordle")
    port = free_port()
    env = img.env(PORT=str(port), WORDLE_HOST="127.0.0.1", HF_HUB_OFFLINE="1")
    log = str(tmp_path / "wordle.log")
    proc = start(img, img.df.cmd, env, log)
    try:
        wait_http_200(f"http://127.0.0.1:{port}/health", proc, log)
        run_healthcheck(img, env)
    finally:
        stop(proc)


def rollout_env(img: Image, tmp_path, **extra: str) -> dict[str, str]:
    return img.env(
        PORT=str(free_port()),
        HOST="127.0.0.1",
        VLLM_PORT=str(free_port()),
        HF_HUB_OFFLINE="1",
        CONTROL_TOKEN="ctl-secret-test",
        **extra,
    )


def test_rollout_image_gets_through_its_imports_to_the_config_check(image, tmp_path):
    """Without BUCKET the launcher stops at its configuration, after importing the
    front, the sync loop and deltasync from the image's files: a missing module or file, or a
    CMD the image cannot run, fails before that line."""
    img = image("rollout")
    env = rollout_env(img, tmp_path, MODEL="Qwen/Qwen3-0.6B")
    log = str(tmp_path / "rollout.log")
    proc = start(img, img.df.cmd, env, log)
    try:
        code = proc.wait(START_TIMEOUT_S)
    finally:
        stop(proc)
    text = tail(log)
    assert code != 0, text
    assert "ConfigError: expected the run's bucket URI in BUCKET, found none" in text
    assert "ModuleNotFoundError" not in text and "No such file" not in text, text


def _children(pid: int) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(d))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rollout_image_starts_vllm_with_a_command_line_vllm_accepts(image, tmp_path):
    """With a configuration the launcher starts the vLLM child (on 127.0.0.1, with the worker
    extension importable from the image's /app, without CONTROL_TOKEN); vLLM parses that command
    line and then fails on the missing model, and the launcher exits with the child."""
    img = image("rollout")
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    env = rollout_env(
        img, tmp_path, BUCKET=f"file://{bucket}", MODEL=str(tmp_path / "no-such-model")
    )
    log = str(tmp_path / "rollout.log")
    proc = start(img, img.df.cmd, env, log)
    try:
        deadline, child = time.monotonic() + START_TIMEOUT_S, None
        while child is None and time.monotonic() < deadline and proc.poll() is None:
            for pid in _children(proc.pid):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        argv = [a.decode() for a in f.read().split(b"\0") if a]
                except OSError:  # a short-lived child ended between the listing and the read
                    continue
                if "vllm.entrypoints.openai.api_server" in argv:
                    child = pid
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        child_env = dict(
                            e.decode().partition("=")[::2] for e in f.read().split(b"\0") if e
                        )
                    child_cwd = os.readlink(f"/proc/{pid}/cwd")
                    break
            time.sleep(0.05)
        assert child is not None, "expected the launcher to start vLLM:\n" + tail(log)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert (
            argv[argv.index("--worker-extension-cls") + 1] == "rollout.extension.DeltaSyncExtension"
        )
        assert "CONTROL_TOKEN" not in child_env
        probe = subprocess.run(
            [sys.executable, "-c", "import rollout.extension as e; print(e.__file__)"],
            cwd=child_cwd,
            env=child_env,
            capture_output=True,
            text=True,
        )
        assert probe.returncode == 0 and probe.stdout.startswith(img.root), probe.stderr
        code = proc.wait(300)  # vLLM imports (~30 s), parses its arguments, finds no model
    finally:
        stop(proc)
    text = tail(log, 20000)
    assert code != 0 and "the server exited with code" in text, text[-3000:]
    for bad in ("unrecognized arguments", "ModuleNotFoundError", "invalid choice"):
        assert bad not in text, text[-3000:]
    # vLLM got past its argument parsing to the model itself
    model_lines = [ln for ln in text.splitlines() if "no-such-model" in ln and "config:" not in ln]
    assert model_lines, text[-3000:]
