"""A clean stop on SIGTERM at any phase (warm start, evaluation, training): within seconds, with
the run's children, without tracebacks.

The first SIGTERM (or SIGINT) logs one line and unwinds the main thread as Ctrl-C does
(``SystemExit(128 + signum)``), so that ``run()`` stops its child servers in order and the
publisher flushes. Unwinding can wait on work that does not look at signals: a thread pool's
``with`` block waits for its games, a forward runs to its end. So a watchdog started by the same
signal ends the process ``grace_s`` seconds later in any case: the process group of every child
this process started is killed (``trainer.local.children.kill_started_children``), and every
process a library spawned through ``multiprocessing`` (TRL's rollout worker), and the process
exits with the same code, without running the interpreter's shutdown (which would print the
threads' tracebacks). A second signal does the same at once; a stop that unwinds before any child
was stopped in order kills the children left at exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("trainer.shutdown")

DEFAULT_GRACE_S = 10.0


def install(grace_s: float = DEFAULT_GRACE_S) -> threading.Event:
    """Handle SIGTERM and SIGINT in this (main) thread as described above.

    Args:
        grace_s: seconds the orderly stop may take before the watchdog ends the process.

    Returns:
        the event set when a stop was asked for.
    """
    stopping = threading.Event()

    def hard_exit(code: int) -> None:
        _kill_children()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def watchdog(code: int) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
        log.warning("stop: still unwinding after %.0fs; ending now", grace_s)
        hard_exit(code)

    def handle(signum, frame) -> None:
        code = 128 + signum
        if stopping.is_set():
            hard_exit(code)
        stopping.set()
        # a stop that unwinds at once (before any child was stopped in order) ends none alive
        atexit.register(_kill_children)
        log.warning(
            "%s: stopping (children first; at most %.0fs)", signal.Signals(signum).name, grace_s
        )
        threading.Thread(target=watchdog, args=(code,), name="stop-watchdog", daemon=True).start()
        raise SystemExit(code)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stopping


def _kill_children() -> None:
    """SIGKILL the process groups this process started and the processes libraries spawned
    through ``multiprocessing`` (TRL's rollout worker, the warm start's process): those share
    this process's group and would outlive it, holding its output pipes."""
    import multiprocessing

    from trainer.local.children import kill_started_children

    kill_started_children()
    for child in multiprocessing.active_children():
        try:
            os.kill(child.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):  # gone, or never started
            pass
