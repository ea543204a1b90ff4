"""Settings of ``make spaces`` (``python -m tools.deploy_spaces``): the three Spaces, the deploy
configuration and its command line. huggingface_hub is not imported here; the task whose
environment Space is deployed (``--task``, ``make spaces TASK=...``) is resolved by
``tools.env_space``."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from deltasync.errors import DeltaSyncError

MASK = "***"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
# Seconds of inactivity after which a Space on paid hardware sleeps (and stops billing).
DEFAULT_SLEEP_TIME_S = 3600
FREE_HARDWARE = ("cpu-basic",)  # sleeps after 48 h by itself; its sleep time cannot be set
TOKENS_URL = "https://huggingface.co/settings/tokens/new?tokenType=fineGrained"
# Stages after which a Space will not become RUNNING by itself.
FAILED_STAGES = (
    "BUILD_ERROR",
    "RUNTIME_ERROR",
    "CONFIG_ERROR",
    "NO_APP_FILE",
    "DELETING",
    "STOPPED",
    "PAUSED",
)
_STAGE_IGNORE = (
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "*.nbi",
    "*.nbc",
    ".DS_Store",
    ".pytest_cache",
)


# What ``--only`` may name: the rollout Space, the environment Space (Wordle's or the task's), the
# dashboard.
ROLES = ("rollout", "env", "dashboard")


class DeployError(DeltaSyncError):
    """A deploy cannot start or a Space did not come up; the message says why and what to do."""


@dataclass(frozen=True)
class SpaceSpec:
    """One Space to deploy.

    Attributes:
        key: "rollout", the environment Space's (``tools.env_space.EnvSpace.key``: "wordle",
            "number-guess", ...) or "dashboard".
        folder: the Space's folder relative to the repository root (``spaces/<name>``, a task's
            ``Task.space``) or absolute.
        name: the Space repo's name in the owner's account.
        hardware: the flavor to request (``SpaceHardware`` value, e.g. "l4x1", "cpu-basic").
        variables: Space variables (plain environment variables, visible on the Hub).
        secrets: Space secrets by name; values are never printed.
        sleep_time_s: seconds of inactivity before the Space sleeps (stops billing); -1:
            never; None: the Hub's default (free hardware sleeps after 48 h, paid never).
        own_context: the folder is the whole Docker build context (an environment Space, an
            OpenEnv environment that needs nothing else of the repository); otherwise the context
            is the repository root (the Space installs the ``deltasync`` library from it).
    """

    key: str
    folder: str
    name: str
    hardware: str
    variables: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    sleep_time_s: int | None = None
    own_context: bool = False

    @property
    def role(self) -> str:
        """``rollout``, ``env`` (the environment Space, whatever its key) or ``dashboard``."""
        return self.key if self.key in ("rollout", "dashboard") else "env"


@dataclass
class DeployConfig:
    """Settings of one deploy (``python -m tools.deploy_spaces --help`` lists the flags).

    Attributes:
        token: the Hugging Face token that creates everything (``HF_TOKEN``); never printed.
        owner: the account (user or org) to deploy into; None: the token's user (``whoami``).
        bucket: the bucket's name, or ``owner/name``; the run lives at the bucket's root.
        model: the model the rollout Space loads (its architecture must match the trainer's).
        task: the task whose environment Space is deployed (``TASK``: a name of
            ``trainer.task.base.TASKS`` or ``package.module:NAME``; ``tools.env_space``): Wordle's
            by default.
        prefix: Space names are ``<prefix>-rollout``, ``<prefix>-<task>`` (``<prefix>-wordle``,
            ``<prefix>-number-guess``), ``<prefix>-dashboard``.
        rollout_hardware: GPU flavor of the rollout Space (vLLM needs a GPU on Spaces).
        wordle_hardware: flavor of the environment Space (Wordle's or the task's).
        dashboard_hardware: flavor of the dashboard Space.
        from_owner: duplicate ``<from_owner>/<space name>`` instead of creating and uploading.
        only: deploy only these Spaces (``--only``, of ``ROLES``: e.g. ``("env",)`` to redeploy a
            changed environment); empty: all three. The bucket is created either way, and the
            ``make train`` line names the others by their usual URLs.
        private_spaces: create private Spaces (the default: only the owner's tokens reach
            them, so clients send ``Authorization: Bearer $HF_TOKEN``); False (``--public``):
            anyone can reach them, and a public rollout Space lets anyone generate on its GPU.
        private_bucket: create the bucket private (the Spaces read it with their HF_TOKEN).
        space_token: the HF_TOKEN secret given to the Spaces (``SPACE_HF_TOKEN``): read and write
            on the bucket is enough (the rollout Space writes its heartbeat); None: ``token``,
            with a warning.
        dashboard_token: the dashboard's HF_TOKEN secret (``DASHBOARD_HF_TOKEN``; read access to
            the bucket is enough); None: ``space_token``.
        control_token: the rollout Space's CONTROL_TOKEN; None: the one saved by an earlier
            deploy (``<state_dir>/<owner>--<rollout>.control_token``, mode 0600), else a new one
            saved there before the first Hub call that writes.
        rollout_api_key: the rollout Space's ROLLOUT_API_KEY secret (the bearer token of its
            ``/v1`` routes) when the Spaces are public; None: the saved or a new one, kept like
            the CONTROL_TOKEN (``<owner>--<rollout>.rollout_api_key``). A private Space gets
            none (one an earlier public deploy gave has it deleted).
        wordle_api_key: the environment Space's key secret (``WORDLE_API_KEY`` for Wordle,
            ``<TASK NAME>_API_KEY`` for another task: ``tools.env_space``), the same way
            (``<owner>--<space>.<variable in lower case>``).
        run_public_key: the run key's public key, the rollout Space's variable
            ``RUN_PUBLIC_KEY`` (the replica serves only versions it signed); None: the deploy
            makes the run key once (``<state_dir>/run_key.pem``, mode 0600) and reuses it.
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
    task: str = "wordle"
    prefix: str = "deltasync"
    rollout_hardware: str = "l4x1"
    wordle_hardware: str = "cpu-basic"
    dashboard_hardware: str = "cpu-basic"
    from_owner: str | None = None
    only: tuple[str, ...] = ()
    private_spaces: bool = True
    private_bucket: bool = True
    space_token: str | None = field(default=None, repr=False)
    dashboard_token: str | None = field(default=None, repr=False)
    control_token: str | None = field(default=None, repr=False)
    rollout_api_key: str | None = field(default=None, repr=False)
    wordle_api_key: str | None = field(default=None, repr=False)
    run_public_key: str | None = None
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
        unknown = [r for r in self.only if r not in ROLES]
        if unknown:
            raise ValueError(f"expected --only among {', '.join(ROLES)}, found {unknown}")
        if not self.task.strip():
            raise ValueError("expected --task NAME (e.g. number_guess) or package.module:NAME")
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

    @property
    def env_space(self):
        """The task's environment Space (``tools.env_space.env_space``; raises its
        ``DeployError``)."""
        from .env_space import env_space

        return env_space(self.task)


