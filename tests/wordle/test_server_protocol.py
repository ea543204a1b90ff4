"""The real server over real sockets: OpenEnv's protocol and our client.

Covers: openenv's own ``GenericEnvClient`` plays full games (a win and a loss) over
``/ws``; our ``WordleEnv`` client (async and ``.sync()``) plays a seeded game and reads the
state; HTTP routes from openenv (``/health``, ``/schema``, ``/metadata``, stateless
``/reset`` and ``/step``, the ``/web`` playground off by default) and our 422 / 413 answers.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from openenv.core.generic_client import GenericEnvClient

from wordle_env import rules, wordlists
from wordle_env.client import WordleEnv, WordleServerError

pytestmark = pytest.mark.slow


def _http(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as error:
        text, status = error.read().decode(), error.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def test_generic_client_plays_a_win_and_a_loss(wordle_server: Any) -> None:
    async def play() -> None:
        async with GenericEnvClient(base_url=wordle_server.url) as env:
            result = await env.reset(target="abbey")
            assert result.observation["guesses_left"] == 6 and not result.done
            result = await env.step({"message": "[babes]"})
            assert result.observation["feedback"] == ["YYGGX"]
            assert result.reward == pytest.approx(0.6)
            result = await env.step({"message": "[abbey]"})
            assert result.done and result.reward == 1.0 and result.observation["won"]
            # Same connection, new game: a loss after six guesses.
            await env.reset(target="crane")
            for word in ["abbey", "moist", "pouch", "lying", "fjord", "slate"]:
                result = await env.step({"message": f"[{word}]"})
            assert result.done and not result.observation["won"]
            assert result.observation["target"] == "crane"
            assert result.reward == pytest.approx(rules.partial_credit("XXGXG"))
            state = await env.state()
            assert state["guesses"][-1] == "slate" and state["target"] == "crane"

    asyncio.run(play())


def test_our_client_plays_a_seeded_game(wordle_server: Any) -> None:
    seed = 424242
    target = wordlists.target_for_seed(seed)
    probe = "crane" if target != "crane" else "slate"

    async def play() -> None:
        async with WordleEnv(base_url=wordle_server.url) as env:
            result = await env.reset(seed=seed, episode_id="seeded")
            assert result.observation.prompt.startswith("You are playing Wordle.")
            result = await env.step(f"I will try [{probe}]")
            assert result.observation.feedback == [rules.feedback(probe, target)]
            assert result.observation.reward_breakdown["valid_guess"] == 1.0
            assert result.observation.metadata["reward_breakdown"] == (
                result.observation.reward_breakdown
            )
            state = await env.state()
            assert (state.episode_id, state.seed, state.target) == ("seeded", seed, None)
            result = await env.step(f"[{target}]")
            assert result.done and result.reward == 1.0 and result.observation.target == target
            # Bad reset options come back as a server error; the session survives them.
            with pytest.raises(WordleServerError, match="either seed or target") as info:
                await env.reset(seed=1, target="crane")
            assert info.value.code == "EXECUTION_ERROR"
            assert not (await env.reset(target="crane")).done

    asyncio.run(play())


def test_our_sync_client_plays(wordle_server: Any) -> None:
    client = WordleEnv(base_url=wordle_server.url).sync()
    with client:
        client.reset(target="abbey")
        result = client.step("[kebab]")
        assert result.observation.feedback == ["XYGYY"] and not result.done


def test_http_routes(wordle_server: Any) -> None:
    url = wordle_server.url
    assert _http(f"{url}/health") == (200, {"status": "healthy"})
    status, schema = _http(f"{url}/schema")
    assert status == 200 and "message" in schema["action"]["properties"]
    assert "reward_breakdown" in schema["observation"]["properties"]
    status, metadata = _http(f"{url}/metadata")
    assert status == 200 and metadata["name"] == "wordle"
    # Stateless HTTP: reset works, and a step cannot play (no game in the fresh environment).
    status, reset = _http(f"{url}/reset", {"seed": 3})
    assert status == 200 and reset["observation"]["guesses_left"] == 6
    status, step = _http(f"{url}/step", {"action": {"message": "[crane]"}})
    assert status == 200 and step["observation"]["error_code"] == "no_active_game"
    status, error = _http(f"{url}/reset", {"target": "qwert"})
    assert status == 422 and "target must be" in error["detail"]
    status, error = _http(f"{url}/step", {"action": {"message": "[crane]", "extra": 1}})
    assert status == 422
    status, error = _http(f"{url}/step", raw=b'{"action": {"message": "' + b"a" * 70_000 + b'"}}')
    assert status == 413 and "limit is 65536 bytes" in error["detail"]
    # The shared web playground is off by default (WORDLE_ENABLE_WEB=1 turns it on).
    status, _ = _http(f"{url}/web/")
    assert status == 404
