"""Who may use the Wordle server and how many sessions one client may hold
(``server/access_guard.py``), against the real server on 127.0.0.1.

Covers: with ``WORDLE_API_KEY`` every route but ``/health`` refuses a request without the key (HTTP
401, the WebSocket handshake refused with 401 before it is accepted, the reason said and the key
never echoed), a client with the key plays a game; ``WORDLE_MAX_SESSIONS_PER_CLIENT`` refuses the
(cap+1)-th concurrent session of one client with 429 naming the cap and its variable, the client
being the key when the server has one (another address does not help) and the address from
``X-Forwarded-For`` (its right-most entry: the Hub's proxy appends it) when it has none, another
client still gets a session, and closing a session frees its slot; the key stays out of the
printed config.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from wordle_env.client import WordleEnv, WordleRefusedError

KEY = "test-wordle-key-5f2a"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 2


def _http(url: str, method: str = "GET", headers: dict | None = None, body: bytes | None = None):
    """``(status, headers, parsed JSON body)`` of one request."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"null")


async def _handshake_refusal(ws_url: str, headers: dict | None = None) -> tuple[int, dict]:
    """The status and JSON body of a refused WebSocket handshake (fails if it is accepted)."""
    with pytest.raises(InvalidStatus) as info:
        async with connect(ws_url, additional_headers=headers, proxy=None, open_timeout=10):
            pass
    response = info.value.response
    return response.status_code, json.loads(response.body)


async def _session(url: str, headers: dict) -> WordleEnv:
    """A client holding a session with a game (reset done)."""
    env = WordleEnv(base_url=url, headers=headers)
    await env.reset(target="crane")
    return env


async def _admitted_soon(url: str, headers: dict, attempts: int = 50) -> WordleEnv:
    """A new session for ``headers``' client, retried while the server frees a closed one."""
    for _ in range(attempts):
        try:
            return await _session(url, headers)
        except WordleRefusedError as e:
            assert e.status == 429, e
            await asyncio.sleep(0.1)
    raise AssertionError(f"no session after {attempts} attempts: the closed one was not freed")


