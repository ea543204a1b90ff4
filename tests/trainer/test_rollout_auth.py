"""The trainer's credentials toward a rollout replica: which requests carry which token, and that
TRL's rollout loop really sends it (checked on a real HTTP server on 127.0.0.1)."""

import asyncio
import json
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import aiohttp
import pytest

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


class _Recorder(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).seen.append(self.headers.get("authorization"))
        out = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Recorder.seen
    server.shutdown()
    server.server_close()


def test_trl_rollout_loop_sends_the_authorization(recorder, monkeypatch):
    from trainer.rollout_auth import AUTH_VAR, AuthRolloutLoop

    url, seen = recorder
    monkeypatch.setenv(AUTH_VAR, "Bearer hf_secret")
    loop = object.__new__(AuthRolloutLoop)  # only what _post uses; the real loop spawns a child
    loop.vllm_server_url = url
    loop._counters = defaultdict(float)

    async def post():
        async with aiohttp.ClientSession() as session:
            loop.session = session
            return await loop._post("/v1/completions", {"prompt": [1]}, timeout=10)

    assert asyncio.run(post()) == {"ok": True}
    assert seen == ["Bearer hf_secret"]


def test_authorize_rollouts_installs_the_loop_and_refuses_a_changed_trl(monkeypatch):
    from trainer.rollout_auth import AUTH_VAR, AuthRolloutLoop
    from trainer.trl_compat import TRLCompatError, authorize_rollouts

    monkeypatch.delenv(AUTH_VAR, raising=False)
    worker = SimpleNamespace(_loop_cls=object)
    assert authorize_rollouts(SimpleNamespace(rollout_worker=worker), "Bearer x")
    assert worker._loop_cls is AuthRolloutLoop
    import os

    assert os.environ[AUTH_VAR] == "Bearer x"
    assert not authorize_rollouts(SimpleNamespace(rollout_worker=None), "Bearer x")
    with pytest.raises(TRLCompatError, match="_loop_cls"):
        authorize_rollouts(SimpleNamespace(rollout_worker=SimpleNamespace()), "Bearer x")
