"""``free_port``: the port a local child is told to bind stays free while the machine opens
other connections and other servers pick ports with ``bind(0)`` (CI once saw a replica's front
exit with "address already in use" 20 s after its port was chosen); ``port_or_free``: a second
run on the machine gets another dashboard port."""

from __future__ import annotations

import socket

from trainer.local.ports import _ephemeral_low, free_port, port_or_free


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


def test_a_second_run_on_the_machine_gets_another_dashboard_port(caplog):
    """Found running two ``make train`` at once: the second stopped on gradio's "Cannot find
    empty port" because the first run's dashboard held 7861."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        with caplog.at_level("WARNING", logger="trainer.local.ports"):
            other = port_or_free(taken)
        assert other != taken and f"port {taken} is taken" in caplog.text
        with socket.socket() as s:  # the port it hands out can be bound
            s.bind(("127.0.0.1", other))
    assert port_or_free(taken) == taken  # free again: the preferred port
