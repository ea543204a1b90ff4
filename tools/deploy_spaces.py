"""Deploy a run's bucket and its three Spaces to the Hugging Face Hub in one command.

``python -m tools.deploy_spaces`` (``make spaces``) with ``HF_TOKEN`` set:

1. creates the bucket ``<owner>/<bucket>`` (``create_bucket``, private by default);
2. creates the rollout (vLLM, GPU), Wordle and dashboard Spaces in ``<owner>``'s account as Docker
   Spaces (``create_repo``), or duplicates them from ``--from-owner``'s Spaces (``duplicate_repo``),
   private unless ``--public`` is given (clients then send ``Authorization: Bearer $HF_TOKEN``);
3. sets each Space's secrets (``HF_TOKEN``; ``CONTROL_TOKEN`` for the rollout Space) and variables
   (``DELTASYNC_STORE``/``BUCKET``, ``MODEL``, ``POLL_INTERVAL_S``), then requests its hardware,
   with a sleep time (default 1 hour of inactivity) on paid hardware such as the rollout GPU;
4. uploads each Space in the layout its Dockerfile expects: the Wordle Space's folder as it is (an
   OpenEnv environment, its own build context); the rollout and dashboard Spaces together with the
   ``deltasync`` package they install (the repository root's layout): ``Dockerfile`` and
   ``README.md`` (front matter) at the Space root, ``pyproject.toml``, ``shared/deltasync/`` and
   ``spaces/<space>/``;
5. waits until every Space reports RUNNING, then prints the ``make train ...`` line to run next.

Tokens, least privilege first: ``HF_TOKEN`` (the deploy token) creates everything; the Spaces get
``SPACE_HF_TOKEN`` (``--space-token``) as their ``HF_TOKEN`` secret, and the dashboard
``DASHBOARD_HF_TOKEN`` (``--dashboard-token``, read-only is enough) where given. Without them the
deploy token is reused and a warning says how to make a narrower one.

``--down`` (``make spaces-down``) pauses the rollout Space(s) so that they stop billing, and says
how to restart them.

``--dry-run`` prints every Hub call it would make (secrets masked) and makes none. Secret values are
never printed, logged or written (the generated CONTROL_TOKEN alone is kept, in a 0600 file).
huggingface_hub is imported only when a deploy runs, so importing ``deltasync`` stays light.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from deltasync.errors import DeltaSyncError

MASK = "***"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
# Seconds of inactivity after which a Space on paid hardware sleeps (and stops billing).
DEFAULT_SLEEP_TIME_S = 3600
FREE_HARDWARE = ("cpu-basic",)  # sleeps after 48 h by itself; its sleep time cannot be set
TOKENS_URL = "https://huggingface.co/settings/tokens/new?tokenType=fineGrained"
# Stages after which a Space will not become RUNNING by itself.
FAILED_STAGES = ("BUILD_ERROR", "RUNTIME_ERROR", "CONFIG_ERROR", "NO_APP_FILE", "DELETING",
                 "STOPPED", "PAUSED")  # fmt: skip
_STAGE_IGNORE = (
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "*.nbi",
    "*.nbc",
    ".DS_Store",
    ".pytest_cache",
)


class DeployError(DeltaSyncError):
    """A deploy cannot start or a Space did not come up; the message says why and what to do."""


@dataclass(frozen=True)
class SpaceSpec:
    """One Space to deploy.

    Attributes:
        key: "rollout", "wordle" or "dashboard".
        folder: the Space's folder relative to the repository root (``spaces/<name>``).
        name: the Space repo's name in the owner's account.
        hardware: the flavor to request (``SpaceHardware`` value, e.g. "l4x1", "cpu-basic").
        variables: Space variables (plain environment variables, visible on the Hub).
        secrets: Space secrets by name; values are never printed.
        sleep_time_s: seconds of inactivity before the Space sleeps (stops billing); -1:
            never; None: the Hub's default (free hardware sleeps after 48 h, paid never).
        own_context: the folder is the whole Docker build context (the Wordle Space, an OpenEnv
            environment that needs nothing else of the repository); otherwise the context is the
            repository root (the Space installs the ``deltasync`` library from it).
    """

    key: str
    folder: str
    name: str
    hardware: str
    variables: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    sleep_time_s: int | None = None
    own_context: bool = False


@dataclass
class DeployConfig:
    """Settings of one deploy (``python -m tools.deploy_spaces --help`` lists the flags).

    Attributes:
        token: the Hugging Face token that creates everything (``HF_TOKEN``); never printed.
        owner: the account (user or org) to deploy into; None: the token's user (``whoami``).
        bucket: the bucket's name, or ``owner/name``; the run lives at the bucket's root.
        model: the model the rollout Space loads (its architecture must match the trainer's).
        prefix: Space names are ``<prefix>-rollout``, ``<prefix>-wordle``, ``<prefix>-dashboard``.
        rollout_hardware: GPU flavor of the rollout Space (vLLM needs a GPU on Spaces).
        wordle_hardware: flavor of the Wordle Space.
        dashboard_hardware: flavor of the dashboard Space.
        from_owner: duplicate ``<from_owner>/<space name>`` instead of creating and uploading.
        private_spaces: create private Spaces (the default: only the owner's tokens reach
            them, so clients send ``Authorization: Bearer $HF_TOKEN``); False (``--public``):
            anyone can reach them, and a public rollout Space lets anyone generate on its GPU.
        private_bucket: create the bucket private (the Spaces read it with their HF_TOKEN).
        space_token: the HF_TOKEN secret given to the Spaces (``SPACE_HF_TOKEN``): read and write
            on the bucket is enough (the rollout Space writes its heartbeat); None: ``token``,
            with a warning.
        dashboard_token: the dashboard's HF_TOKEN secret (``DASHBOARD_HF_TOKEN``; read access to
            the bucket is enough); None: ``space_token``.
        control_token: the rollout Space's CONTROL_TOKEN; None: generate one.
        poll_interval_s: the rollout Space's manifest poll interval in seconds.
        sleep_time_s: seconds of inactivity before a Space on paid hardware (the rollout
            GPU) sleeps and stops billing; a new visitor wakes it. -1: never sleep (it bills
            until paused); None: leave the Hub's setting.
        rollout_spaces: the Space names ``--down`` pauses; empty: ``<prefix>-rollout``.
        wait: wait until every Space is RUNNING.
        timeout_s: seconds to wait for all Spaces (a vLLM image build takes 10-30 minutes).
        check_every_s: seconds between runtime checks while waiting.
        grace_s: a stage seen within this many seconds of the upload, before the Space was seen
            building, may be the previous deploy's; it counts only after that.
        repo_root: the repository checkout holding ``pyproject.toml``, ``shared/``, ``spaces/``.
        state_dir: folder of the generated CONTROL_TOKEN file (mode 0600); None:
            ``<repo_root>/runs/spaces`` (git-ignored).
    """

    token: str | None = field(default=None, repr=False)
    owner: str | None = None
    bucket: str = "deltasync-run"
    model: str = DEFAULT_MODEL
    prefix: str = "deltasync"
    rollout_hardware: str = "l4x1"
    wordle_hardware: str = "cpu-basic"
    dashboard_hardware: str = "cpu-basic"
    from_owner: str | None = None
    private_spaces: bool = True
    private_bucket: bool = True
    space_token: str | None = field(default=None, repr=False)
    dashboard_token: str | None = field(default=None, repr=False)
    control_token: str | None = field(default=None, repr=False)
    poll_interval_s: float = 1.0
    sleep_time_s: int | None = DEFAULT_SLEEP_TIME_S
    rollout_spaces: tuple[str, ...] = ()
    wait: bool = True
    timeout_s: float = 3600.0
    check_every_s: float = 10.0
    grace_s: float = 60.0
    repo_root: str = "."
    state_dir: str | None = None

    def __post_init__(self):
        if self.poll_interval_s <= 0 or self.timeout_s <= 0 or self.check_every_s <= 0:
            raise ValueError(
                "expected poll_interval_s, timeout_s and check_every_s > 0, found "
                f"{self.poll_interval_s}, {self.timeout_s}, {self.check_every_s}"
            )
        if self.sleep_time_s is not None and self.sleep_time_s != -1 and self.sleep_time_s <= 0:
            raise ValueError(
                f"expected --sleep-time SECONDS > 0 (or -1: never sleep), found {self.sleep_time_s}"
            )
        if self.bucket.count("/") > 1 or not self.bucket.strip("/"):
            raise ValueError(f"expected --bucket NAME or OWNER/NAME, found {self.bucket!r}")
        if "/" in self.bucket:
            owner, _ = self.bucket.split("/")
            if self.owner and self.owner != owner:
                raise ValueError(
                    f"--bucket {self.bucket!r} names owner {owner!r} but --owner is "
                    f"{self.owner!r}; give one of them"
                )
            self.owner = owner

    @property
    def bucket_name(self) -> str:
        return self.bucket.split("/")[-1]


@dataclass
class HubCall:
    """One huggingface_hub ``HfApi`` call: method name and keyword arguments.

    ``secret`` names the arguments whose values are masked when the call is shown; ``stage`` is the
    Space whose upload folder is staged (as ``folder_path``) right before the call runs.
    """

    fn: str
    kwargs: dict[str, Any]
    secret: tuple[str, ...] = ()
    stage: SpaceSpec | None = None

    def render(self, staged: list[str] | None = None) -> str:
        """``fn(k=v, ...)`` with secrets masked; ``staged`` files summarised as ``folder_path``."""
        parts = []
        for k, v in self.kwargs.items():
            parts.append(f"{k}={MASK!r}" if k in self.secret else f"{k}={v!r}")
        if self.stage is not None:
            parts.insert(1, f"folder_path=<{summarize_files(staged or [])}>")
        return f"{self.fn}({', '.join(parts)})"


def space_url(owner: str, name: str) -> str:
    """The public URL of Space ``owner/name``: ``https://<owner>-<name>.hf.space``, lowercased,
    with ``_`` and ``.`` replaced by ``-``."""
    host = re.sub(r"[_.]", "-", f"{owner}-{name}".lower())
    return f"https://{host}.hf.space"


def summarize_files(files: list[str]) -> str:
    """'N files: Dockerfile, README.md, shared/ (k), ...' for a list of relative paths."""
    groups: dict[str, int] = {}
    for f in files:
        top = f.split("/", 2)
        key = (
            f if len(top) == 1 else (f"{top[0]}/{top[1]}/" if top[0] == "spaces" else f"{top[0]}/")
        )
        groups[key] = groups.get(key, 0) + 1
    shown = ", ".join(
        k if n == 1 and not k.endswith("/") else f"{k} ({n})" for k, n in groups.items()
    )
    return f"staged {len(files)} files: {shown}"


def read_front_matter(readme_text: str) -> dict[str, str]:
    """Top-level ``key: value`` pairs of a README's YAML front matter ({} without one)."""
    lines = readme_text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    out = {}
    for line in lines[1:]:
        if line.strip() == "---":
            return out
        m = re.match(r"^([A-Za-z_][\w-]*):\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    raise ValueError("README front matter opens with '---' but never closes")


def stage_space(repo_root: str, folder: str, dest: str, own_context: bool = False) -> list[str]:
    """Write the Space repo's layout for ``folder`` (e.g. ``spaces/vllm-rollout``) into ``dest``.

    With ``own_context`` the folder is the build context and becomes the Space root as it is.
    Otherwise the Space's Dockerfile builds from the repository root, so the Space root gets what
    that context has: ``pyproject.toml``, ``shared/deltasync/`` and ``spaces/<space>/``, plus the
    Space's ``Dockerfile``, ``Dockerfile.dockerignore`` and ``README.md`` at the root (the README's
    front matter configures the Space; it also serves as ``pyproject.toml``'s readme).

    Returns:
        The staged files, relative to ``dest`` with ``/``, sorted.

    Raises:
        DeployError: a required file is missing, or the README front matter is not a Docker Space
            on port 7860.
    """
    src = os.path.join(repo_root, folder)
    need = [f"{folder}/Dockerfile", f"{folder}/README.md"]
    if not own_context:
        need += ["pyproject.toml", "shared/deltasync/__init__.py"]
    missing = [p for p in need if not os.path.isfile(os.path.join(repo_root, p))]
    if missing:
        raise DeployError(
            f"expected {missing} under {os.path.abspath(repo_root)}: run from the repository "
            "root (a clone of deltasync) or pass --repo-root"
        )
    with open(os.path.join(src, "README.md"), encoding="utf-8") as f:
        meta = read_front_matter(f.read())
    if meta.get("sdk") != "docker" or meta.get("app_port") != "7860":
        raise DeployError(
            f"{folder}/README.md front matter: expected sdk: docker and app_port: 7860, found "
            f"sdk: {meta.get('sdk')!r}, app_port: {meta.get('app_port')!r}; fix the front matter"
        )
    ignore = shutil.ignore_patterns(*_STAGE_IGNORE)
    if own_context:
        shutil.copytree(src, dest, ignore=ignore, dirs_exist_ok=True)
    else:
        shutil.copy2(
            os.path.join(repo_root, "pyproject.toml"), os.path.join(dest, "pyproject.toml")
        )
        shutil.copytree(
            os.path.join(repo_root, "shared", "deltasync"),
            os.path.join(dest, "shared", "deltasync"),
            ignore=ignore,
        )
        shutil.copytree(src, os.path.join(dest, folder), ignore=ignore)
        for name in ("Dockerfile", "Dockerfile.dockerignore", "README.md"):
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(dest, name))
    files = []
    for root, _, names in os.walk(dest):
        for n in names:
            files.append(os.path.relpath(os.path.join(root, n), dest).replace(os.sep, "/"))
    return sorted(files)


