"""The local Hub's Space routes: what huggingface_hub 2.4.0's ``HfApi`` sends for the calls of
``make spaces`` (``tools/deploy_spaces.py``), answered as the Hub answers them, with Docker Spaces
run as local processes (``space_runner.py``).

| client call (hf_api.py) | request | answer |
|---|---|---|
| ``whoami`` (``_inner_whoami``) | ``GET /api/whoami-v2`` | ``{type, name, fullname, orgs, auth}`` |
| ``create_repo(repo_type="space")`` | ``POST /api/repos/create`` ``{name, organization, visibility, type, sdk, hardware?, sleepTimeSeconds?, secrets?, variables?}`` | ``{url, name}``; existing: 409 (``exist_ok`` swallows it) |
| ``upload_folder`` (README.md check, ``_validate_yaml``) | ``POST /api/validate-yaml`` ``{content, repoType}`` | ``{errors: [], warnings: []}`` |
| ``upload_folder`` (``_commit_api._fetch_upload_modes``) | ``POST /api/spaces/{id}/preupload/{rev}`` ``{files: [{path, sample, size}]}`` | ``{files: [{path, uploadMode: "regular", shouldIgnore, oid}]}``: every file is "regular", so the commit carries base64 content and no LFS/Xet transfer happens; ``oid``: the git blob sha1 of the stored file, so unchanged files are not committed again |
| ``upload_folder`` (``_commit_api._send_commit``) | ``POST /api/spaces/{id}/commit/{rev}`` NDJSON: ``header``, ``file`` (base64), ``deletedFile``, ``deletedFolder`` | ``{commitUrl, commitOid, success, pullRequestUrl}``; the Space rebuilds |
| ``space_info``/``repo_info`` (``upload_folder`` when nothing changed, ``create_repo`` after a 403) | ``GET /api/spaces/{id}[/revision/{rev}]`` | ``{id, author, sha, private, sdk, siblings, runtime, ...}`` |
| ``add_space_secret`` / ``delete_space_secret`` / ``get_space_secrets`` | ``POST``/``DELETE``/``GET /api/spaces/{id}/secrets`` | values are never returned |
| ``add_space_variable`` / ``delete_space_variable`` / ``get_space_variables`` | ``POST``/``DELETE``/``GET /api/spaces/{id}/variables`` | ``{key: {value, description, updatedAt}}`` |
| ``request_space_hardware`` | ``POST /api/spaces/{id}/hardware`` ``{flavor, sleepTimeSeconds?}`` | runtime |
| ``set_space_sleep_time`` | ``POST /api/spaces/{id}/sleeptime`` ``{seconds}`` | runtime |
| ``get_space_runtime`` | ``GET /api/spaces/{id}/runtime`` | runtime |
| ``pause_space`` / ``restart_space`` | ``POST /api/spaces/{id}/pause`` / ``restart`` | runtime |

The runtime (``_space_api.SpaceRuntime`` parses it): ``{stage, hardware: {current, requested},
gcTimeout, storage, devMode, replicas, sdk, domains, errorMessage?}``; ``domains`` lists
``{"domain": "127.0.0.1:PORT", "stage": "READY"|"PENDING"}`` as the Hub lists
``{"domain": "<owner>-<name>.hf.space", "stage": "READY"}``: the Space's front
(``space_front.py``), where a private Space's visitors must send ``Authorization: Bearer
<token>`` with read access to it (401 without one, 404 with another user's), as at the Hub's
``*.hf.space``; a public Space's front is open.

Errors: an unknown Space (or another user's private one) is 404 with ``X-Error-Code:
RepoNotFound`` (the client raises ``RepositoryNotFoundError``); 401/403 come from
``Accounts.authorize`` on every route.

State: ``<root>/<owner>/<name>/space.json`` (mode 0600: it holds the secrets, which a Hub restart
keeps) and ``files/`` (the uploaded tree); the runner's build tree and ``logs/run.log`` beside
them. After a restart of the Hub, Spaces that were not paused start again.

Left out: model/dataset repos, branches other than ``main``, pull requests (``create_pr``), LFS
and Xet file uploads (``preupload`` never asks for them), ``.gitignore`` rules, git history (one
commit id, the latest), ``duplicate_repo``, sleeping after ``gcTimeout`` of inactivity,
organizations, dev mode, volumes and Space logs over HTTP (they are files under root).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from .space_runner import SpaceRunner

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
FREE_HARDWARE = "cpu-basic"
FREE_SLEEP_S = 172800  # the Hub's fixed 48 h on cpu-basic
SDKS = ("gradio", "docker", "static", "streamlit")


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def _hardware_flavors() -> set[str]:
    from huggingface_hub import SpaceHardware

    return {h.value for h in SpaceHardware}


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of ``data`` (what ``CommitOperationAdd._local_oid`` computes for a regular
    file, via ``utils.sha.git_hash``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def not_found(repo_id: str) -> JSONResponse:
    """The Hub's 404 for a Space that does not exist or that the caller may not see."""
    return JSONResponse(
        {"error": "Repository not found"},
        status_code=404,
        headers={"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
    )


class SpaceStore:
    """The Spaces' state on disk (one ``space.json`` per Space plus its uploaded files) and
    their processes (:class:`SpaceRunner`).

    Args:
        root: folder of the Spaces (``<root>/<owner>/<name>/``).
        hub_url: the local Hub's URL (in answers, and the Spaces' ``HF_ENDPOINT``).
        space_env: extra environment for every Space process (see :class:`SpaceRunner`).
    """

    def __init__(
        self,
        root: Path,
        hub_url: str,
        space_env: dict[str, str] | None = None,
        tokens_path: Path | None = None,
    ):
        self.root = Path(root)
        self.hub_url = hub_url.rstrip("/")
        self.runner = SpaceRunner(self.root, hub_url, space_env, tokens_path=tokens_path)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ disk
    def dir(self, repo_id: str) -> Path:
        """The folder of Space ``repo_id``."""
        return self.root / repo_id

    def files_dir(self, repo_id: str) -> Path:
        """The Space's uploaded tree (the Docker build context)."""
        return self.dir(repo_id) / "files"

    def load(self, repo_id: str) -> dict | None:
        """The Space's state, None when it does not exist."""
        try:
            return json.loads((self.dir(repo_id) / "space.json").read_text())
        except FileNotFoundError:
            return None

    def save(self, repo_id: str, state: dict) -> None:
        """Write the Space's state atomically, mode 0600 (it holds secret values)."""
        d = self.dir(repo_id)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "space.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, d / "space.json")

    def all_ids(self) -> list[str]:
        """Every stored Space's id."""
        return sorted(
            f"{p.parent.parent.name}/{p.parent.name}" for p in self.root.glob("*/*/space.json")
        )

    # ------------------------------------------------------------------ processes
    def has_app(self, repo_id: str) -> bool:
        """Whether anything was uploaded."""
        d = self.files_dir(repo_id)
        return d.is_dir() and any(d.iterdir())

    def rebuild(self, repo_id: str, state: dict) -> None:
        """(Re)start the Space's process, as the Hub rebuilds after a change; nothing when no
        files were uploaded or it is paused."""
        if state.get("paused") or not self.has_app(repo_id):
            return
        env = {k: v["value"] for k, v in state.get("variables", {}).items()}
        env.update({k: v["value"] for k, v in state.get("secrets", {}).items()})
        self.runner.start(
            repo_id,
            self.files_dir(repo_id),
            env,
            state.get("port"),
            private=bool(state.get("private")),
        )

    def resume_all(self) -> None:
        """Start every stored Space that is not paused (a Hub restart)."""
        for repo_id in self.all_ids():
            state = self.load(repo_id)
            if state and (state.get("paused") or not self.runner.adopt(repo_id)):
                self.rebuild(repo_id, state)

    def runtime(self, repo_id: str, state: dict) -> dict:
        """The Space's runtime as ``GET /api/spaces/{id}/runtime`` answers it."""
        stage, error, port = self.runner.stage(repo_id)
        if state.get("paused"):
            stage, error = "PAUSED", None
        elif not self.has_app(repo_id):
            stage = "NO_APP_FILE"
        elif stage is None:
            stage = "BUILDING"  # a rebuild is about to be requested
        if port and port != state.get("port"):
            with self._lock:
                fresh = self.load(repo_id) or state
                fresh["port"] = port
                self.save(repo_id, fresh)
        requested = state.get("hardware")
        running = stage in ("RUNNING", "BUILDING", "RUNTIME_ERROR") and port is not None
        sleep = state.get("sleepTimeSeconds")
        if requested in (None, FREE_HARDWARE):
            sleep = FREE_SLEEP_S
        raw: dict[str, Any] = {
            "stage": stage,
            "hardware": {"current": requested if running else None, "requested": requested},
            "gcTimeout": sleep,
            "storage": None,
            "devMode": False,
            "replicas": {"current": 1 if running else 0, "requested": 1},
            "sdk": state.get("sdk", "docker"),
            "domains": [],
        }
        if port is not None and stage not in ("PAUSED", "NO_APP_FILE"):
            ready = "READY" if stage == "RUNNING" else "PENDING"
            raw["domains"] = [{"domain": f"127.0.0.1:{port}", "stage": ready}]
        if error:
            raw["errorMessage"] = error
        return raw

    # ------------------------------------------------------------------ commits
    def commit(self, repo_id: str, state: dict, body: bytes) -> dict:
        """Apply a commit NDJSON (``_commit_api._prepare_commit_payload``) to the stored files.

        Raises:
            HTTPException: 400 for a malformed line, an LFS file, or a path leaving the repo;
                412 when ``parentCommit`` is not the head.
        """
        lines = [json.loads(ln) for ln in body.decode("utf-8").splitlines() if ln.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HTTPException(400, "expected the commit's header line first")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent and parent != state.get("sha"):
            raise HTTPException(412, f"parentCommit {parent} is not the head of main")
        files = self.files_dir(repo_id)
        ops = []
        for item in lines[1:]:
            key, value = item.get("key"), item.get("value") or {}
            path = _safe_path(value.get("path", ""))
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HTTPException(400, f"expected base64 content for {path}")
                ops.append(("add", path, base64.b64decode(value["content"])))
            elif key in ("deletedFile", "deletedFolder"):
                ops.append(("delete", path, None))
            elif key == "lfsFile":
                raise HTTPException(
                    400, f"{path}: LFS files are not accepted here (preupload said 'regular')"
                )
            else:
                raise HTTPException(400, f"unknown commit operation {key!r}")
        for op, path, data in ops:
            target = files / path
            if op == "add":
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            elif target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        digest = hashlib.sha1((state.get("sha") or "").encode())
        digest.update(body)
        digest.update(str(time.time_ns()).encode())
        state["sha"] = digest.hexdigest()
        state["lastModified"] = _now()
        state["lastCommit"] = {"summary": header.get("summary", ""), "oid": state["sha"]}
        return state


def _safe_path(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise HTTPException(400, f"invalid path in repo: {path!r}")
    return "/".join(parts)


def spaces_router(accounts, root: Path, hub_url: str, space_env: dict[str, str]) -> APIRouter:
    """The Space routes of the local Hub (see the module docstring), over ``accounts``
    (``Accounts.authorize`` on every route), with state under ``root``.

    The returned router carries ``store`` (:class:`SpaceStore`) and ``stop_all()`` (stops every
    Space process: call it at the Hub's shutdown). Stored Spaces that are not paused start again
    now (a Hub restart keeps them running).
    """
    tokens = getattr(accounts, "root", None)
    store = SpaceStore(
        Path(root), hub_url, space_env, None if tokens is None else Path(tokens) / "tokens.json"
    )
    r = APIRouter()
    lock = store._lock

    def space_url(repo_id: str) -> str:
        return f"{store.hub_url}/spaces/{repo_id}"

    def get(request: Request, owner: str, name: str, *, write: bool) -> tuple[str, dict | None]:
        """(repo_id, state or None when the caller may not see it) after authorizing."""
        repo_id = f"{owner}/{name}"
        user = accounts.authorize(request, write=write, resource=f"space:{repo_id}")
        state = store.load(repo_id)
        if state is not None and state.get("private") and user != owner:
            state = None  # another user's private Space: the Hub answers 404
        return repo_id, state

    # -------------------------------------------------------------- account
    @r.get("/api/whoami-v2")
    def whoami(request: Request):
        """``HfApi.whoami`` (``_inner_whoami``)."""
        user = accounts.authorize(request, write=False, resource=None)
        try:
            accounts.authorize(request, write=True, resource=None)
            role = "write"
        except HTTPException:
            role = "read"
        return {
            "type": "user",
            "id": hashlib.sha1(user.encode()).hexdigest()[:24],
            "name": user,
            "fullname": user,
            "email": None,
            "emailVerified": False,
            "isPro": False,
            "orgs": [],
            "auth": {"type": "access_token", "accessToken": {"displayName": "local", "role": role}},
        }

    # -------------------------------------------------------------- repos
    @r.post("/api/repos/create")
    async def create_repo(request: Request):
        """``HfApi.create_repo``: Spaces only. 409 when it exists (``exist_ok`` then passes)."""
        body = await request.json()
        name, owner = body.get("name"), body.get("organization")
        if owner is None:
            owner = accounts.authorize(request, write=True, resource=None)
        if not (isinstance(name, str) and NAME_RE.match(name) and NAME_RE.match(owner or "")):
            raise HTTPException(400, f"invalid repo name {owner}/{name}")
        repo_id = f"{owner}/{name}"
        accounts.authorize(request, write=True, resource=f"space:{repo_id}")
        if body.get("type") != "space":
            raise HTTPException(400, "this local Hub creates Spaces only (type: space)")
        sdk = body.get("sdk")
        if sdk not in SDKS:
            raise HTTPException(400, f"expected sdk in {SDKS}, found {sdk!r}")
        hardware = body.get("hardware") or FREE_HARDWARE
        if hardware not in _hardware_flavors():
            raise HTTPException(400, f"unknown hardware flavor {hardware!r}")
        with lock:
            if store.load(repo_id) is not None:
                return JSONResponse(
                    {"error": "You already created this space repo", "url": space_url(repo_id)},
                    status_code=409,
                )
            now = _now()
            state = {
                "id": repo_id,
                "private": body.get("visibility", "public") != "public",
                "sdk": sdk,
                "createdAt": now,
                "lastModified": now,
                "sha": None,
                "hardware": hardware,
                "sleepTimeSeconds": body.get("sleepTimeSeconds"),
                "variables": {
                    v["key"]: {
                        "value": v["value"],
                        "description": v.get("description"),
                        "updatedAt": now,
                    }
                    for v in body.get("variables") or []
                },
                "secrets": {
                    s["key"]: {
                        "value": s["value"],
                        "description": s.get("description"),
                        "updatedAt": now,
                    }
                    for s in body.get("secrets") or []
                },
                "paused": False,
                "port": None,
            }
            store.save(repo_id, state)
            store.files_dir(repo_id).mkdir(parents=True, exist_ok=True)
        return {"url": space_url(repo_id), "name": repo_id, "id": repo_id}

    @r.post("/api/validate-yaml")
    async def validate_yaml(request: Request):
        """``HfApi._validate_yaml`` (``upload_folder`` with a README.md): always valid here."""
        accounts.authorize(request, write=False, resource=None)
        return {"errors": [], "warnings": []}

    def info(repo_id: str, state: dict) -> dict:
        files = store.files_dir(repo_id)
        siblings = (
            sorted(p.relative_to(files).as_posix() for p in files.rglob("*") if p.is_file())
            if files.is_dir()
            else []
        )
        return {
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": state.get("sha"),
            "private": state.get("private", False),
            "disabled": False,
            "gated": False,
            "likes": 0,
            "sdk": state.get("sdk"),
            "tags": [state.get("sdk"), "region:us"],
            "createdAt": state.get("createdAt"),
            "lastModified": state.get("lastModified"),
            "siblings": [{"rfilename": s} for s in siblings],
            "runtime": store.runtime(repo_id, state),
            "subdomain": repo_id.replace("/", "-").lower(),
        }

    @r.get("/api/spaces/{owner}/{name}")
    def space_info(owner: str, name: str, request: Request):
        """``HfApi.space_info`` without a revision."""
        repo_id, state = get(request, owner, name, write=False)
        return not_found(repo_id) if state is None else info(repo_id, state)

    @r.get("/api/spaces/{owner}/{name}/revision/{revision:path}")
    def space_info_revision(owner: str, name: str, revision: str, request: Request):
        """``HfApi.space_info``/``repo_info`` at a revision (``main`` or the head's sha)."""
        repo_id, state = get(request, owner, name, write=False)
        if state is None:
            return not_found(repo_id)
        if revision not in ("main", state.get("sha")):
            return JSONResponse(
                {"error": f"Invalid rev id: {revision}"},
                status_code=404,
                headers={"X-Error-Code": "RevisionNotFound"},
            )
        return info(repo_id, state)

    # -------------------------------------------------------------- upload
    def check_main(revision: str, request: Request) -> None:
        if revision != "main" or request.query_params.get("create_pr"):
            raise HTTPException(400, "this local Hub commits to main only (no pull requests)")

    @r.post("/api/spaces/{owner}/{name}/preupload/{revision}")
    async def preupload(owner: str, name: str, revision: str, request: Request):
        """``_commit_api._fetch_upload_modes``: every file "regular" (base64 in the commit)."""
        repo_id, state = get(request, owner, name, write=True)
        if state is None:
            return not_found(repo_id)
        check_main(revision, request)
        body = await request.json()
        files = store.files_dir(repo_id)
        out = []
        for f in body.get("files", []):
            path = _safe_path(f["path"])
            target = files / path
            oid = git_blob_sha1(target.read_bytes()) if target.is_file() else None
            out.append(
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid}
            )
        return {"files": out, "commitOid": state.get("sha")}

    @r.post("/api/spaces/{owner}/{name}/commit/{revision}")
    async def commit(owner: str, name: str, revision: str, request: Request):
        """``_commit_api._send_commit``: apply the NDJSON, then rebuild the Space."""
        repo_id, state = get(request, owner, name, write=True)
        if state is None:
            return not_found(repo_id)
        check_main(revision, request)
        body = await request.body()
        with lock:
            state = store.commit(repo_id, store.load(repo_id) or state, body)
            store.save(repo_id, state)
        store.rebuild(repo_id, state)
        sha = state["sha"]
        return {
            "success": True,
            "commitOid": sha,
            "commitUrl": f"{space_url(repo_id)}/commit/{sha}",
            "pullRequestUrl": None,
        }

    # -------------------------------------------------------------- secrets, variables
    def settings_route(kind: str):
        async def add(owner: str, name: str, request: Request):
            repo_id, state = get(request, owner, name, write=True)
            if state is None:
                return not_found(repo_id)
            body = await request.json()
            key, value = body.get("key"), body.get("value")
            if not (isinstance(key, str) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key)):
                raise HTTPException(400, f"invalid {kind[:-1]} key {key!r}")
            if not isinstance(value, str):
                raise HTTPException(400, f"expected a string value for {key}")
            with lock:
                state = store.load(repo_id)
                old = state[kind].get(key)
                state[kind][key] = {
                    "value": value,
                    "description": body.get("description"),
                    "updatedAt": _now(),
                }
                store.save(repo_id, state)
            if old is None or old["value"] != value:
                store.rebuild(repo_id, state)
            return listing(kind, state)

        async def delete(owner: str, name: str, request: Request):
            repo_id, state = get(request, owner, name, write=True)
            if state is None:
                return not_found(repo_id)
            body = await request.json()
            with lock:
                state = store.load(repo_id)
                removed = state[kind].pop(body.get("key"), None)
                store.save(repo_id, state)
            if removed is not None:
                store.rebuild(repo_id, state)
            return listing(kind, state)

        def list_(owner: str, name: str, request: Request):
            repo_id, state = get(request, owner, name, write=kind == "secrets")
            return not_found(repo_id) if state is None else listing(kind, state)

        add.__doc__ = f"``HfApi.add_space_{kind[:-1]}``; the Space restarts when it changed."
        delete.__doc__ = f"``HfApi.delete_space_{kind[:-1]}``; the Space restarts."
        list_.__doc__ = f"``HfApi.get_space_{kind}``" + (
            " (never the values)." if kind == "secrets" else "."
        )
        path = f"/api/spaces/{{owner}}/{{name}}/{kind}"
        r.add_api_route(path, add, methods=["POST"])
        r.add_api_route(path, delete, methods=["DELETE"])
        r.add_api_route(path, list_, methods=["GET"])

    def listing(kind: str, state: dict) -> dict:
        if kind == "secrets":  # write-only: key, description, updatedAt
            return {
                k: {"description": v.get("description"), "updatedAt": v["updatedAt"]}
                for k, v in state["secrets"].items()
            }
        return {k: dict(v) for k, v in state["variables"].items()}

    settings_route("secrets")
    settings_route("variables")

    # -------------------------------------------------------------- runtime
    @r.get("/api/spaces/{owner}/{name}/runtime")
    def runtime(owner: str, name: str, request: Request):
        """``HfApi.get_space_runtime``."""
        repo_id, state = get(request, owner, name, write=False)
        return not_found(repo_id) if state is None else store.runtime(repo_id, state)

    @r.post("/api/spaces/{owner}/{name}/hardware")
    async def hardware(owner: str, name: str, request: Request):
        """``HfApi.request_space_hardware`` (with ``sleepTimeSeconds``); a new flavor restarts
        the Space, as the Hub moves it."""
        repo_id, state = get(request, owner, name, write=True)
        if state is None:
            return not_found(repo_id)
        body = await request.json()
        flavor = body.get("flavor")
        if flavor not in _hardware_flavors():
            raise HTTPException(400, f"unknown hardware flavor {flavor!r}")
        with lock:
            state = store.load(repo_id)
            changed = state.get("hardware") != flavor
            state["hardware"] = flavor
            if body.get("sleepTimeSeconds") is not None:
                state["sleepTimeSeconds"] = int(body["sleepTimeSeconds"])
            store.save(repo_id, state)
        if changed:
            store.rebuild(repo_id, state)
        return store.runtime(repo_id, state)

    @r.post("/api/spaces/{owner}/{name}/sleeptime")
    async def sleeptime(owner: str, name: str, request: Request):
        """``HfApi.set_space_sleep_time`` (stored and reported; nothing sleeps here)."""
        repo_id, state = get(request, owner, name, write=True)
        if state is None:
            return not_found(repo_id)
        body = await request.json()
        with lock:
            state = store.load(repo_id)
            state["sleepTimeSeconds"] = int(body["seconds"])
            store.save(repo_id, state)
        return store.runtime(repo_id, state)

    @r.post("/api/spaces/{owner}/{name}/pause")
    def pause(owner: str, name: str, request: Request):
        """``HfApi.pause_space``: the process is stopped (SIGTERM, then SIGKILL) before the
        answer, whose stage is PAUSED."""
        repo_id, state = get(request, owner, name, write=True)
        if state is None:
            return not_found(repo_id)
        with lock:
            state = store.load(repo_id)
            state["paused"] = True
            store.save(repo_id, state)
        store.runner.stop(repo_id)
        return store.runtime(repo_id, state)

    @r.post("/api/spaces/{owner}/{name}/restart")
    def restart(owner: str, name: str, request: Request):
        """``HfApi.restart_space`` (``factory=true`` changes nothing here): un-pauses and
        rebuilds."""
        repo_id, state = get(request, owner, name, write=True)
        if state is None:
            return not_found(repo_id)
        with lock:
            state = store.load(repo_id)
            state["paused"] = False
            store.save(repo_id, state)
        store.rebuild(repo_id, state)
        return store.runtime(repo_id, state)

    r.store = store  # type: ignore[attr-defined]
    r.stop_all = store.runner.stop_all  # type: ignore[attr-defined]
    store.resume_all()
    return r
