"""The rollout side of a run as the trainer sees it: what ``trainer.stack.RunStack.start``
hands to ``trainer.loop.grpo.build_trainer`` and to the evaluations."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rollouts:
    """The run's rollout side as the trainer sees it (``trainer.stack.RunStack.start`` returns
    it): one URL for TRL, the publisher, and what the fleet knows of versions.

    Attributes:
        url: the fleet router's URL (TRL's ``vllm_server_base_url``).
        publisher: the run's ``DeltaPublisher``.
        served_version: ``f() -> int | None``: the oldest version the serving replicas hold.
        sample_versions: ``f(token_ids) -> versions``: the versions that answered a sample's
            turns (the router's ``EpisodeAffinity.versions_of``), for per-sample staleness.
        turn_versions: ``f(token_ids) -> [(turn end, version)]`` (``EpisodeAffinity.turn_versions``),
            for the off-policy correction.
        serving_count: ``f() -> int``: how many replicas serve now (the evaluations' sizing).
        headers: what every request to ``url`` carries: the router's run key
            (``FleetRouter.headers``), handed to TRL's rollout worker and the evaluations.
    """

    url: str | None
    publisher: Any = None
    served_version: Callable[[], int | None] = lambda: None
    sample_versions: Callable | None = None
    turn_versions: Callable | None = None
    serving_count: Callable[[], int] = lambda: 1
    headers: dict[str, str] = field(default_factory=dict, repr=False)


def wait_for_version(version_fn, version: int, timeout_s: float = 600.0) -> None:
    """Block until ``version_fn()`` (the oldest version the serving replicas hold) reaches
    ``version``: before the first rollouts, so that they are not refused by a replica that has
    not loaded the run's weights yet, and before each evaluation.

    Raises:
        TimeoutError: not reached within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = version_fn()
        if v is not None and v >= version:
            return
        time.sleep(0.25)
    raise TimeoutError(f"the replica did not apply v{version} within {timeout_s:.0f}s")