def hub_api(token: str):
    """A ``huggingface_hub.HfApi`` for ``token`` (imported here, not at module import).

    Raises:
        DeployError: huggingface_hub is not installed.
    """
    try:
        from huggingface_hub import HfApi
    except ImportError as e:
        raise DeployError(
            f"deploying needs huggingface_hub ({e}): pip install 'deltasync[hf]'"
        ) from e
    return HfApi(token=token)


def check_hardware(specs: list[SpaceSpec]) -> None:
    """Raise ValueError for a hardware flavor huggingface_hub does not know (when installed)."""
    try:
        from huggingface_hub import SpaceHardware
    except ImportError:
        return  # a dry run without huggingface_hub: nothing to check against
    known = {h.value for h in SpaceHardware}
    for s in specs:
        if s.hardware not in known:
            raise ValueError(
                f"{s.key} Space: unknown hardware {s.hardware!r}; expected one of {sorted(known)}"
            )


class Deployer:
    """Plans and runs a deploy.

    Args:
        config: :class:`DeployConfig`.
        api: an ``HfApi``-like object (tests pass a recording fake); default: ``hub_api(token)``.
        out: where the plan, progress and next steps are printed.
        sleep: ``time.sleep`` (tests pass a fake clock's).
        clock: ``time.monotonic``.
    """

    def __init__(
        self,
        config: DeployConfig,
        api: Any = None,
        out: TextIO | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = config
        self._api = api
        self.out = out if out is not None else sys.stdout
        self.sleep = sleep
        self.clock = clock
        self.owner: str | None = config.owner
        self.control_token_generated = False

    # -------------------------------------------------------------------------------- planning
    def specs(self, owner: str) -> list[SpaceSpec]:
        """The three Spaces with their names, hardware, variables and secrets."""
        c = self.cfg
        store_uri = f"hf://buckets/{owner}/{c.bucket_name}"
        space_token = c.space_token or c.token or ""
        dashboard_token = c.dashboard_token or space_token
        if c.control_token is None:
            c.control_token = secrets.token_urlsafe(32)
            self.control_token_generated = True

        def sleep(hardware: str) -> int | None:
            return None if hardware in FREE_HARDWARE else c.sleep_time_s

        return [
            SpaceSpec(
                "rollout",
                "spaces/vllm-rollout",
                f"{c.prefix}-rollout",
                c.rollout_hardware,
                {
                    "DELTASYNC_STORE": store_uri,
                    "MODEL": c.model,
                    "POLL_INTERVAL_S": f"{c.poll_interval_s:g}",
                },
                {"HF_TOKEN": space_token, "CONTROL_TOKEN": c.control_token},
                sleep(c.rollout_hardware),
            ),
            SpaceSpec(
                "wordle",
                "spaces/wordle-env",
                f"{c.prefix}-wordle",
                c.wordle_hardware,
                sleep_time_s=sleep(c.wordle_hardware),
                own_context=True,
            ),
            SpaceSpec(
                "dashboard",
                "spaces/dashboard",
                f"{c.prefix}-dashboard",
                c.dashboard_hardware,
                {"BUCKET": store_uri},
                {"HF_TOKEN": dashboard_token},
                sleep(c.dashboard_hardware),
            ),
        ]

    def token_warning(self, owner: str) -> str | None:
        """One line when a Space would get the deploy token itself as its HF_TOKEN secret (it can
        write every repo of the account): which Spaces, and how to make a narrower token. None when
        every Space gets a token of its own. Never contains a token."""
        c = self.cfg
        space = c.space_token or c.token
        dashboard = c.dashboard_token or space
        reused = [k for k, t in (("rollout", space), ("dashboard", dashboard))
                  if t is None or t == c.token]  # fmt: skip
        if not reused:
            return None
        bucket = f"{owner}/{c.bucket_name}"
        spaces = " and ".join(reused) + (" Spaces get" if len(reused) > 1 else " Space gets")
        return (
            f"warning: the {spaces} your deploy token (HF_TOKEN) as their HF_TOKEN secret, which can write every repo of your "
            f"account; create a fine-grained token at {TOKENS_URL} limited to bucket {bucket} "
            "(read and write for the rollout Space, read for the dashboard) and pass it as "
            "SPACE_HF_TOKEN (and a read-only one as DASHBOARD_HF_TOKEN)"
        )

    def plan(self, owner: str) -> list[HubCall]:
        """Every Hub call of the deploy, in order (the waiting that follows is not included)."""
        c = self.cfg
        calls = [
            HubCall(
                "create_bucket",
                dict(bucket_id=f"{owner}/{c.bucket_name}", private=c.private_bucket, exist_ok=True),
            )
        ]
        for s in self.specs(owner):
            repo_id = f"{owner}/{s.name}"
            if c.from_owner:
                calls.append(
                    HubCall(
                        "duplicate_repo",
                        dict(
                            from_id=f"{c.from_owner}/{s.name}",
                            to_id=repo_id,
                            repo_type="space",
                            private=c.private_spaces,
                            exist_ok=True,
                        ),
                    )
                )
            else:
                calls.append(
                    HubCall(
                        "create_repo",
                        dict(
                            repo_id=repo_id,
                            repo_type="space",
                            space_sdk="docker",
                            private=c.private_spaces,
                            exist_ok=True,
                        ),
                    )
                )
            for key, value in s.secrets.items():
                calls.append(
                    HubCall(
                        "add_space_secret",
                        dict(repo_id=repo_id, key=key, value=value),
                        secret=("value",),
                    )
                )
            for key, value in s.variables.items():
                calls.append(
                    HubCall("add_space_variable", dict(repo_id=repo_id, key=key, value=value))
                )
            hw = dict(repo_id=repo_id, hardware=s.hardware)
            if s.sleep_time_s is not None:
                hw["sleep_time"] = s.sleep_time_s
            calls.append(HubCall("request_space_hardware", hw))
            if not c.from_owner:  # upload last: the first build already has secrets and variables
                calls.append(
                    HubCall(
                        "upload_folder",
                        dict(
                            repo_id=repo_id,
                            repo_type="space",
                            commit_message=f"deploy {s.folder} with deltasync (make spaces)",
                        ),
                        stage=s,
                    )
                )
        return calls

    def next_step(self, owner: str) -> str:
        """The ``make train ...`` line that trains against the deployed Spaces and bucket."""
        names = {s.key: s.name for s in self.specs(owner)}
        return (
            f"make train BUCKET={owner}/{self.cfg.bucket_name} "
            f"VLLM_URL={space_url(owner, names['rollout'])} "
            f"ENV_URL={space_url(owner, names['wordle'])} MODEL={self.cfg.model}"
        )

    # --------------------------------------------------------------------------------- running
    @property
    def api(self):
        if self._api is None:
            self._api = hub_api(self.cfg.token)
        return self._api

    def _print(self, msg: str = "") -> None:
        print(msg, file=self.out, flush=True)

    def _resolve_owner(self, dry_run: bool) -> str:
        """The account that owns the Spaces: ``--owner``, else ``whoami()`` (a placeholder in a
        dry run, which calls nothing)."""
        if self.owner is None:
            if dry_run:
                self.owner = "<your-username>"
                self._print("would call: whoami()  (pass --owner to name the account)")
            else:
                self._print("whoami()")
                self.owner = self.api.whoami()["name"]
        return self.owner

    def run(self, dry_run: bool = False) -> str:
        """Deploy (or with ``dry_run``, print the calls without making any).

        Returns:
            The ``make train ...`` line to run next.

        Raises:
            DeployError: no HF_TOKEN (except in a dry run), a missing file, or a Space that ended
                in an error stage or did not come up within ``timeout_s``.
            ValueError: an unknown hardware flavor.
            huggingface_hub errors of a refused call (e.g. HfHubHTTPError), unchanged.
        """
        c = self.cfg
        if not c.token and not dry_run:
            raise DeployError(
                "HF_TOKEN is not set: create a token with write access at "
                "https://huggingface.co/settings/tokens and run `HF_TOKEN=hf_... make spaces` "
                "(or export HF_TOKEN)"
            )
        owner = self._resolve_owner(dry_run)
        calls = self.plan(owner)
        check_hardware(self.specs(owner))
        tag = "would call: " if dry_run else ""
        if dry_run:
            self._print(f"dry run: no Hub call is made; HfApi(token={MASK!r})")
        warning = self.token_warning(owner)
        if warning:
            self._print(warning)
        for call in calls:
            if call.stage is None:
                self._print(tag + call.render())
                if not dry_run:
                    getattr(self.api, call.fn)(**call.kwargs)
                continue
            with tempfile.TemporaryDirectory(prefix="deltasync-space-") as tmp:
                staged = stage_space(c.repo_root, call.stage.folder, tmp, call.stage.own_context)
                self._print(tag + call.render(staged))
                if not dry_run:
                    self.api.upload_folder(folder_path=tmp, **call.kwargs)
        specs = self.specs(owner)
        if not dry_run and self.control_token_generated:
            self._save_control_token(owner, specs[0].name)
        if not dry_run and c.wait:
            self.wait_running([f"{owner}/{s.name}" for s in specs])
        line = self.next_step(owner)
        self._print()
        for s in specs:
            self._print(f"{s.key:>9}: {space_url(owner, s.name)}  (https://huggingface.co/spaces/"
                        f"{owner}/{s.name})")  # fmt: skip
        self._print(f"   bucket: hf://buckets/{owner}/{c.bucket_name}")
        self._print("\nNext, train against them:\n")
        self._print(f"  {line}\n")
        return line

    def down(self, dry_run: bool = False) -> list[str]:
        """Pause the rollout Space(s) (``pause_space``): a paused Space bills nothing until it is
        restarted. Prints how to restart them.

        Returns:
            The paused Spaces' repo ids.

        Raises:
            DeployError: no HF_TOKEN (except in a dry run), or a Space that does not exist or that
                this token may not pause; the message names the Space and what to check.
        """
        c = self.cfg
        if not c.token and not dry_run:
            raise DeployError(
                "HF_TOKEN is not set: pausing a Space needs a token of its owner with write "
                "access; run `HF_TOKEN=hf_... make spaces-down BUCKET=<owner>/<bucket>`"
            )
        owner = self._resolve_owner(dry_run)
        names = list(c.rollout_spaces) or [f"{c.prefix}-rollout"]
        repo_ids = [f"{owner}/{n}" for n in names]
        tag = "would call: " if dry_run else ""
        if dry_run:
            self._print(f"dry run: no Hub call is made; HfApi(token={MASK!r})")
        for repo_id in repo_ids:
            call = HubCall("pause_space", dict(repo_id=repo_id))
            self._print(tag + call.render())
            if dry_run:
                continue
            try:
                self.api.pause_space(repo_id=repo_id)
            except Exception as e:
                status = getattr(getattr(e, "response", None), "status_code", None)
                if status not in (401, 403, 404) and type(e).__name__ not in (
                    "RepositoryNotFoundError",
                    "GatedRepoError",
                ):
                    raise
                raise DeployError(
                    f"expected Space {repo_id} that this HF_TOKEN may pause, found "
                    f"{status or type(e).__name__}: check --bucket/--owner and --prefix (or "
                    "--rollout-space NAME), and that HF_TOKEN is a write token of the Space's "
                    "owner"
                ) from e
        verb = "would be paused" if dry_run else "paused"
        self._print(f"\n{verb}: {', '.join(repo_ids)} (a paused Space bills nothing).")
        self._print("Restart later (billing resumes; vLLM reloads the model and re-anchors):")
        for repo_id in repo_ids:
            self._print(
                f"  hf spaces restart {repo_id}   (or the Restart button at "
                f"https://huggingface.co/spaces/{repo_id}/settings)"
            )
        return repo_ids

    def _save_control_token(self, owner: str, space: str) -> None:
        """Keep a generated CONTROL_TOKEN in a 0600 file under runs/ (its value is not printed)."""
        folder = self.cfg.state_dir or os.path.join(self.cfg.repo_root, "runs", "spaces")
        path = os.path.join(folder, f"{owner}--{space}.control_token")
        os.makedirs(folder, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.cfg.control_token + "\n")
        self._print(f"CONTROL_TOKEN of {owner}/{space} saved to {path} (mode 0600)")

    def wait_running(self, repo_ids: list[str]) -> None:
        """Poll ``get_space_runtime`` until every Space is RUNNING, printing progress.

        Raises:
            DeployError: a Space reached a failed stage (BUILD_ERROR, RUNTIME_ERROR, ...) or not
                every Space was RUNNING after ``timeout_s``; the message names the Space, its URL
                and how to read its logs.
        """
        c = self.cfg
        start = self.clock()
        stages = {r: "?" for r in repo_ids}
        building_seen = dict.fromkeys(repo_ids, False)
        tty = getattr(self.out, "isatty", lambda: False)()
        last_line, last_print = "", -1e9
        while True:
            elapsed = self.clock() - start
            for r in repo_ids:
                if stages[r] == "RUNNING" and building_seen[r]:
                    continue
                rt = self.api.get_space_runtime(r)
                stage = str(getattr(rt.stage, "value", rt.stage))
                stages[r] = stage
                if stage not in ("RUNNING", *FAILED_STAGES):
                    building_seen[r] = True
                settled = building_seen[r] or elapsed >= c.grace_s
                if stage in FAILED_STAGES and settled:
                    raise DeployError(self._failure(r, stage, getattr(rt, "raw", {}) or {}))
                if stage == "RUNNING" and settled:
                    building_seen[r] = True  # counts as done from now on
            done = [r for r in repo_ids if stages[r] == "RUNNING" and building_seen[r]]
            line = f"[{_mmss(elapsed)}] " + " | ".join(
                f"{r.split('/')[-1]} {stages[r]}" for r in repo_ids
            )
            if tty:
                self.out.write("\r" + line.ljust(len(last_line)))
                self.out.flush()
            elif (
                line.split("] ", 1)[1] != last_line.split("] ", 1)[-1] or elapsed - last_print >= 60
            ):
                self._print(line)
                last_print = elapsed
            last_line = line
            if len(done) == len(repo_ids):
                if tty:
                    self.out.write("\n")
                self._print(f"all {len(repo_ids)} Spaces are RUNNING after {_mmss(elapsed)}")
                return
            if elapsed >= c.timeout_s:
                if tty:
                    self.out.write("\n")
                waiting = [f"{r} ({stages[r]})" for r in repo_ids if r not in done]
                raise DeployError(
                    f"expected every Space RUNNING within {c.timeout_s:.0f}s, found still "
                    f"waiting: {', '.join(waiting)}. A vLLM image build can take 30 minutes: "
                    "rerun with a larger --timeout-s (re-running is safe), or read the logs: "
                    + "; ".join(_logs_hint(r.split("/")[0], r.split("/")[1]) for r in waiting)
                )
            self.sleep(c.check_every_s)

    @staticmethod
    def _failure(repo_id: str, stage: str, raw: dict) -> str:
        owner, name = repo_id.split("/")
        why = raw.get("errorMessage") or ""
        fix = {
            "BUILD_ERROR": "the Docker image failed to build",
            "RUNTIME_ERROR": "the container exited or failed its health check",
            "CONFIG_ERROR": "the README front matter is invalid",
            "NO_APP_FILE": "the Space has no Dockerfile at its root",
            "PAUSED": f"the Space is paused (make spaces-down): `hf spaces restart {repo_id}` "
            "or restart it from its settings",
            "STOPPED": "the Space is stopped: restart it from its settings",
            "DELETING": "the Space is being deleted",
        }.get(stage, "")
        return (
            f"Space {repo_id} ({space_url(owner, name)}): expected RUNNING, found {stage}"
            + (f" ({fix})" if fix else "")
            + (f": {why}" if why else "")
            + f". See its logs: {_logs_hint(owner, name)}; fix and rerun `make spaces` (safe to "
            "repeat: every call is idempotent)"
        )


def _logs_hint(owner: str, name: str) -> str:
    return (
        f"`hf spaces logs {owner}/{name} --build` (build) or `hf spaces logs {owner}/{name}` "
        f"(container), or https://huggingface.co/spaces/{owner}/{name}?logs=container"
    )


def _mmss(seconds: float) -> str:
    s = int(max(0.0, seconds))
    return f"{s // 60:d}m{s % 60:02d}s"


def parse_args(argv: list[str] | None = None, env: dict[str, str] | None = None) -> tuple:
    """(DeployConfig, dry_run, down) from flags, with ``HF_TOKEN``, ``SPACE_HF_TOKEN`` (or the
    older ``SPACES_HF_TOKEN``), ``DASHBOARD_HF_TOKEN`` and ``CONTROL_TOKEN`` read from ``env``
    (default ``os.environ``); ``--space-token``/``--dashboard-token`` win over the environment."""
    env = os.environ if env is None else env
    d = DeployConfig()
    p = argparse.ArgumentParser(
        prog="python -m tools.deploy_spaces",
        description="Create the bucket and the rollout, Wordle and dashboard Spaces on the "
        "Hugging Face Hub (HF_TOKEN with write access), wait until they run, and print the "
        "`make train` line; or with --down pause the rollout Space(s). SPACE_HF_TOKEN "
        "(optional, recommended): the token the Spaces get as their HF_TOKEN secret (read and "
        "write on the bucket only), default HF_TOKEN with a warning. DASHBOARD_HF_TOKEN "
        "(optional): a read-only token for the dashboard, default SPACE_HF_TOKEN. CONTROL_TOKEN "
        "(optional): the rollout Space's control token, default a new random one saved under "
        "runs/spaces/.",
    )
    p.add_argument("--dry-run", action="store_true", help="print every Hub call, make none")
    p.add_argument(
        "--down",
        action="store_true",
        help="pause the rollout Space(s) instead of deploying (a paused Space bills nothing)",
    )
    p.add_argument(
        "--rollout-space",
        action="append",
        default=[],
        metavar="NAME",
        help="with --down: a rollout Space to pause (repeatable; default PREFIX-rollout)",
    )
    p.add_argument(
        "--space-token",
        default=None,
        metavar="TOKEN",
        help="the Spaces' HF_TOKEN secret (prefer the SPACE_HF_TOKEN variable: flags are "
        "visible to other local users)",
    )
    p.add_argument(
        "--dashboard-token",
        default=None,
        metavar="TOKEN",
        help="the dashboard's read-only HF_TOKEN secret (prefer DASHBOARD_HF_TOKEN)",
    )
    p.add_argument("--owner", default=None, help="account to deploy into (default: the token's)")
    p.add_argument("--bucket", default=d.bucket, help="bucket NAME or OWNER/NAME")
    p.add_argument("--model", default=d.model, help="model the rollout Space serves")
    p.add_argument("--prefix", default=d.prefix, help="Space names: PREFIX-rollout, ...")
    p.add_argument("--rollout-hardware", default=d.rollout_hardware, help="a GPU flavor")
    p.add_argument("--wordle-hardware", default=d.wordle_hardware)
    p.add_argument("--dashboard-hardware", default=d.dashboard_hardware)
    p.add_argument("--from-owner", default=None, help="duplicate OWNER's Spaces, no upload")
    p.add_argument(
        "--public",
        action="store_true",
        help="create public Spaces (default: private; a public rollout Space lets anyone "
        "generate on its GPU)",
    )
    p.add_argument(
        "--private-spaces", action="store_true", help="create private Spaces (the default)"
    )
    p.add_argument("--public-bucket", action="store_true", help="create a public bucket")
    p.add_argument("--poll-interval-s", type=float, default=d.poll_interval_s)
    p.add_argument(
        "--sleep-time",
        "--rollout-sleep-time-s",
        dest="sleep_time",
        type=int,
        default=d.sleep_time_s,
        metavar="SECONDS",
        help="a Space on paid hardware (the rollout GPU) sleeps after this many seconds of "
        f"inactivity and stops billing; -1: never (default {d.sleep_time_s})",
    )
    p.add_argument("--no-wait", action="store_true", help="do not wait for RUNNING")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="wait at most this")
    p.add_argument("--check-every-s", type=float, default=d.check_every_s)
    p.add_argument("--repo-root", default=".", help="the deltasync checkout to upload from")
    a = p.parse_args(argv)
    if a.rollout_space and not a.down:
        p.error("--rollout-space names Spaces to pause: use it with --down")
    if a.public and a.private_spaces:
        p.error("--public and --private-spaces contradict each other; give one of them")
    try:
        cfg = DeployConfig(
            token=env.get("HF_TOKEN") or None,
            owner=a.owner,
            bucket=a.bucket,
            model=a.model,
            prefix=a.prefix,
            rollout_hardware=a.rollout_hardware,
            wordle_hardware=a.wordle_hardware,
            dashboard_hardware=a.dashboard_hardware,
            from_owner=a.from_owner,
            private_spaces=not a.public,
            private_bucket=not a.public_bucket,
            space_token=a.space_token
            or env.get("SPACE_HF_TOKEN")
            or env.get("SPACES_HF_TOKEN")
            or None,
            dashboard_token=a.dashboard_token or env.get("DASHBOARD_HF_TOKEN") or None,
            control_token=env.get("CONTROL_TOKEN") or None,
            poll_interval_s=a.poll_interval_s,
            sleep_time_s=a.sleep_time,
            rollout_spaces=tuple(a.rollout_space),
            wait=not a.no_wait,
            timeout_s=a.timeout_s,
            check_every_s=a.check_every_s,
            repo_root=a.repo_root,
        )
    except ValueError as e:
        p.error(str(e))
    return cfg, a.dry_run, a.down


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tools.deploy_spaces``; returns the exit status."""
    cfg, dry_run, down = parse_args(argv)
    try:
        deployer = Deployer(cfg)
        if down:
            deployer.down(dry_run=dry_run)
        else:
            deployer.run(dry_run=dry_run)
    except DeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
