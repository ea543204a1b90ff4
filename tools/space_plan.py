"""The plan of ``make spaces``, built from a :class:`DeployConfig` without touching the Hub: the
three Spaces (names, hardware, variables, secrets; the environment Space is the task's,
``tools.env_space``), every Hub call in order, the warning about a reused deploy token, and the
``make train ...`` line printed at the end. The deployer in
``deploy_spaces.py`` runs (or, in a dry run, prints) what is planned here."""

from __future__ import annotations

from .space_config import FREE_HARDWARE, TOKENS_URL, DeployConfig, SpaceSpec
from .space_stage import HubCall, space_url


def space_specs(cfg: DeployConfig, owner: str) -> list[SpaceSpec]:
    """The rollout, environment and dashboard Spaces of ``owner``, in that order.

    The rollout Space reads the bucket through ``BUCKET`` and gets ``HF_TOKEN`` and
    ``CONTROL_TOKEN`` secrets; the dashboard reads it through ``BUCKET`` with its own (read-only)
    token where one is given; the environment Space (``cfg.env_space``: Wordle's, or the task's
    ``Task.space``, its own build context) needs neither, only its key when it is public. Paid
    hardware gets ``cfg.sleep_time_s``; free hardware keeps the Hub's sleep time.

    Raises:
        ValueError: ``cfg.control_token`` is None (``Deployer.specs`` generates one first).
        DeployError: the task cannot be loaded or has no Space (``tools.env_space``).
    """
    if cfg.control_token is None:
        raise ValueError(
            "expected DeployConfig.control_token to be set, found None: pass CONTROL_TOKEN or "
            "call Deployer.specs, which generates one"
        )
    bucket = f"hf://buckets/{owner}/{cfg.bucket_name}"
    env = cfg.env_space
    space_token = cfg.space_token or cfg.token or ""
    dashboard_token = cfg.dashboard_token or space_token

    def sleep(hardware: str) -> int | None:
        return None if hardware in FREE_HARDWARE else cfg.sleep_time_s

    return [
        SpaceSpec(
            "rollout",
            "spaces/vllm-rollout",
            f"{cfg.prefix}-rollout",
            cfg.rollout_hardware,
            {
                "BUCKET": bucket,
                "MODEL": cfg.model,
                "POLL_INTERVAL_S": f"{cfg.poll_interval_s:g}",
                **({"RUN_PUBLIC_KEY": cfg.run_public_key} if cfg.run_public_key else {}),
            },
            {
                "HF_TOKEN": space_token,
                "CONTROL_TOKEN": cfg.control_token,
                **({"ROLLOUT_API_KEY": cfg.rollout_api_key} if cfg.rollout_api_key else {}),
            },
            sleep(cfg.rollout_hardware),
        ),
        SpaceSpec(
            env.key,
            env.folder,
            f"{cfg.prefix}-{env.key}",
            cfg.wordle_hardware,
            secrets={env.key_variable: cfg.wordle_api_key} if cfg.wordle_api_key else {},
            sleep_time_s=sleep(cfg.wordle_hardware),
            own_context=True,
        ),
        SpaceSpec(
            "dashboard",
            "spaces/dashboard",
            f"{cfg.prefix}-dashboard",
            cfg.dashboard_hardware,
            {"BUCKET": bucket},
            {"HF_TOKEN": dashboard_token},
            sleep(cfg.dashboard_hardware),
        ),
    ]


def deployed(cfg: DeployConfig, specs: list[SpaceSpec]) -> list[SpaceSpec]:
    """The Spaces of ``specs`` this deploy creates and uploads: those ``cfg.only`` names (their
    ``SpaceSpec.role``), all of them without it."""
    return [s for s in specs if not cfg.only or s.role in cfg.only]


