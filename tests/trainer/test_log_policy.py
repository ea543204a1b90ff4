"""``quiet_libraries``: a burst of huggingface_hub's retry warnings is one terminal line."""

from __future__ import annotations

import io
import logging

from trainer.local import log_policy


def test_a_burst_of_hub_retries_is_one_terminal_line():
    """huggingface_hub's http_backoff warns twice per retry (and its own handler printed each
    once more): the terminal gets the first error of the burst, the file every line."""
    out = io.StringIO()
    terminal = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(terminal)
    log_policy._hub_retry_shown[0] = float("-inf")
    try:
        log_policy.quiet_libraries()
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
