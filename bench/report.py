"""Writing a benchmark's results: one JSON file per bench under bench/results/ (git-ignored).

Every bench also takes ``--smoke`` (``make bench-smoke``, run by CI): tiny sizes that run in
seconds, not minutes, through the same code, with results under bench/results/smoke/ so that
the real figures stay as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_DIR = os.path.join(REPO, "bench", "results", "smoke")
SMOKE_HELP = (
    "tiny sizes, seconds not minutes (make bench-smoke, CI): the same code path, results under "
    "bench/results/smoke/; flags given as well still apply"
)


def save(path: str, results) -> None:
    """Write ``results`` (JSON-serialisable) to ``path``, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def smoke_path(path: str) -> str:
    """Where a ``--smoke`` run writes what a full run writes to ``path``: the same file name under
    bench/results/smoke/."""
    return os.path.join(SMOKE_DIR, os.path.basename(str(path)))


def parse_with_smoke(
    p: argparse.ArgumentParser, smoke: dict, argv: list[str] | None = None
) -> argparse.Namespace:
    """Add ``--smoke`` to ``p`` and parse ``argv`` (default ``sys.argv[1:]``). With ``--smoke``
    the defaults ``smoke`` (the tiny sizes, and the output under bench/results/smoke/) replace the
    full run's, so that a flag given beside ``--smoke`` still wins; without it nothing changes."""
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**smoke)
    return p.parse_args(argv)
