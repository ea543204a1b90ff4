"""The number-guess example's environment, as a client sees it: its Space's server (the task's own
``EnvServer``, with a key) refuses every route but ``/health`` without the key, over raw HTTP and
on the WebSocket handshake; with it, ``NumberGuessEnv`` plays seeded games whose feedback,
end and reward follow the rules (``examples/number_guess/space/game.py``), and the server counts
them; the episode counts behind the task's figures read the replies back."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from examples.number_guess.env import EnvUnreachable, NumberGuessEnv, parse_reply
from examples.number_guess.figures import episode_counts, step_figures
from examples.number_guess.task import TASK

KEY = "number-guess-test-key-5e1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The task's server on a loopback port, with a key."""
    from trainer.local.children import start_env_server

    env = (*TASK.server.env, ("NUMBER_GUESS_API_KEY", KEY))
    spec = dataclasses.replace(TASK.server, env=env)
    child = start_env_server(spec, str(tmp_path_factory.mktemp("logs")))
    try:
        child.wait_healthy(120)
        yield child.url
    finally:
        child.stop()


def play(env: NumberGuessEnv, seed: int, pick) -> list[str]:
    """Play the game of ``seed``, each guess ``pick(low, high)``; returns the replies."""
    env.reset(seed=seed, prompt=[])
    low, high, replies = 1, 100, []
    while not env.done:
        number = pick(low, high)
        replies.append(env.guess(number))
        feedback, _ = parse_reply(replies[-1]) or ("", 0)
        if feedback == "higher":
            low = number + 1
        elif feedback == "lower":
            high = number - 1
    return replies


@pytest.mark.parametrize(
    "method, path", [("GET", "/stats"), ("GET", "/schema"), ("POST", "/reset"), ("GET", "/state")]
)
def test_every_route_but_health_needs_the_key(server, method, path):
    assert httpx.get(f"{server}/health").status_code == 200
    refused = httpx.request(method, f"{server}{path}", json={})
    assert refused.status_code == 401
    assert "NUMBER_GUESS_API_KEY" in refused.json()["detail"]
    assert refused.headers["www-authenticate"].startswith("Bearer")
    wrong = httpx.request(method, f"{server}{path}", json={}, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401
    assert "not this server's key" in wrong.json()["detail"] and KEY not in wrong.text
    ok = httpx.request(
        method, f"{server}{path}", json={}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert ok.status_code == 200


def test_a_game_without_the_key_is_refused(server):
    with pytest.raises(EnvUnreachable, match="HTTP 403"):
        NumberGuessEnv(env_url=server).reset(seed=1)
    with pytest.raises(EnvUnreachable, match="HTTP 403"):
        NumberGuessEnv(server, {"Authorization": "Bearer not-the-key"}).reset(seed=1)


def test_seeded_games_follow_the_rules_and_the_server_counts_them(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(f"{server}/stats", headers=headers).json()
    with NumberGuessEnv(server, headers) as env:
        # binary search always wins within the 7 guesses: reward 1
        replies = play(env, 7, lambda low, high: (low + high) // 2)
        assert env.done and env.get_reward() == 1.0 and len(replies) <= 7
        moves = len(replies)
        assert replies[-1].startswith("Correct: ") and replies[-1].endswith("Game over.")
        secret = env.moves[-1][0]
        # the same seed draws the same secret; guessing 1 each time loses, paid by closeness
        replies = play(env, 7, lambda low, high: 1)
        assert len(replies) == 7 and replies[-1] == "Higher than 1. Game over."
        assert env.get_reward() == pytest.approx(0.5 * (1 - (secret - 1) / 99), abs=1e-4)
        # an out-of-range guess uses a move and costs 0.1; a guess after the end is refused
        env.reset(seed=7)
        assert env.guess(500) == "500 is out of range (1 to 100). 6 guesses left."
        assert env.get_reward() == pytest.approx(-0.1)
        env.guess(secret)
        assert env.get_reward() == pytest.approx(0.9) and env.done
        assert env.guess(3) == "The game is over." and env.moves[-1] == (secret, "correct")
        with pytest.raises(ValueError, match="expected a whole number, found 'many'"):
            env.guess("many")
    after = httpx.get(f"{server}/stats", headers=headers).json()
    assert after["games"] - before["games"] == 3
    assert after["moves"] - before["moves"] == moves + 7 + 2  # not the guess after the end
    assert after["solved"] - before["solved"] == 2


def test_the_counts_read_the_replies_back():
    tool = [
        "Higher than 50. 6 guesses left.",  # secret > 50
        "Lower than 80. 5 guesses left.",  # 51..79: consistent
        "Higher than 20. 4 guesses left.",  # not in 51..79: inconsistent
        "300 is out of range (1 to 100). 3 guesses left.",
        "{'error': 'expected a whole number'}",  # a tool error: not a move
        "Correct: 66. Game over.",  # consistent
    ]
    messages = [{"role": "tool", "name": "guess", "content": t} for t in tool]
    counts = episode_counts([{"role": "assistant", "content": ""}, *messages])
    assert counts == {"guesses": 4, "out_of_range": 1, "solved": 1, "checked": 3, "consistent": 2}
    assert step_figures(counts, 2) == {
        "solved_rate": 0.5,
        "consistent_rate": 0.6667,
        "guesses_mean": 2.5,
        "out_of_range_rate": 0.2,
    }
    assert step_figures({}, 0)["solved_rate"] is None
