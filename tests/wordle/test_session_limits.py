"""Session cap and idle expiry, on a second real server started with small settings.

Covers: ``WORDLE_MAX_SESSIONS`` is enforced with a clear ``CAPACITY_REACHED`` error, an idle
session gets ``SESSION_EXPIRED`` and is closed after ``WORDLE_IDLE_TIMEOUT_S``, its slot is
free again afterwards and our client's next ``reset`` reconnects by itself;
``WORDLE_MAX_MESSAGE_BYTES`` moves the size cap.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.sync.client import connect

from wordle_env.client import WordleCapacityError, WordleEnv, WordleSessionExpiredError

pytestmark = pytest.mark.slow


async def _cap_and_expiry(url: str) -> None:
    first, second = WordleEnv(base_url=url), WordleEnv(base_url=url)
    await first.reset(target="crane")
    await second.reset(target="abbey")
    third = WordleEnv(base_url=url)
    with pytest.raises(WordleCapacityError, match="2/2") as info:
        await third.reset()
    assert info.value.code == "CAPACITY_REACHED"
    await third.disconnect()
    # Both sessions now sit idle past the 1 s timeout: the server closes them.
    await asyncio.sleep(2.0)
    with pytest.raises(WordleSessionExpiredError, match="WORDLE_IDLE_TIMEOUT_S"):
        await first.step("[slate]")
    await first.disconnect()
    # A long-lived client whose session expired gets a new one on its next reset.
    assert (await second.reset(target="abbey")).observation.guesses_left == 6
    assert (await second.step("[babes]")).observation.feedback == ["YYGGX"]
    await second.disconnect()
    # Their slots are free again: two new sessions fit.
    fresh = [WordleEnv(base_url=url), WordleEnv(base_url=url)]
    for env in fresh:
        assert (await env.reset(target="crane")).observation.guesses_left == 6
    await asyncio.gather(*(env.disconnect() for env in fresh))


def test_session_cap_and_idle_expiry(server_factory: Any) -> None:
    server = server_factory(
        WORDLE_MAX_SESSIONS="2",
        WORDLE_IDLE_TIMEOUT_S="1",
        WORDLE_MAX_MESSAGE_BYTES="1024",
        ENABLE_WEB_INTERFACE="false",
    )
    asyncio.run(asyncio.wait_for(_cap_and_expiry(server.url), timeout=60))
    # The 1 KiB message cap of this server applies to frames.
    with connect(server.ws_url, max_size=None) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"target": "crane"}}))
        assert json.loads(ws.recv(timeout=10))["type"] == "observation"
        ws.send(json.dumps({"type": "step", "data": {"message": "a" * 2000}}))
        answer = json.loads(ws.recv(timeout=10))
        assert answer["data"]["code"] == "MESSAGE_TOO_LARGE"
        assert "limit is 1024 bytes" in answer["data"]["message"]