def parse_args(argv: list[str] | None = None, env: dict[str, str] | None = None) -> tuple:
    """(DeployConfig, dry_run, down) from flags, with ``HF_TOKEN``, ``SPACE_HF_TOKEN`` (or the
    older ``SPACES_HF_TOKEN``), ``DASHBOARD_HF_TOKEN``, ``CONTROL_TOKEN``, ``ROLLOUT_API_KEY``
    and the environment Space's key (``WORDLE_API_KEY``, or the task's ``<TASK NAME>_API_KEY``)
    read from ``env`` (default ``os.environ``); ``--space-token``/``--dashboard-token`` win over
    the environment. A ``--task`` that cannot be loaded or has no Space is an argparse error."""
    env = os.environ if env is None else env
    d = DeployConfig()
    p = argparse.ArgumentParser(
        prog="python -m tools.deploy_spaces",
        description="Create the bucket and the rollout, environment (Wordle's, or --task's) and "
        "dashboard Spaces on the Hugging Face Hub (HF_TOKEN with write access), wait until they run, and print the "
        "`make train` line; or with --down pause the rollout Space(s). SPACE_HF_TOKEN "
        "(optional, recommended): the token the Spaces get as their HF_TOKEN secret (read and "
        "write on the bucket only), default HF_TOKEN with a warning. DASHBOARD_HF_TOKEN "
        "(optional): a read-only token for the dashboard, default SPACE_HF_TOKEN. CONTROL_TOKEN "
        "(optional): the rollout Space's control token, default the one saved under "
        "runs/spaces/ by an earlier deploy, else a new one saved there. ROLLOUT_API_KEY and "
        "WORDLE_API_KEY (optional; another task's: <TASK NAME>_API_KEY): the keys of a public "
        "rollout and environment Space, kept the same way.",
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
    p.add_argument(
        "--task",
        default=d.task,
        help="the task whose environment Space is deployed (its Task.space): a name "
        "(wordle, number_guess) or package.module:NAME (default: wordle)",
    )
    p.add_argument("--prefix", default=d.prefix, help="Space names: PREFIX-rollout, ...")
    p.add_argument("--rollout-hardware", default=d.rollout_hardware, help="a GPU flavor")
    p.add_argument("--wordle-hardware", default=d.wordle_hardware)
    p.add_argument("--dashboard-hardware", default=d.dashboard_hardware)
    p.add_argument("--from-owner", default=None, help="duplicate OWNER's Spaces, no upload")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        choices=ROLES,
        help="deploy only this Space (repeatable; env: the environment Space), e.g. to redeploy "
        "a changed environment; default: all three",
    )
    p.add_argument(
        "--public",
        action="store_true",
        help="create public Spaces (default: private, and a later deploy without --public "
        "makes them private again); a public rollout and environment Space get a generated "
        "ROLLOUT_API_KEY / WORDLE_API_KEY (another task's: <TASK NAME>_API_KEY) kept under "
        "runs/spaces/",
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
        from .env_space import env_space

        key_variable = env_space(a.task).key_variable
        cfg = DeployConfig(
            token=env.get("HF_TOKEN") or None,
            owner=a.owner,
            bucket=a.bucket,
            model=a.model,
            task=a.task,
            prefix=a.prefix,
            rollout_hardware=a.rollout_hardware,
            wordle_hardware=a.wordle_hardware,
            dashboard_hardware=a.dashboard_hardware,
            from_owner=a.from_owner,
            only=tuple(a.only),
            private_spaces=not a.public,
            private_bucket=not a.public_bucket,
            space_token=a.space_token
            or env.get("SPACE_HF_TOKEN")
            or env.get("SPACES_HF_TOKEN")
            or None,
            dashboard_token=a.dashboard_token or env.get("DASHBOARD_HF_TOKEN") or None,
            control_token=env.get("CONTROL_TOKEN") or None,
            rollout_api_key=env.get("ROLLOUT_API_KEY") or None,
            wordle_api_key=env.get(key_variable) or None,
            poll_interval_s=a.poll_interval_s,
            sleep_time_s=a.sleep_time,
            rollout_spaces=tuple(a.rollout_space),
            wait=not a.no_wait,
            timeout_s=a.timeout_s,
            check_every_s=a.check_every_s,
            repo_root=a.repo_root,
        )
    except (ValueError, DeployError) as e:
        p.error(str(e))
    return cfg, a.dry_run, a.down
