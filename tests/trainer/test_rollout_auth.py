"""The trainer's credentials toward a rollout replica: which requests carry which token. The fleet
router sends them (``tests/trainer/test_fleet.py`` checks that a replica receives them and never
the caller's own)."""

from trainer.config import Secrets


def test_rollout_headers_choose_the_credential_by_host():
    cfg = Secrets(hf_token="hf_secret")
    assert cfg.rollout_headers("https://alice-deltasync-rollout.hf.space") == {
        "Authorization": "Bearer hf_secret"
    }
    assert cfg.rollout_headers("https://replica.example.com") == {}  # the HF token stays home
    assert cfg.rollout_headers("http://127.0.0.1:8000") == {}
    keyed = Secrets(hf_token="hf_secret", rollout_api_key="k")
    assert keyed.rollout_headers("https://replica.example.com") == {"Authorization": "Bearer k"}
    assert "hf_secret" not in repr(keyed) and "'k'" not in repr(keyed)


def test_a_private_wordle_space_gets_the_token_on_the_websocket(monkeypatch):
    from trainer.task import wordle_task
    from trainer.task.base import space_headers

    assert space_headers("https://alice-deltasync-wordle.hf.space", "hf_x") == {
        "Authorization": "Bearer hf_x"
    }
    assert space_headers("http://127.0.0.1:7860", "hf_x") == {}
    made = {}

    class Recording:
        def __init__(self, base_url, headers=None):
            made.update(base_url=base_url, headers=headers)

        def sync(self):
            return self

        def connect(self):
            pass

    import wordle_env.client

    monkeypatch.setattr(wordle_env.client, "WordleEnv", Recording)
    monkeypatch.setenv(wordle_task.ENV_URL_VAR, "https://alice-deltasync-wordle.hf.space")
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    wordle_task.WordleToolEnv()._connect()
    assert made["headers"] == {"Authorization": "Bearer hf_x"}
