"""``free_port``: the port a local child is told to bind stays free while the machine opens
other connections and other servers pick ports with ``bind(0)`` (CI once saw a replica's front
exit with "address already in use" 20 s after its port was chosen); the local replica's context
fits its model (vLLM refuses one longer than the model's positions)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from trainer.local import processes
from trainer.local.processes import _ephemeral_low, free_port


def test_ports_are_distinct_and_below_the_ephemeral_range():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < low for p in ports)


def test_a_chosen_port_can_still_be_bound_after_many_bind_zero_sockets():
    port = free_port()
    others = []
    try:
        for _ in range(300):  # what vLLM's internal ports and outgoing connections draw from
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            others.append(s)
        assert port not in {s.getsockname()[1] for s in others}
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()
    finally:
        for s in others:
            s.close()


def _in_fresh_python(code: str, **env: str) -> list[str]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "LOCAL_WORLD_SIZE")
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


PROBE = "from trainer.local.processes import cpu_threads; print(*cpu_threads())"


def test_a_second_run_on_the_machine_gets_another_dashboard_port(caplog):
    """Found running two ``make train`` at once: the second stopped on gradio's "Cannot find
    empty port" because the first run's dashboard held 7861."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        with caplog.at_level("WARNING", logger="trainer.local.processes"):
            other = processes.port_or_free(taken)
        assert other != taken and f"port {taken} is taken" in caplog.text
        with socket.socket() as s:  # the port it hands out can be bound
            s.bind(("127.0.0.1", other))
    assert processes.port_or_free(taken) == taken  # free again: the preferred port


def test_by_default_the_trainer_and_the_replica_split_the_cores():
    n = len(os.sched_getaffinity(0))
    assert _in_fresh_python(PROBE) == [str(max(1, n - n // 2)), str(max(1, n // 2))]


def test_with_passive_waits_the_trainer_takes_every_core():
    n = len(os.sched_getaffinity(0))
    assert _in_fresh_python(PROBE, OMP_WAIT_POLICY="PASSIVE") == [str(n), str(max(1, n // 2))]
    # two trainer processes on this machine (torchrun) share the cores
    two = _in_fresh_python(PROBE, OMP_WAIT_POLICY="passive", LOCAL_WORLD_SIZE="2")
    assert two[0] == str(max(1, n // 2))


def test_a_local_replica_waits_passively_only_when_the_trainer_does(monkeypatch):
    env = {}
    monkeypatch.setattr(processes, "_spawn", lambda name, args, cwd, e, *rest: env.update(e))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    processes.start_replica("file:///nowhere", "model", "/tmp")
    assert "OMP_WAIT_POLICY" not in env
    assert env["OMP_NUM_THREADS"] == str(processes.cpu_threads()[1])
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    processes.start_replica("file:///nowhere", "model", "/tmp")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_local_replica_context_fits_the_model(tmp_path):
    import json

    from trainer.local.processes import LOCAL_MAX_MODEL_LEN, local_max_model_len

    assert local_max_model_len("Qwen/Qwen3-0.6B") == LOCAL_MAX_MODEL_LEN  # a hub id
    for own, expected in ((2048, 2048), (8192, LOCAL_MAX_MODEL_LEN)):  # vLLM refuses more
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": own}))
        assert local_max_model_len(str(tmp_path)) == expected


def test_a_relative_model_folder_reaches_the_replica_as_an_absolute_path(monkeypatch, tmp_path):
    """The replica runs in its own folder: ``MODEL=runs/models/x`` (or the tool-template folder
    under ``runs/cache``) read from there would be taken for a hub id (seen: HFValidationError
    on ``runs/cache/tools-...`` when the hub warm start was skipped)."""
    env = {}
    monkeypatch.setattr(processes, "_spawn", lambda name, args, cwd, e, *rest: env.update(e))
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text('{"max_position_embeddings": 512}')
    monkeypatch.chdir(tmp_path)
    processes.start_replica("file:///nowhere", "models/m", "/tmp")
    assert env["MODEL"] == str(tmp_path / "models" / "m")
    processes.start_replica("file:///nowhere", "Qwen/Qwen3-0.6B", "/tmp")  # a hub id: as is
    assert env["MODEL"] == "Qwen/Qwen3-0.6B"


def test_a_burst_of_hub_retries_is_one_terminal_line():
    """huggingface_hub's http_backoff warns twice per retry (and its own handler printed each
    once more): the terminal gets the first error of the burst, the file every line."""
    import io
    import logging

    from trainer.local import processes

    out = io.StringIO()
    terminal = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(terminal)
    processes._hub_retry_shown[0] = float("-inf")
    try:
        processes.quiet_libraries()
        hub_log = logging.getLogger("huggingface_hub.utils._http")
        for i in range(5):
            hub_log.warning("HTTP Error 503 thrown while requesting HEAD http://hub/x")
            hub_log.warning("Retrying in %ds [Retry %d/5].", 2**i, i + 1)
    finally:
        root.removeHandler(terminal)
    assert out.getvalue().splitlines() == [
        "HTTP Error 503 thrown while requesting HEAD http://hub/x"
    ]
    assert logging.getLogger("huggingface_hub").handlers == []