def token_warning(cfg: DeployConfig, owner: str) -> str | None:
    """One line when a Space would get the deploy token itself as its HF_TOKEN secret (it can
    write every repo of the account): which Spaces, and how to make a narrower token. None when
    every Space gets a token of its own. Never contains a token."""
    space = cfg.space_token or cfg.token
    dashboard = cfg.dashboard_token or space
    pairs = (("rollout", space), ("dashboard", dashboard))
    reused = [key for key, token in pairs if token is None or token == cfg.token]
    if not reused:
        return None
    bucket = f"{owner}/{cfg.bucket_name}"
    spaces = " and ".join(reused) + (" Spaces get" if len(reused) > 1 else " Space gets")
    return (
        f"warning: the {spaces} your deploy token (HF_TOKEN) as their HF_TOKEN secret, which "
        f"can write every repo of your account; create a fine-grained token at {TOKENS_URL} "
        f"limited to bucket {bucket} (read and write for the rollout Space, read for the "
        "dashboard) and pass it as SPACE_HF_TOKEN (and a read-only one as DASHBOARD_HF_TOKEN)"
    )


def hub_calls(cfg: DeployConfig, owner: str, specs: list[SpaceSpec]) -> list[HubCall]:
    """Every Hub call of the deploy, in order (the waiting that follows is not included).

    The bucket first; then per Space (:func:`deployed`): create (or, with ``cfg.from_owner``, duplicate) the repo,
    its secrets, its variables, its hardware, and last its upload (not for a duplicate), so that
    the first build already has its secrets and variables.
    """
    calls = [
        HubCall(
            "create_bucket",
            dict(bucket_id=f"{owner}/{cfg.bucket_name}", private=cfg.private_bucket, exist_ok=True),
        )
    ]
    for s in deployed(cfg, specs):
        repo_id = f"{owner}/{s.name}"
        if cfg.from_owner:
            create = HubCall(
                "duplicate_repo",
                dict(
                    from_id=f"{cfg.from_owner}/{s.name}",
                    to_id=repo_id,
                    repo_type="space",
                    private=cfg.private_spaces,
                    exist_ok=True,
                ),
            )
        else:
            create = HubCall(
                "create_repo",
                dict(
                    repo_id=repo_id,
                    repo_type="space",
                    space_sdk="docker",
                    private=cfg.private_spaces,
                    exist_ok=True,
                ),
            )
        calls.append(create)
        for key, value in s.secrets.items():
            kwargs = dict(repo_id=repo_id, key=key, value=value)
            calls.append(HubCall("add_space_secret", kwargs, secret=("value",)))
        for key, value in s.variables.items():
            kwargs = dict(repo_id=repo_id, key=key, value=value)
            calls.append(HubCall("add_space_variable", kwargs))
        hw = dict(repo_id=repo_id, hardware=s.hardware)
        if s.sleep_time_s is not None:
            hw["sleep_time"] = s.sleep_time_s
        calls.append(HubCall("request_space_hardware", hw))
        if not cfg.from_owner:
            message = f"deploy {s.folder} with deltasync (make spaces)"
            kwargs = dict(repo_id=repo_id, repo_type="space", commit_message=message)
            calls.append(HubCall("upload_folder", kwargs, stage=s))
    return calls


def next_step(
    cfg: DeployConfig,
    owner: str,
    specs: list[SpaceSpec],
    urls: dict[str, str] | None = None,
    key_files: dict[str, str] | None = None,
) -> str:
    """The ``make train ...`` line that trains against the deployed Spaces and bucket, with
    ``TASK=...`` for a task other than Wordle.

    ``urls``: the Spaces' URLs by key ("rollout", the environment Space's) as the Hub reports
    them (``runtime_url``); a Space missing from it gets :func:`space_url`. ``key_files``: the
    0600 files holding the keys the trainer must send, by the variable the trainer reads
    (``ROLLOUT_API_KEY``, ``WORDLE_API_KEY``): the line reads each from its file
    (``VAR="$(cat FILE)"``), so that no key is printed."""
    urls = urls or {}
    names = {s.key: s.name for s in specs}
    env = cfg.env_space

    def url(key: str) -> str:
        return urls.get(key) or space_url(owner, names[key])

    keys = "".join(f'{var}="$(cat {path})" ' for var, path in sorted((key_files or {}).items()))
    task = "" if env.default else f"TASK={env.task} "
    return (
        f"{keys}make train {task}BUCKET={owner}/{cfg.bucket_name} "
        f"VLLM_URL={url('rollout')} ENV_URL={url(env.key)} MODEL={cfg.model}"
    )
