"""Writing a benchmark's results: one JSON file per bench under bench/results/ (git-ignored)."""

from __future__ import annotations

import json
import os


def save(path: str, results) -> None:
    """Write ``results`` (JSON-serialisable) to ``path``, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
