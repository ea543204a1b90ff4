"""Bounded load test: 256 simultaneous sessions play full games against the real server.

Covers: the default cap of 256 sessions is reachable by two clients (addresses in
``X-Forwarded-For``), each at the default cap of 128 per client, whose 129th session is refused
(``WORDLE_MAX_SESSIONS_PER_CLIENT``); the 257th connection, from a third client, gets a clear
``CAPACITY_REACHED`` error, every session plays a full game (half win, half lose after six
guesses) with feedback computed from its own seeded target only (no cross-talk), and the
slots are free again afterwards. Loopback only; the whole test is bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from wordle_env import rules, wordlists
from wordle_env.client import WordleCapacityError, WordleEnv, WordleRefusedError

SESSIONS = 256
PER_CLIENT = 128  # the server's default WORDLE_MAX_SESSIONS_PER_CLIENT
SEED_BASE = 90_000
PROBES = ["crane", "slate", "moist", "pouch", "lying", "fjord", "kebab"]
TIME_LIMIT_S = 240.0


async def _play_game(env: WordleEnv, index: int) -> dict[str, Any]:
    """Play the game already reset with seed ``SEED_BASE + index``; check every answer."""
    target = wordlists.target_for_seed(SEED_BASE + index)
    wrong = [w for w in PROBES if w != target]
    moves = [*wrong[:2], target] if index % 2 == 0 else wrong[:6]
    result = None
    for move in moves:
        result = await env.step(f"[{move}]")
        observation = result.observation
        assert observation.error_code is None, observation.error
        assert observation.feedback[-1] == rules.feedback(move, target), (index, move)
    assert result is not None and result.done
    return {
        "index": index,
        "won": result.observation.won,
        "target": result.observation.target,
        "expected": target,
        "reward": result.reward,
        "last": moves[-1],
    }


async def _load_test(url: str) -> tuple[list[dict[str, Any]], float]:
    def address(i: int) -> dict[str, str]:  # the client's address, as the Hub's proxy sends it
        return {"X-Forwarded-For": f"10.0.1.{i}"}

    clients = [
        WordleEnv(base_url=url, message_timeout_s=120, headers=address(i % 2))
        for i in range(SESSIONS)
    ]
    started = time.perf_counter()
    try:
        await asyncio.gather(*(c.connect() for c in clients))
        # Every session holds a game before the extra connections try to get in.
        await asyncio.gather(*(c.reset(seed=SEED_BASE + i) for i, c in enumerate(clients)))
        with pytest.raises(
            WordleRefusedError, match=f"WORDLE_MAX_SESSIONS_PER_CLIENT={PER_CLIENT}"
        ):
            await WordleEnv(base_url=url, headers=address(0)).reset()
        extra = WordleEnv(base_url=url, headers=address(2))
        with pytest.raises(WordleCapacityError, match=f"{SESSIONS}/{SESSIONS}") as info:
            await extra.reset()
        assert info.value.data["max_sessions"] == SESSIONS
        await extra.disconnect()
        results = await asyncio.gather(*(_play_game(c, i) for i, c in enumerate(clients)))
        elapsed = time.perf_counter() - started
    finally:
        await asyncio.gather(*(c.disconnect() for c in clients))
    return list(results), elapsed


async def _new_session_works(url: str, attempts: int = 50) -> bool:
    """After the load, a new session gets a game (slots are freed asynchronously)."""
    for _ in range(attempts):
        env = WordleEnv(base_url=url)
        try:
            result = await env.reset(target="crane")
            return result.observation.guesses_left == 6
        except WordleCapacityError:
            await asyncio.sleep(0.1)
        finally:
            await env.disconnect()
    return False


@pytest.mark.slow
def test_256_sessions_play_full_games_without_cross_talk(wordle_server: Any) -> None:
    results, elapsed = asyncio.run(
        asyncio.wait_for(_load_test(wordle_server.url), timeout=TIME_LIMIT_S)
    )
    assert len(results) == SESSIONS
    for r in results:
        assert r["target"] == r["expected"], r
        if r["index"] % 2 == 0:
            assert r["won"] and r["reward"] == 1.0, r
        else:
            assert not r["won"]
            assert r["reward"] == pytest.approx(
                rules.partial_credit(rules.feedback(r["last"], r["expected"]))
            )
    assert len({r["expected"] for r in results}) > SESSIONS // 2  # really different words
    assert asyncio.run(_new_session_works(wordle_server.url))
    print(
        f"256 sessions, {sum(6 if r['index'] % 2 else 3 for r in results)} steps: {elapsed:.1f} s"
    )
