"""The trainer's credentials toward replicas and Spaces: which requests carry which token, and which
announced replicas may join (``trainer.trust.TrustedUrls``). The HF token goes only over
https to a ``*.hf.space`` host the user gave (``VLLM_URL``/``ENV_URL``) or ``make spaces``
deployed for the run's bucket owner (read from the deploy's ``runs/spaces/<owner>--<space>.*``
files); a local Hub (``make journey``) gets its own token on the loopback URLs it was given. The
fleet router (``tests/trainer/test_fleet.py``) sends them, never the caller's own."""

from __future__ import annotations

import logging

import httpx
import pytest

from deltasync.status import ReplicaHeartbeat, write_heartbeat
from deltasync.store import Store
from trainer.config import Secrets
from trainer.fleet.pool import ReplicaPool
from trainer.task.base import space_headers
from trainer.trust import TrustedUrls, deployed_spaces, space_host

BEARER = {"Authorization": "Bearer hf_secret"}
ROLLOUT = "https://me-deltasync-rollout.hf.space"  # deployed by `make spaces` for owner "me"
WORDLE = "https://me-deltasync-wordle.hf.space"  # the ENV_URL the user gave


@pytest.fixture
def trust(tmp_path, monkeypatch):
    """The run `make train BUCKET=me/run ENV_URL=<WORDLE>` after `make spaces` deployed
    me/deltasync-*; the deploy also left another owner's file in the state dir."""
    monkeypatch.delenv("HF_ENDPOINT", raising=False)  # the real Hub
    for name in ("me--deltasync-rollout.control_token", "bob--evil-rollout.control_token"):
        (tmp_path / name).write_text("x\n")
    return TrustedUrls.for_run("hf://buckets/me/run", [WORDLE], False, state_dirs=[str(tmp_path)])


def test_the_hf_token_goes_only_over_https_to_the_runs_own_spaces(trust):
    cfg = Secrets(hf_token="hf_secret")
    assert cfg.rollout_headers(ROLLOUT, trust) == BEARER  # deployed for this run
    assert space_headers(WORDLE, "hf_secret", trust) == BEARER  # given as ENV_URL
    assert space_headers("wss://me-deltasync-wordle.hf.space/ws", "hf_secret", trust) == BEARER
    # someone else's Space (another owner's deploy file is not this run's), plain http to the
    # deployed name, a host that only looks alike, a non-Space host, loopback: nothing
    for url in (
        "https://bob-evil-rollout.hf.space",
        "https://someone-else.hf.space",
        "http://me-deltasync-rollout.hf.space",
        "http://me-deltasync-wordle.hf.space",
        "https://me-deltasync-rollout.hf.space.evil.example",
        "https://replica.example.com",
        "http://127.0.0.1:8000",
    ):
        assert cfg.rollout_headers(url, trust) == {}, url
        assert space_headers(url, "hf_secret", trust) == {}, url
    # an explicit non-Space host gets the replicas' own key, never the HF token
    keyed = Secrets(hf_token="hf_secret", rollout_api_key="k")
    given = TrustedUrls.of(["https://replica.example.com"], local_hub=False)
    assert keyed.rollout_headers("https://replica.example.com", given) == {
        "Authorization": "Bearer k"
    }
    assert keyed.rollout_headers("https://bob-evil-rollout.hf.space", given) == {}
    assert "hf_secret" not in repr(keyed) and "'k'" not in repr(keyed)
    # a keyed replica on the run's private Space: the key for its front, the HF token for the
    # Hub's proxy in the header the proxy reads first
    assert keyed.rollout_headers(ROLLOUT, trust) == {
        "Authorization": "Bearer k",
        "X-HF-Authorization": "Bearer hf_secret",
    }


def test_deployed_space_hosts_follow_the_hubs_naming_and_the_owner(tmp_path):
    (tmp_path / "me--My_Run.v2-rollout.control_token").write_text("x\n")
    (tmp_path / "me--deltasync-wordle.wordle_api_key").write_text("x\n")  # not a replica
    (tmp_path / "mer--x-rollout.control_token").write_text("x\n")  # another owner
    assert space_host("me", "My_Run.v2-rollout") == "me-my-run-v2-rollout.hf.space"
    assert deployed_spaces("me", [str(tmp_path), str(tmp_path / "absent")]) == {
        "me-my-run-v2-rollout.hf.space"
    }


