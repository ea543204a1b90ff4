"""The rollout side of a run as the trainer sees it: what ``trainer.stack.RunStack.start``
hands to ``trainer.loop.grpo.build_trainer`` and to the evaluations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
    """

    url: str | None
    publisher: Any = None
    served_version: Callable[[], int | None] = lambda: None
    sample_versions: Callable | None = None
    turn_versions: Callable | None = None
