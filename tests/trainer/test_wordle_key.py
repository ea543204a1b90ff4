"""The trainer sends the Wordle server's key (``WORDLE_API_KEY``, ``Secrets.env_api_key``) to
the environment server and nowhere else: a training episode (``WordleToolEnv``, what TRL's rollout
process plays) and the held-out games (``wordle.evaluate``, with ``RunStack.env_headers``'
headers) play against a real Wordle server that has a key, and are refused without it (the
reason in the log, the key never)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from trainer.settings import Secrets
from trainer.task.base import ENV_KEY_VAR, ENV_URL_VAR
from trainer.task.wordle import game_env
from trainer.task.wordle import task as wordle
from trainer.task.wordle.game_env import WordleToolEnv, eval_seeds
from trainer.trust import TrustedUrls
from wordle_env import wordlists
from wordle_env.client import WordleRefusedError

from .completions_stub import completions_server

KEY = "wordle-key-for-the-trainer-test"


@pytest.fixture(scope="module")
def keyed_url(tmp_path_factory):
    """The task's own Wordle server (``wordle.TASK.server``) with a key, on a loopback port."""
    from trainer.local import children

    server = wordle.TASK.server
    server = dataclasses.replace(server, env=(*server.env, ("WORDLE_API_KEY", KEY)))
    child = children.start_env_server(server, str(tmp_path_factory.mktemp("logs")))
    try:
        child.wait_healthy(120)
        yield child.url
    finally:
        child.stop()


def test_a_training_episode_sends_the_key_and_is_refused_without_it(monkeypatch, keyed_url, caplog):
    monkeypatch.setenv(ENV_URL_VAR, keyed_url)
    monkeypatch.delenv(ENV_KEY_VAR, raising=False)
    monkeypatch.setattr(game_env.time, "sleep", lambda s: None)  # no back-off between retries
    seed = game_env.make_dataset(1, seed=3)["seed"][0]
    before = WordleToolEnv.dropped
    with caplog.at_level(logging.WARNING, logger="trainer.task.wordle.game_env"):
        refused = WordleToolEnv()
        refused.reset(seed=seed)
    assert WordleToolEnv.dropped == before + 1 and refused.get_reward() is None
    assert "HTTP 401" in caplog.text and "Authorization: Bearer <key>" in caplog.text

    monkeypatch.setenv(ENV_KEY_VAR, KEY)
    caplog.clear()
    with caplog.at_level(logging.INFO):  # websockets itself prints headers at DEBUG
        env = WordleToolEnv()
        env.reset(seed=seed)
        env.guess(wordlists.target_for_seed(seed))
    assert env.stats.won and env.get_reward() == 1.0
    assert WordleToolEnv.dropped == before + 1
    assert KEY not in caplog.text
    env._close()


def test_the_key_goes_to_the_environment_server_only():
    given = TrustedUrls.of(["http://127.0.0.1:7001"], local_hub=False)
    keyed = Secrets(hf_token="hf_secret", env_api_key=KEY)
    assert keyed.env_headers("http://127.0.0.1:7001", given) == {"Authorization": f"Bearer {KEY}"}
    assert keyed.env_headers("ws://127.0.0.1:7001/ws", given) == {"Authorization": f"Bearer {KEY}"}
    for url in ("http://127.0.0.1:7002", "https://someone-else.hf.space"):
        assert keyed.env_headers(url, given) == {}, url
    # no key: a private Space the user gave gets the HF token, as before
    space = TrustedUrls.of(["https://me-wordle.hf.space"], local_hub=False)
    bearer = {"Authorization": "Bearer hf_secret"}
    assert Secrets(hf_token="hf_secret").env_headers("https://me-wordle.hf.space", space) == bearer
    assert KEY not in repr(keyed)
    # the run's own local server never takes a key the user exported for a public Space
    assert dict(wordle.TASK.server.env)["WORDLE_API_KEY"] == ""


@pytest.fixture(scope="module")
def guessing_replica():
    """A ``/v1/completions`` stand-in that always calls ``guess`` with the word ``crane``."""
    text = '<tool_call>{"name": "guess", "arguments": {"word": "crane"}}</tool_call>'
    state: dict = {}
    with completions_server(lambda payload: text, lambda: state["tokenizer"]) as url:
        yield url, state


def test_the_held_out_games_send_the_key(keyed_url, guessing_replica, tokenizer, tmp_path):
    url, state = guessing_replica
    state["tokenizer"] = tokenizer
    tokenizer.save_pretrained(tmp_path / "tok")
    trust = TrustedUrls.for_run(str(tmp_path / "bucket"), [keyed_url], True)
    headers = Secrets(env_api_key=KEY).env_headers(keyed_url, trust)  # RunStack.env_headers
    seeds = eval_seeds(count=3)
    args = (url, str(tmp_path / "tok"), keyed_url, seeds, 64)
    block = wordle.evaluate(*args, workers=3, model_name="m", env_headers=headers)
    assert block["episodes"] == 3 and block["guesses_mean"] >= 1  # played on the keyed server
    with pytest.raises(WordleRefusedError, match="401"):
        wordle.evaluate(*args, workers=3, model_name="m")
