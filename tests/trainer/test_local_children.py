"""The environment a local replica is started with (nothing is spawned: ``_spawn`` is replaced):
its OpenMP threads and waits follow the trainer's, its context fits its model (vLLM refuses one
longer than the model's positions), and a local model folder reaches it as an absolute path."""

from __future__ import annotations

import json

import pytest

from trainer.local import children
from trainer.local.children import LOCAL_MAX_MODEL_LEN, local_max_model_len
from trainer.local.threads import cpu_threads


def test_a_local_replica_waits_passively_only_when_the_trainer_does(monkeypatch):
    env = {}
    monkeypatch.setattr(children, "_spawn", lambda name, args, cwd, e, *rest: env.update(e))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    children.start_replica("file:///nowhere", "model", "/tmp")
    assert "OMP_WAIT_POLICY" not in env
    assert env["OMP_NUM_THREADS"] == str(cpu_threads()[1])
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    children.start_replica("file:///nowhere", "model", "/tmp")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_local_replica_context_fits_the_model(tmp_path):
    assert local_max_model_len("Qwen/Qwen3-0.6B") == LOCAL_MAX_MODEL_LEN  # a hub id
    for own, expected in ((2048, 2048), (8192, LOCAL_MAX_MODEL_LEN)):  # vLLM refuses more
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": own}))
        assert local_max_model_len(str(tmp_path)) == expected


def test_a_relative_model_folder_reaches_the_replica_as_an_absolute_path(monkeypatch, tmp_path):
    """The replica runs in its own folder: ``MODEL=runs/models/x`` (or the tool-template folder
    under ``runs/cache``) read from there would be taken for a hub id (seen: HFValidationError
    on ``runs/cache/tools-...`` when the hub warm start was skipped)."""
    env = {}
    monkeypatch.setattr(children, "_spawn", lambda name, args, cwd, e, *rest: env.update(e))
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text('{"max_position_embeddings": 512}')
    monkeypatch.chdir(tmp_path)
    children.start_replica("file:///nowhere", "models/m", "/tmp")
    assert env["MODEL"] == str(tmp_path / "models" / "m")
    children.start_replica("file:///nowhere", "Qwen/Qwen3-0.6B", "/tmp")  # a hub id: as is
    assert env["MODEL"] == "Qwen/Qwen3-0.6B"


def test_a_child_dies_with_a_trainer_killed_outright(tmp_path):
    """A trainer killed by SIGKILL (the OOM killer) leaves no child server behind: the child gets
    SIGTERM from the kernel (``children.dies_with_parent``)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    if children.SETPRIV is None:
        pytest.skip("setpriv (util-linux) is not installed: children outlive a killed trainer")
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from trainer.local.children import _spawn\n"
            f"c = _spawn('sleeper', ['-c', 'import time; time.sleep(120)'], {str(tmp_path)!r}, "
            f"{{}}, {str(tmp_path)!r}, 0)\n"
            "print(c.proc.pid, flush=True)\n"
            "time.sleep(120)\n",
        ],
        cwd=children.REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # the child runs while its parent does
    # the kill comes once setpriv has set the death signal and exec'd the child's program (a
    # parent killed before that, within milliseconds of the start, is a window setpriv has)
    deadline = time.monotonic() + 30
    while b"time.sleep(120)" not in open(f"/proc/{child}/cmdline", "rb").read():
        assert time.monotonic() < deadline, "the child never started its program"
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":
            return  # exited, waiting to be reaped by init
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError(f"child {child} outlived its SIGKILLed parent by 10 s")
