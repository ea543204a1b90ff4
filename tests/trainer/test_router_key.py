"""The fleet router adds the run's credentials toward the replicas, so it serves only the holders
of the run's key (``trainer.fleet.router``): a raw ``/v1`` request without it, or with another
key, gets 401 and reaches no replica; with it, it is answered. TRL's rollout worker sends the key
through ``trainer.loop.trl_compat.send_request_headers`` (its real ``_post`` is run here against
the router), and the evaluations through ``EvalRequest.headers``."""

from __future__ import annotations

import asyncio
import collections
import json
import pickle
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from trainer.fleet.pool import ReplicaPool
from trainer.fleet.router import FleetRouter

from .fleet_fakes import FakeReplica, free_port

BODY = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}).encode()


@pytest.fixture
def router():
    """A router with its own generated key in front of one fake replica."""
    replica = FakeReplica(version=1).start()
    pool = ReplicaPool([replica.url], health_interval_s=0.2).start()
    r = FleetRouter(pool, wait_s=5.0, request_timeout_s=10.0)
    r.start(free_port())
    yield r, replica
    r.stop()
    pool.stop()
    replica.stop()


def raw_post(url: str, authorization: str | None) -> tuple[str, dict]:
    """POST /v1/completions as raw request lines; returns the status line and the JSON body."""
    host, port = url.removeprefix("http://").split(":")
    auth = f"Authorization: {authorization}\r\n" if authorization is not None else ""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode() + BODY)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    return head_bytes.split(b"\r\n", 1)[0].decode(), json.loads(body)


def test_a_request_without_the_run_key_gets_401_and_reaches_no_replica(router):
    r, replica = router
    status, body = raw_post(r.url, None)
    assert status == "HTTP/1.1 401 Unauthorized"
    assert (
        "expected 'Authorization: Bearer <key>'" in body["error"] and "found none" in body["error"]
    )
    status, body = raw_post(r.url, "Bearer guessed")
    assert status == "HTTP/1.1 401 Unauthorized" and "found another key" in body["error"]
    assert replica.requests == 0
    status, body = raw_post(r.url, r.headers["Authorization"])
    assert status == "HTTP/1.1 200 OK" and body["choices"]
    assert replica.requests == 1 and replica.auth == [None]  # the run key stays at the router


def test_each_router_makes_its_own_key():
    a, b = (FleetRouter(ReplicaPool([])) for _ in range(2))
    ka, kb = a.headers["Authorization"], b.headers["Authorization"]
    assert ka.startswith("Bearer ") and len(ka) > 40 and ka != kb
    assert FleetRouter(ReplicaPool([]), key="k").headers == {"Authorization": "Bearer k"}


def test_trls_rollout_loop_sends_the_key_through_its_own_post(router):
    """TRL's ``_AsyncRolloutLoop._post`` (unchanged) on the session TRL's ``_run_loops`` would
    set: without the patch the router refuses it (TRL raises on the 401), with it the request
    is answered."""
    import aiohttp
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    from trainer.loop import trl_compat

    r, replica = router

    async def post(cls, headers):
        loop = cls.__new__(cls)
        loop._request_headers = headers
        loop._counters = collections.defaultdict(float)
        loop.vllm_server_url = r.url
        async with aiohttp.ClientSession() as session:
            loop.session = session  # what TRL's _run_loops does
            return await loop._post("/v1/completions", json.loads(BODY), timeout=10, max_retries=1)

    with pytest.raises(aiohttp.ClientResponseError) as refused:
        asyncio.run(post(_AsyncRolloutLoop, None))
    assert refused.value.status == 401
    out = asyncio.run(post(trl_compat.RequestHeadersLoop, r.headers))
    assert out["choices"] and replica.requests == 1


def test_send_request_headers_swaps_the_workers_loop_before_the_child_spawns():
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trainer.loop import trl_compat

    worker = AsyncRolloutWorker(queue_maxsize=1, vllm_server_url="http://127.0.0.1:1")
    trainer = SimpleNamespace(rollout_worker=worker)
    assert trl_compat.send_request_headers(trainer, {"Authorization": "Bearer k"})
    assert worker._loop_cls is trl_compat.RequestHeadersLoop
    assert worker._loop_kwargs["request_headers"] == {"Authorization": "Bearer k"}
    assert not trl_compat.send_request_headers(SimpleNamespace(rollout_worker=None), {"a": "b"})
    # what AsyncRolloutWorker.start hands the spawned child: it finds the class by name
    data = pickle.dumps(worker._loop_cls)
    code = (
        "import pickle, sys; cls = pickle.loads(sys.stdin.buffer.read()); "
        "print(cls.__module__, cls.__qualname__, cls.__mro__[1].__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=data, capture_output=True, timeout=300, check=True
    )
    assert done.stdout.decode().split() == [
        "trainer.loop.trl_compat",
        "RequestHeadersLoop",
        "_AsyncRolloutLoop",
    ]


def test_the_evaluations_context_check_carries_the_run_key():
    from trainer.loop.learning_curve import HeldOutEvals
    from trainer.settings import EvalSettings
    from trainer.task.base import EvalRequest

    seen = {}
    task = SimpleNamespace(
        check_context=lambda url, model, tokens, headers=None: seen.update(h=headers) or 10,
        eval_seeds=lambda n: [],
    )
    target = EvalRequest(
        "http://127.0.0.1:1", "m", "http://e", None, 8, headers={"A": "secret-key"}
    )
    assert "secret-key" not in repr(target)
    evals = HeldOutEvals(EvalSettings(episodes=0), task, target, SimpleNamespace(), lambda *a: None)
    evals.before(0)
    assert seen == {"h": {"A": "secret-key"}}
