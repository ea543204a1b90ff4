"""Polling a rollout replica's ``GET /health`` for the weights version it serves
(``held_version``), and waiting until it serves a given one (``wait_version``)."""

from __future__ import annotations

import time

from trainer.local.children import ChildFailedError, health_client


def held_version(replica_url: str, headers: dict | None = None) -> int | None:
    """The version a replica serves, from its ``GET /health`` (None before its first sync);
    ``headers``: e.g. the ``Authorization`` of a private Space."""
    return health_client().get(f"{replica_url}/health", headers=headers).json().get("held_version")


def wait_version(replica_url: str, version: int, timeout_s: float) -> None:
    """Block until the replica serves ``version`` or newer.

    Raises:
        ChildFailedError: not reached within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = held_version(replica_url)
        if v is not None and v >= version:
            return
        time.sleep(0.5)
    raise ChildFailedError(f"replica {replica_url} did not reach v{version} in {timeout_s:.0f}s")
