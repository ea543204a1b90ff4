"""Suite-wide hooks and fixtures: tests marked ``gpu`` skip, reason printed (``-ra``), where torch
sees no CUDA GPU (where it sees one they run with the rest; ``make test-gpu`` runs only them); the
end-to-end module is collected first; one warm-start cache for the session; the real model of
``make model``, converted once."""

import importlib.util

import pytest

NO_GPU_REASON = "no CUDA GPU: torch.cuda.is_available() is False"
# make test's order of modules (pytest-xdist hands a free worker the next module): the longest,
# the short e2e run (it builds the shared warm start first), at once on one worker; the other
# worker takes the core, dashboard and deploy modules (about the warm start's time), then the
# NPROC run (which reuses that warm start) beside the e2e run, then the rest, whose small modules
# fill the end on both workers (run last, the NPROC run's ~100 s left one worker idle).
_FIRST = {"tests/e2e/test_e2e_short.py": 0, "tests/e2e/test_train_nproc.py": 2}
_BEFORE_NPROC = ("tests/core/", "tests/dashboard/", "tests/deploy/")


def _order(nodeid: str) -> int:
    path = nodeid.split("::")[0]
    if path in _FIRST:
        return _FIRST[path]
    return 1 if path.startswith(_BEFORE_NPROC) else 3


# The warm start the end-to-end tests train from: enough for the tiny model to play well-formed
# games (3 epochs; 1 epoch was not), far less than make train's default.
E2E_WARM_START = {"warm_start_games": 300, "warm_start_epochs": 3}


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: torch is imported only if a gpu test runs
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _order(item.nodeid))  # stable: collection order within a rank
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
def e2e_warm_start(tmp_path_factory) -> dict:
    """The trainer flags of the end-to-end tests' warm start (``E2E_WARM_START`` and
    ``cache_dir``), built once for the whole run in a cache folder shared by make test's workers;
    a file lock makes the second worker wait for the first one's build instead of building it
    again (``trainer.task.wordle.warm_start`` keys its cache by every input, so a run with these
    fields finds it there)."""
    from filelock import FileLock

    from trainer.config import TrainConfig
    from trainer.starting_point import initial_model

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if base.name.startswith("popen-gw") else base  # pytest-xdist workers
    cache = shared / "warm-start-cache"
    cache.mkdir(exist_ok=True)
    with FileLock(str(shared / "warm-start-cache.lock")):
        cfg = TrainConfig.from_flags(cache_dir=str(cache), **E2E_WARM_START)
        initial_model(cfg.run, cfg.task(), cfg.local_model)
    return {**E2E_WARM_START, "cache_dir": str(cache)}


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """The real pretrained chat model of ``make model`` (SmolLM2-135M-Instruct from a pinned
    PyPI package, ``tools.real_model``), converted once into ``runs/models`` and shared by every
    test and worker (a file lock makes a second worker wait for the first one's conversion)."""
    import os

    from filelock import FileLock

    from tools.real_model import real_model

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs")
    os.makedirs(os.path.join(root, "models"), exist_ok=True)
    with FileLock(os.path.join(root, "models", ".convert.lock")):
        return real_model(os.path.join(root, "models"))