def test_a_local_hub_gets_its_own_token_on_the_loopback_urls_it_was_given(monkeypatch):
    """`make journey`: HF_ENDPOINT is a Hub on 127.0.0.1 whose private Spaces answer on
    loopback http behind a front that checks the token."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:5999")
    trust = TrustedUrls.of(["http://127.0.0.1:7001", "http://127.0.0.1:7002"])
    assert space_headers("http://127.0.0.1:7002", "hub_tok", trust) == {
        "Authorization": "Bearer hub_tok"
    }
    assert space_headers("http://127.0.0.1:7999", "hub_tok", trust) == {}  # not given
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")
    assert (
        space_headers("http://127.0.0.1:7002", "hf_tok", TrustedUrls.of(["http://127.0.0.1:7002"]))
        == {}
    )


def test_a_heartbeat_announcing_a_foreign_url_does_not_join_nor_get_the_token(trust, caplog):
    """Every Space holding a bucket token can write a heartbeat: only the run's deployed
    rollout Space joins and receives the token; a foreign Space, plain http to the deployed name
    and a loopback port (remote bucket) are ignored, each with one warning, and get no request."""
    store = Store("memory://trust-discovery")
    for rid, url in (
        ("ours", ROLLOUT),
        ("rogue", "https://bob-evil-rollout.hf.space"),
        ("plain", "http://me-deltasync-rollout.hf.space:80"),
        ("local", "http://127.0.0.1:9"),
    ):
        write_heartbeat(
            store,
            ReplicaHeartbeat.empty(rid, status="ok", held_version=1, newest_seen=1, url=url),
        )
    sent: list[tuple[str, str | None]] = []

    def replica(request: httpx.Request) -> httpx.Response:
        sent.append((str(request.url), request.headers.get("authorization")))
        return httpx.Response(200, json={"held_version": 1, "ready": True})

    creds = Secrets(hf_token="hf_secret")
    pool = ReplicaPool(
        store=store,
        headers_for=lambda url: creds.rollout_headers(url, trust),
        require_https=True,
        discover_interval_s=0.0,
        trust=trust,
    )
    pool._http = httpx.Client(transport=httpx.MockTransport(replica))
    with caplog.at_level(logging.WARNING, logger="trainer.fleet"):
        pool.refresh()
        pool.refresh()  # the same heartbeats again: no second warning
    pool.stop()
    assert {r["url"]: r["state"] for r in pool.replica_rows()} == {ROLLOUT: "serving"}
    assert sent == [(f"{ROLLOUT}/health", "Bearer hf_secret")] * 2
    ignored = [m for m in caplog.messages if "ignored" in m]
    assert len(ignored) == 3
    rogue = next(m for m in ignored if "bob-evil-rollout" in m)
    assert "not one of this run's replicas" in rogue and "add it to VLLM_URL" in rogue
    assert "hf_secret" not in caplog.text


def test_a_private_wordle_space_gets_the_token_on_the_websocket(monkeypatch):
    """TRL's rollout child connects to the ENV_URL the trainer handed it: the HF token goes on
    the handshake over https to a Space, never to a plain-http one."""
    from trainer.task.wordle import game_env

    made = {}

    class Recording:
        def __init__(self, base_url, headers=None):
            made.update(base_url=base_url, headers=headers)

        def sync(self):
            return self

        def connect(self):
            pass

    import wordle_env.client

    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setattr(wordle_env.client, "WordleEnv", Recording)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setenv(game_env.ENV_URL_VAR, "https://alice-deltasync-wordle.hf.space")
    game_env.WordleToolEnv()._connect()
    assert made["headers"] == {"Authorization": "Bearer hf_x"}
    monkeypatch.setenv(game_env.ENV_URL_VAR, "http://alice-deltasync-wordle.hf.space")
    game_env.WordleToolEnv()._connect()
    assert made["headers"] is None
