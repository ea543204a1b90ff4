"""Fixtures of the deploy tests: a recording fake of huggingface_hub's HfApi, a fake clock, and
each Space's image built under tmp_path (``image``, see dockerfile_image.py).

No test here touches the network: the deployer gets the fake injected, and its waits run on the
fake clock.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tools.deploy_spaces import Deployer
from tools.space_config import DeployConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "hf_TESTTOKEN_never_printed_0123456789"
CONTROL = "control-token-never-printed-42"


class FakeClock:
    """monotonic() and sleep() that advance only when slept."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class FakeHfApi:
    """Records every call as (method, kwargs); ``upload_folder`` also records the uploaded files
    (relative paths) and their text for README.md / Dockerfile. ``stages`` scripts what
    ``get_space_runtime`` returns per repo id (the last stage repeats)."""

    def __init__(self, owner: str = "alice", stages: dict[str, list[str]] | None = None):
        self.owner = owner
        self.calls: list[tuple[str, dict]] = []
        self.uploads: dict[str, dict[str, str | None]] = {}  # repo_id -> {path: text or None}
        self.stages = stages or {}
        self.private: dict[str, bool] = {}  # repo or bucket id -> private, as the Hub keeps it
        self._seen: dict[str, int] = {}

    def whoami(self, token=None):
        self.calls.append(("whoami", {}))
        return {"name": self.owner, "type": "user"}

    def _record(name):
        def method(self, *args, **kwargs):
            assert not args, f"{name} must be called with keyword arguments, got {args}"
            self.calls.append((name, kwargs))
            return SimpleNamespace(**kwargs)

        return method

    def _created(name, id_key):
        """Records the call; a new repo gets the visibility asked for, an existing one
        (``exist_ok``) keeps its own, as on the Hub."""

        def method(self, **kwargs):
            self.calls.append((name, kwargs))
            self.private.setdefault(kwargs[id_key], kwargs["private"])
            return SimpleNamespace(**kwargs)

        return method

    create_bucket = _created("create_bucket", "bucket_id")
    create_repo = _created("create_repo", "repo_id")
    duplicate_repo = _created("duplicate_repo", "to_id")

    def space_info(self, repo_id, **kwargs):
        self.calls.append(("space_info", {"repo_id": repo_id}))
        return SimpleNamespace(id=repo_id, private=self.private[repo_id])

    def bucket_info(self, bucket_id, **kwargs):
        self.calls.append(("bucket_info", {"bucket_id": bucket_id}))
        return SimpleNamespace(id=bucket_id, private=self.private[bucket_id])

    def update_repo_settings(self, **kwargs):
        self.calls.append(("update_repo_settings", kwargs))
        self.private[kwargs["repo_id"]] = kwargs["private"]

    def update_bucket_settings(self, **kwargs):
        self.calls.append(("update_bucket_settings", kwargs))
        self.private[kwargs["bucket_id"]] = kwargs["private"]

    add_space_secret = _record("add_space_secret")
    add_space_variable = _record("add_space_variable")
    request_space_hardware = _record("request_space_hardware")
    pause_space = _record("pause_space")
    delete_space_secret = _record("delete_space_secret")

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        root = kwargs["folder_path"]
        files: dict[str, str | None] = {}
        for d, _, names in os.walk(root):
            for n in names:
                rel = os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
                text = None
                if rel in ("README.md", "Dockerfile"):
                    with open(os.path.join(d, n), encoding="utf-8") as f:
                        text = f.read()
                files[rel] = text
        self.uploads[kwargs["repo_id"]] = files
        return SimpleNamespace(commit_url="https://huggingface.co/fake/commit")

    def get_space_runtime(self, repo_id, *, token=None):
        self.calls.append(("get_space_runtime", {"repo_id": repo_id}))
        script = self.stages.get(repo_id, ["BUILDING", "APP_STARTING", "RUNNING"])
        i = self._seen.get(repo_id, 0)
        self._seen[repo_id] = i + 1
        stage = script[min(i, len(script) - 1)]
        raw = {"stage": stage}
        if stage.endswith("ERROR"):
            raw["errorMessage"] = f"fake {stage.lower()} message"
        return SimpleNamespace(stage=stage, hardware=None, raw=raw)

    def names(self) -> list[str]:
        return [n for n, _ in self.calls if n != "get_space_runtime"]


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def make_deployer(tmp_path, clock):
    """make_deployer(api=None, out=None, **config) -> a Deployer on the fake clock that uploads
    from this checkout and keeps a generated CONTROL_TOKEN file under tmp_path."""

    def make(api=None, out=None, **kw):
        kw.setdefault("token", TOKEN)
        kw.setdefault("control_token", CONTROL)
        kw.setdefault("repo_root", REPO_ROOT)
        kw.setdefault("check_every_s", 5.0)
        kw.setdefault("state_dir", str(tmp_path / "state"))
        cfg = DeployConfig(**kw)
        return Deployer(cfg, api=api, out=out, sleep=clock.sleep, clock=clock.monotonic)

    return make


@pytest.fixture
def image(tmp_path):
    # imported here: dockerfile_image imports REPO_ROOT from this module
    from .dockerfile_image import Image, build_image, dockerfile

    def make(key: str) -> Image:
        return build_image(dockerfile(key), str(tmp_path / "image"))

    return make
