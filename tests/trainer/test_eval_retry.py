"""An evaluation request whose connection breaks is retried on a new connection (the request is
idempotent), and after ``POST_ATTEMPTS`` broken connections it fails with ``EvalError`` naming
the cause, never silently."""

import threading

import httpx
import pytest

from trainer.task.eval_http import POST_ATTEMPTS, EvalError, ThreadClients, post


def _client(failures: int) -> tuple[httpx.Client, list]:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= failures:
            raise httpx.ReadError("[Errno 9] Bad file descriptor", request=request)
        return httpx.Response(200, json={"choices": [{"token_ids": [1, 2]}]})

    return httpx.Client(transport=httpx.MockTransport(handler)), calls


def test_a_broken_connection_is_retried_with_the_same_request():
    http, calls = _client(failures=POST_ATTEMPTS - 1)
    r = post(http, "http://replica/v1/completions", {"seed": 7, "prompt": [1]})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [1, 2]
    assert len(calls) == POST_ATTEMPTS
    assert len({c.content for c in calls}) == 1  # the same payload each time (same seed)


def test_every_attempt_broken_is_an_eval_error_with_its_cause():
    http, calls = _client(failures=POST_ATTEMPTS)
    with pytest.raises(EvalError, match="3 broken connections.*ReadError") as info:
        post(http, "http://replica/v1/completions", {"seed": 7})
    assert isinstance(info.value.__cause__, httpx.ReadError) and len(calls) == POST_ATTEMPTS


def test_each_evaluation_thread_has_its_own_client_and_all_are_closed():
    """httpcore's sync pool can close a connection it handed to another thread's queued request
    (encode/httpcore issue 1110): the evaluation never shares a client between threads."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadClients({"Authorization": "Bearer t"}) as clients:
        with ThreadPoolExecutor(4) as pool:
            seen = list(pool.map(lambda _: (threading.get_ident(), clients.get()), range(64)))
        owners = {}
        for thread, client in seen:
            owners.setdefault(id(client), set()).add(thread)
        assert all(len(threads) == 1 for threads in owners.values())
        assert len({thread for thread, _ in seen}) == len(owners)
        assert seen[0][1].headers["authorization"] == "Bearer t"
    assert all(client.is_closed for _, client in seen)
