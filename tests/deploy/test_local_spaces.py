"""The local Hub's Space routes (tools/local_hub/spaces.py) driven by the real huggingface_hub
client, with the Wordle Space (staged as ``make spaces`` stages it) run as a local process: create,
secret and variable, upload, BUILDING -> RUNNING, its domain answers, the secret reaches the
process's environment and no answer or log, pause stops it; an unknown Space and a read-only token
fail the way the client expects."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from fastapi import FastAPI, HTTPException, Request

from tools.local_hub.spaces import spaces_router
from tools.space_stage import stage_space
from trainer.local.ports import free_port

from .conftest import REPO_ROOT

hf = pytest.importorskip("huggingface_hub")
uvicorn = pytest.importorskip("uvicorn")

WRITE, READ = "hf_local_write_alice", "hf_local_read_alice"
SECRET = "s3cret-value-never-shown-7f3a"
START_TIMEOUT_S = 90.0


class StubAccounts:
    """``Accounts.authorize`` of tools/local_hub/accounts.py, for two tokens of user alice."""

    tokens = {WRITE: ("alice", "write"), READ: ("alice", "read")}

    def authorize(self, request: Request, *, write: bool, resource: str | None = None) -> str:
        auth = request.headers.get("authorization", "")
        user, role = self.tokens.get(auth[7:].strip(), (None, None))
        if not auth.lower().startswith("bearer ") or user is None:
            raise HTTPException(401, "Invalid credentials in Authorization header")
        owner = resource.split(":", 1)[1].split("/")[0] if resource else None
        if write and (role != "write" or owner not in (None, user)):
            raise HTTPException(403, f"no write access to {resource}")
        return user


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(url, router) of a local Hub serving the Space routes on 127.0.0.1."""
    root = tmp_path_factory.mktemp("local-hub")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    accounts = StubAccounts()
    accounts.root = root  # the Spaces' fronts read the tokens from root/tokens.json
    (root / "tokens.json").write_text(
        json.dumps(
            [
                {"name": f"alice-{role}", "value": value, "user": user, "role": role}
                for value, (user, role) in StubAccounts.tokens.items()
            ]
        )
    )
    router = spaces_router(accounts, root / "spaces", url, {"WORDLE_HOST": "127.0.0.1"})
    app = FastAPI()
    app.include_router(router)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the local Hub did not start"
        time.sleep(0.05)
    try:
        yield url, router
    finally:
        router.stop_all()
        server.should_exit = True
        thread.join(10)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def wait_stage(api, repo_id: str, want: str, seen: list[str]):
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        rt = api.get_space_runtime(repo_id)
        if not seen or seen[-1] != rt.stage:
            seen.append(str(rt.stage))
        if rt.stage == want:
            return rt
        assert rt.stage in ("BUILDING", want), f"expected {want}, found {seen}: {rt.raw}"
        assert time.monotonic() < deadline, f"not {want} after {START_TIMEOUT_S}s: {seen}"
        time.sleep(0.2)