def test_the_key_guards_every_route_but_health_and_a_client_with_it_plays(
    server_factory: Any,
) -> None:
    server = server_factory(WORDLE_API_KEY=KEY, WORDLE_MAX_SESSIONS_PER_CLIENT=str(CAP))
    assert _http(f"{server.url}/health")[0] == 200  # the probe needs no key
    for path, method, body in (
        ("/schema", "GET", None),
        ("/metadata", "GET", None),
        ("/", "GET", None),
        ("/reset", "POST", b"{}"),
        ("/step", "POST", b'{"action": {"message": "[crane]"}}'),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
            status, got_headers, doc = _http(f"{server.url}{path}", method, headers, body)
            assert status == 401, (path, headers, status, doc)
            assert got_headers["WWW-Authenticate"].startswith("Bearer")
            assert "Authorization: Bearer <key>" in doc["detail"] and KEY not in json.dumps(doc)
            assert doc["variable"] == "WORDLE_API_KEY"
    assert _http(f"{server.url}/schema", headers=AUTH)[0] == 200
    status, _, doc = _http(f"{server.url}/reset", "POST", AUTH, b'{"target": "crane"}')
    assert status == 200 and doc["observation"]["guesses_left"] == 6

    async def websocket() -> None:
        status, doc = await _handshake_refusal(server.ws_url)  # a raw handshake, no key
        assert status == 401 and "found no Authorization header" in doc["detail"]
        status, doc = await _handshake_refusal(server.ws_url, {"Authorization": "Bearer nope"})
        assert status == 401 and "not this server's key" in doc["detail"]
        with pytest.raises(WordleRefusedError, match="401.*Authorization: Bearer <key>") as info:
            await WordleEnv(base_url=server.url).reset(target="crane")
        assert info.value.status == 401
        async with WordleEnv(base_url=server.url, headers=AUTH) as env:  # with the key: a game
            result = await env.reset(target="crane")
            assert result.observation.guesses_left == 6
            result = await env.step("[slate]")
            assert result.observation.feedback[-1] and not result.done
            result = await env.step("[crane]")
            assert result.done and result.observation.won and result.reward == 1.0

    asyncio.run(asyncio.wait_for(websocket(), timeout=60))
    assert KEY not in server.log_tail(100_000)  # printed config, refusals: no key


def test_with_a_key_its_holders_share_one_session_budget(server_factory: Any) -> None:
    server = server_factory(WORDLE_API_KEY=KEY, WORDLE_MAX_SESSIONS_PER_CLIENT=str(CAP))

    async def scenario() -> None:
        held = [
            await _session(server.url, {**AUTH, "X-Forwarded-For": f"10.0.0.{i}"})
            for i in range(CAP)
        ]
        try:
            other = {**AUTH, "X-Forwarded-For": "10.9.9.9"}  # another address, the same key
            status, doc = await _handshake_refusal(server.ws_url, other)
            assert status == 429, doc
            assert doc["variable"] == "WORDLE_MAX_SESSIONS_PER_CLIENT" and doc["limit"] == CAP
            assert f"WORDLE_MAX_SESSIONS_PER_CLIENT={CAP}" in doc["detail"]
            assert "holders of WORDLE_API_KEY" in doc["detail"] and KEY not in doc["detail"]
            await held.pop().disconnect()  # closing a session frees its slot
            held.append(await _admitted_soon(server.url, other))
        finally:
            await asyncio.gather(*(env.disconnect() for env in held))

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_without_a_key_each_forwarded_address_has_its_own_session_cap(
    server_factory: Any,
) -> None:
    server = server_factory(WORDLE_MAX_SESSIONS_PER_CLIENT=str(CAP))
    alice, bob = {"X-Forwarded-For": "10.0.0.1"}, {"X-Forwarded-For": "10.0.0.2"}

    async def scenario() -> None:
        held = [await _session(server.url, alice) for _ in range(CAP)]
        try:
            status, doc = await _handshake_refusal(server.ws_url, alice)
            assert status == 429 and "found 2 open for 10.0.0.1" in doc["detail"], doc
            # the client-written left part of the header does not make another client: the
            # right-most entry (what the Hub's proxy appended) is the client
            forged = {"X-Forwarded-For": "192.0.2.7, 10.0.0.1"}
            assert (await _handshake_refusal(server.ws_url, forged))[0] == 429
            with pytest.raises(WordleRefusedError, match="WORDLE_MAX_SESSIONS_PER_CLIENT=2"):
                await _session(server.url, alice)
            held.append(await _session(server.url, bob))  # another client still gets one
            await held.pop(0).disconnect()  # alice closes one: her slot is free again
            held.append(await _admitted_soon(server.url, alice))
        finally:
            await asyncio.gather(*(env.disconnect() for env in held))

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_the_config_reads_the_new_variables_and_never_prints_the_key(space_server) -> None:
    import importlib

    config = importlib.import_module(f"{space_server.__name__}.config")
    access = importlib.import_module(f"{space_server.__name__}.access_guard")
    default = config.load_config({})
    assert (default.api_key, default.max_sessions_per_client, default.forwarded_hops) == (
        "",
        128,
        1,
    )
    keyed = config.load_config(
        {"WORDLE_API_KEY": KEY, "WORDLE_MAX_SESSIONS_PER_CLIENT": "3", "WORDLE_FORWARDED_HOPS": "0"}
    )
    assert keyed.api_key == KEY and KEY not in repr(keyed) and KEY not in str(keyed)
    assert (keyed.max_sessions_per_client, keyed.forwarded_hops) == (3, 0)
    with pytest.raises(config.ConfigError, match="WORDLE_MAX_SESSIONS_PER_CLIENT must be"):
        config.load_config({"WORDLE_MAX_SESSIONS_PER_CLIENT": "0"})
    headers = [(b"x-forwarded-for", b"1.1.1.1, 2.2.2.2"), (b"X-Forwarded-For", b"3.3.3.3")]
    assert access.client_address(headers, "127.0.0.1", 1) == "3.3.3.3"
    assert access.client_address(headers, "127.0.0.1", 2) == "2.2.2.2"
    assert access.client_address(headers, "127.0.0.1", 4) == "127.0.0.1"  # fewer entries
    assert access.client_address(headers, "127.0.0.1", 0) == "127.0.0.1"  # the header ignored
    assert access.client_address([], None, 1) == "unknown"
