"""Suite-wide hooks and fixtures: tests marked ``gpu`` skip, reason printed (``-ra``), where torch
sees no CUDA GPU (where it sees one they run with the rest; ``make test-gpu`` runs only them); the
end-to-end module is collected first; one warm-start cache for the session."""

import importlib.util

import pytest

NO_GPU_REASON = "no CUDA GPU: torch.cuda.is_available() is False"


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: torch is imported only if a gpu test runs
def pytest_collection_modifyitems(config, items):
    # The end-to-end module (tests/e2e, the suite's longest: a warm start, then two local runs)
    # goes first, so that under make test's workers (pytest-xdist, one module per worker) it
    # starts at once on one worker while the other modules share the rest; its order stays.
    items.sort(key=lambda item: "tests/e2e/" not in item.nodeid)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    if importlib.util.find_spec("torch") is None:
        reason = "no CUDA GPU: torch is not installed"
    else:
        import torch

        if torch.cuda.is_available():
            return
        reason = NO_GPU_REASON
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory):
    """One warm-start cache folder for the session: the end-to-end tests that train the local
    model with the same warm-start settings build it once (``trainer.task.warm_start`` keys its
    cache by every input, so a test with other settings builds its own)."""
    return str(tmp_path_factory.mktemp("warm-start-cache"))
