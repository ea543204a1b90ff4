"""Loopback ports for the local children: a free one that stays free until the child binds it
(``free_port``), or a preferred one when nothing holds it (``port_or_free``)."""

from __future__ import annotations

import logging
import random
import socket

log = logging.getLogger(__name__)

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
PORTS_BELOW_EPHEMERAL = 12000  # how many ports under the ephemeral range free_port draws from
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, drawn at random from the ports just below
    the kernel's ephemeral range, and never the same one twice in this process.

    A child binds the port it is given seconds later (a replica's front binds it only once vLLM
    has loaded, 20-40 s on 2 cores). ``bind(("127.0.0.1", 0))`` would pick the port from the
    ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the
    range every outgoing connection and every other ``bind(0)`` draws from, vLLM's own internal
    ports included; in between, one of them can take it, and the child exits with "address
    already in use" (uvicorn's exit code 3: seen on CI while another test ran beside it). Below
    the range only servers bind, and only to ports they were told.

    Falls back to ``bind(0)`` where the range starts too low to leave room below it.

    Raises:
        OSError: no port in the range could be bound (every one held).
    """
    low = _ephemeral_low()
    if low - PORTS_BELOW_EPHEMERAL < 1024:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    candidates = range(low - PORTS_BELOW_EPHEMERAL, low)
    for port in rng.sample(candidates, 200):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free TCP port in {candidates.start}-{candidates.stop - 1} on 127.0.0.1")


def port_or_free(preferred: int) -> int:
    """``preferred`` when nothing on 127.0.0.1 holds it now, else :func:`free_port` (logged): a
    second ``make train`` on the same machine found the first run's dashboard on 7861 and stopped
    with gradio's "Cannot find empty port".

    Raises:
        OSError: ``preferred`` is held and no free port was found either.
    """
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            pass
    port = free_port()
    log.warning("port %d is taken (another run's dashboard?); using %d", preferred, port)
    return port


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where the file is missing)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
