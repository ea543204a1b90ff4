"""The trainer's credentials toward a rollout replica: which requests carry which token. The fleet
router sends them (``tests/trainer/test_fleet.py`` checks that a replica receives them and never
the caller's own)."""

from trainer.config import TrainConfig


def test_rollout_headers_choose_the_credential_by_host():
    cfg = TrainConfig(hf_token="hf_secret")
    assert cfg.rollout_headers("https://alice-deltasync-rollout.hf.space") == {
        "Authorization": "Bearer hf_secret"
    }
    assert cfg.rollout_headers("https://replica.example.com") == {}  # the HF token stays home
    assert cfg.rollout_headers("http://127.0.0.1:8000") == {}
    keyed = TrainConfig(hf_token="hf_secret", rollout_api_key="k")
    assert keyed.rollout_headers("https://replica.example.com") == {"Authorization": "Bearer k"}
    assert "hf_secret" not in repr(keyed) and "'k'" not in repr(keyed)
