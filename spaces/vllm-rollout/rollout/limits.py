"""Per-client caps of the front's generation routes (``/v1/completions``,
``/v1/chat/completions``), so that a public replica is not an open GPU.

- **Concurrency**: at most ``max_concurrent`` generation requests in flight per client (429
  with ``Retry-After`` beyond). The client is the bearer key when the replica has a
  ``ROLLOUT_API_KEY`` (every holder of the key shares one budget), else the client's address
  (``client_address``).
- **Size**: ``n`` (and ``best_of``) at most ``max_n``; ``max_tokens`` and
  ``max_completion_tokens`` at most ``max_tokens`` (400 beyond). The body is forwarded
  unchanged: a request that gives neither token limit is bounded by the context
  (``MAX_MODEL_LEN``, vLLM's default).

Every refusal is JSON ``{"error": ..., "cap": NAME, "limit": N, "variable": VAR}``: the error says
which cap, its value and the variable that raises it.

The defaults keep the trainer's own traffic working: TRL's rollout worker and the held-out games
send ``n=1`` and ``max_tokens`` = ``--max-completion-length`` (32 by default), the trainer keeps
``per_device_train_batch_size`` (64) episodes in flight and the held-out games 64 more.

Which address is the client's: Spaces reach the app through the Hub's proxy, so the TCP peer is
the proxy for everyone. With ``forwarded_hops`` = N > 0 the client is the N-th address from the
right of ``X-Forwarded-For``: the right-most entries are the ones the trusted proxies appended,
the left-most ones a client can forge. 1 (the default) trusts one proxy, the Hub's; 0 ignores the
header and uses the peer address (a replica reached directly). Without the header, or with
fewer entries than N, the peer address is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_CONCURRENT = 256
DEFAULT_MAX_N = 16
DEFAULT_MAX_TOKENS = 1024
DEFAULT_FORWARDED_HOPS = 1
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class GenerationLimits:
    """The caps (see the module's doc); each > 0 (``forwarded_hops`` >= 0).

    Attributes:
        max_concurrent: generation requests in flight per client (``MAX_CONCURRENT_REQUESTS``).
        max_n: largest ``n`` / ``best_of`` (``MAX_N``).
        max_tokens: largest ``max_tokens`` / ``max_completion_tokens`` (``MAX_TOKENS``).
        forwarded_hops: trusted proxies in front of the app (``FORWARDED_HOPS``).
    """

    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    max_n: int = DEFAULT_MAX_N
    max_tokens: int = DEFAULT_MAX_TOKENS
    forwarded_hops: int = DEFAULT_FORWARDED_HOPS

    def __post_init__(self):
        for name, var in (
            ("max_concurrent", "MAX_CONCURRENT_REQUESTS"),
            ("max_n", "MAX_N"),
            ("max_tokens", "MAX_TOKENS"),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{var} must be an integer >= 1, found {value!r}")
        if not isinstance(self.forwarded_hops, int) or self.forwarded_hops < 0:
            raise ValueError(
                f"FORWARDED_HOPS must be an integer >= 0 (0: ignore X-Forwarded-For), found "
                f"{self.forwarded_hops!r}"
            )


def client_address(headers, peer: str | None, forwarded_hops: int) -> str:
    """The client's address: the ``forwarded_hops``-th entry from the right of
    ``X-Forwarded-For`` (see the module's doc), else the peer's (``"unknown"`` without one)."""
    if forwarded_hops > 0:
        entries = [
            e.strip()
            for value in headers.getlist("x-forwarded-for")
            for e in value.split(",")
            if e.strip()
        ]
        if len(entries) >= forwarded_hops:
            return entries[-forwarded_hops]
    return peer or "unknown"


def refusal(cap: str, limit: int, variable: str, error: str) -> dict:
    return {"error": error, "cap": cap, "limit": limit, "variable": variable}


def check_body(body: bytes, limits: GenerationLimits) -> dict | None:
    """A 400 refusal of a generation request over a cap, or None (the body is forwarded as it
    is; one that is not a JSON object too: vLLM answers it)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    caps = (
        (
            "max_n",
            limits.max_n,
            "MAX_N",
            ("n", "best_of"),
            "completions per request",
            "send several requests",
        ),
        (
            "max_tokens",
            limits.max_tokens,
            "MAX_TOKENS",
            ("max_tokens", "max_completion_tokens"),
            "tokens per completion",
            "ask for fewer",
        ),
    )
    for cap, limit, variable, fields, what, fix in caps:
        for field in fields:
            value = doc.get(field)
            if isinstance(value, int | float) and value > limit:
                return refusal(
                    cap,
                    limit,
                    variable,
                    f"expected {field} <= {limit}, found {value}: this replica caps {what} at "
                    f"{limit}; {fix}, or raise the replica's {variable}",
                )
    return None


class ConcurrencyGate:
    """In-flight generation requests per client, at most ``limit`` each (event-loop only: no
    lock is needed, nothing awaits between the check and the count)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight: dict[str, int] = {}

    def enter(self, client: str) -> Callable[[], None] | None:
        """A function that ends this request's slot (idempotent), or None when ``client``
        already has ``limit`` requests in flight."""
        if self.in_flight.get(client, 0) >= self.limit:
            return None
        self.in_flight[client] = self.in_flight.get(client, 0) + 1
        done = [False]

        def leave() -> None:
            if done[0]:
                return
            done[0] = True
            left = self.in_flight.get(client, 1) - 1
            if left > 0:
                self.in_flight[client] = left
            else:
                self.in_flight.pop(client, None)

        return leave

    def refusal(self) -> dict:
        return refusal(
            "max_concurrent",
            self.limit,
            "MAX_CONCURRENT_REQUESTS",
            f"too many generation requests in flight: this client already has {self.limit} "
            f"(the cap); wait for one to finish, or raise the replica's MAX_CONCURRENT_REQUESTS",
        )