def test_a_space_runs_as_a_local_process(hub, tmp_path):
    url, router = hub
    api = hf.HfApi(endpoint=url, token=WRITE)
    assert api.whoami()["name"] == "alice"
    repo_id = "alice/deltasync-wordle"
    for _ in range(2):  # the second: 409, which exist_ok swallows
        api.create_repo(repo_id, repo_type="space", space_sdk="docker", private=True, exist_ok=True)
    assert api.get_space_runtime(repo_id).stage == "NO_APP_FILE"
    api.add_space_secret(repo_id, "SPACE_TEST_SECRET", SECRET)
    variables = api.add_space_variable(repo_id, "SPACE_TEST_VAR", "plain-value")
    assert variables["SPACE_TEST_VAR"].value == "plain-value"
    api.request_space_hardware(repo_id, "cpu-basic")

    stage_space(REPO_ROOT, "spaces/wordle-env", str(tmp_path / "stage"), own_context=True)
    api.upload_folder(repo_id=repo_id, repo_type="space", folder_path=str(tmp_path / "stage"))
    seen: list[str] = []
    rt = wait_stage(api, repo_id, "RUNNING", seen)
    assert seen[0] == "BUILDING", seen
    (domain,) = rt.raw["domains"]
    assert domain["stage"] == "READY" and domain["domain"].startswith("127.0.0.1:")
    # the domain is the Space's front: a private Space needs a token that may read it
    health = f"http://{domain['domain']}/health"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(health, timeout=5)
    assert refused.value.code == 401
    request = urllib.request.Request(health, headers={"Authorization": f"Bearer {READ}"})
    with urllib.request.urlopen(request, timeout=5) as r:
        assert r.status == 200
    run = router.store.runner._runs[repo_id]
    assert run.app_port != run.port == int(domain["domain"].split(":")[1])

    # the secret reached the app's environment (the front's child), and nothing the Hub answers
    # or logs
    if sys.platform.startswith("linux"):
        app_pid = next(
            int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == run.proc.pid
        )
        with open(f"/proc/{app_pid}/environ", "rb") as f:
            env = dict(e.decode().partition("=")[::2] for e in f.read().split(b"\0") if e)
        assert env["SPACE_TEST_SECRET"] == SECRET and env["SPACE_TEST_VAR"] == "plain-value"
        assert env["HF_ENDPOINT"] == url and env["SPACE_ID"] == repo_id
        assert env["SPACE_HOST"] == domain["domain"] and env["PORT"] == str(run.app_port)
    assert set(api.get_space_secrets(repo_id)) == {"SPACE_TEST_SECRET"}
    assert "SPACE_TEST_SECRET" not in api.get_space_variables(repo_id)
    shown = [
        json.dumps(rt.raw),
        json.dumps(api.get_space_runtime(repo_id).raw),
        repr(api.get_space_secrets(repo_id)),
        repr(api.space_info(repo_id)),
        router.store.runner.log_path(repo_id).read_text(),
    ]
    assert not any(SECRET in s for s in shown)

    paused = api.pause_space(repo_id)
    assert paused.stage == "PAUSED"
    assert api.get_space_runtime(repo_id).stage == "PAUSED"
    assert not answers(health)

    api.restart_space(repo_id)
    rt = wait_stage(api, repo_id, "RUNNING", [])
    assert rt.raw["domains"] == [domain], "expected the Space to keep its port"


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_unknown_space_and_read_only_token(hub):
    url, _ = hub
    api = hf.HfApi(endpoint=url, token=WRITE)
    with pytest.raises(hf.errors.RepositoryNotFoundError):
        api.get_space_runtime("alice/no-such-space")
    with pytest.raises(hf.errors.HfHubHTTPError) as e:
        hf.HfApi(endpoint=url, token=READ).create_repo(
            "alice/read-only", repo_type="space", space_sdk="docker"
        )
    assert e.value.response.status_code == 403
    with pytest.raises(hf.errors.RepositoryNotFoundError):
        api.get_space_runtime("alice/read-only")


def test_runtime_url_follows_the_domains_the_hub_reports():
    from tools.space_stage import runtime_url

    assert runtime_url("Al_ice", "x.y", {"stage": "RUNNING"}) == "https://al-ice-x-y.hf.space"
    hub = {"domains": [{"domain": "alice-x.hf.space", "stage": "READY"}]}
    assert runtime_url("alice", "x", hub) == "https://alice-x.hf.space"
    local = {
        "domains": [
            {"domain": "127.0.0.1:1111", "stage": "PENDING"},
            {"domain": "localhost:2222", "stage": "READY"},
        ]
    }
    assert runtime_url("alice", "x", local) == "http://localhost:2222"
    assert runtime_url("a", "x", {"domains": [{"domain": "127.0.0.1:5", "stage": "PENDING"}]}) == (
        "http://127.0.0.1:5"
    )


def test_deploy_prints_the_urls_the_hub_reports(make_deployer):
    """After every Space is RUNNING, the printed URLs and the `make train` line are the domains
    of each Space's runtime (a local Hub's http://127.0.0.1:PORT), not *.hf.space."""
    import io
    from types import SimpleNamespace

    from .conftest import FakeHfApi

    ports = {"alice/deltasync-rollout": 4001, "alice/deltasync-wordle": 4002}

    class DomainsApi(FakeHfApi):
        def get_space_runtime(self, repo_id, *, token=None):
            rt = super().get_space_runtime(repo_id, token=token)
            raw = dict(rt.raw)
            if repo_id in ports and rt.stage == "RUNNING":
                raw["domains"] = [{"domain": f"127.0.0.1:{ports[repo_id]}", "stage": "READY"}]
            return SimpleNamespace(stage=rt.stage, hardware=None, raw=raw)

    out = io.StringIO()
    line = make_deployer(api=DomainsApi(), out=out, bucket="alice/run").run()
    assert "VLLM_URL=http://127.0.0.1:4001 ENV_URL=http://127.0.0.1:4002" in line
    text = out.getvalue()
    assert "rollout: http://127.0.0.1:4001" in text and "wordle: http://127.0.0.1:4002" in text
    assert "dashboard: https://alice-deltasync-dashboard.hf.space" in text  # no domains: fallback
