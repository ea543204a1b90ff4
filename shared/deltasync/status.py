"""Status objects in the bucket, shared by replicas, the trainer and the dashboard.

Sync lag is defined once, here: ``lag_versions = trainer_version - replica_version`` and
``lag_s`` = seconds from the publish (manifest commit) of the newest version to now while a replica
is behind, 0 when it holds the newest. The same names appear in logs, heartbeats and the dashboard.
Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import StoreNotFoundError
from .store import Store

log = logging.getLogger("deltasync.status")

REPLICAS_DIR = "replicas"
TRAINER_METRICS_PATH = "metrics/trainer.json"


def heartbeat_path(replica_id: str) -> str:
    """Bucket path of a replica's heartbeat: ``replicas/<replica_id>.json``."""
    if not replica_id or "/" in replica_id:
        raise ValueError(f"expected a replica id without '/', found {replica_id!r}")
    return f"{REPLICAS_DIR}/{replica_id}.json"


def lag_versions(trainer_version: int | None, replica_version: int | None) -> int | None:
    """Trainer version minus replica version (None while either is unknown)."""
    if trainer_version is None or replica_version is None:
        return None
    return max(0, trainer_version - replica_version)


def lag_s(published_at: float | None, now: float | None = None) -> float:
    """Seconds from ``published_at`` (unix s: the commit of the newest version, passed only while
    the replica is behind it) to ``now`` (default: the current time); 0.0 when None."""
    if published_at is None:
        return 0.0
    return max(0.0, (time.time() if now is None else now) - published_at)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SyncRecord(_Strict):
    """One sync of a replica: from ``from_version`` to ``version`` (one or more steps)."""

    version: int
    from_version: int | None
    kind: Literal["delta", "anchor", "chain"]  # chain: several deltas applied in one pause
    steps: int = 1
    bytes: int  # downloaded payload bytes
    fetch_s: float  # download + digest + parse, while still serving
    decode_s: float  # decode + verify, while still serving
    paused_s: float  # generation paused: apply + version bookkeeping
    apply_s: float  # the in-memory apply inside the pause
    published_at: float  # unix s: manifest commit of ``version``
    applied_at: float  # unix s: generation resumed on ``version``
    apply_path: str = ""  # "in-place" | "reload" | "cpu-dict"

    @property
    def lag_s(self) -> float:
        """Seconds from publish to applied."""
        return self.applied_at - self.published_at


class ReplicaHeartbeat(_Strict):
    """``replicas/<replica_id>.json``: what a replica holds and how its syncs went."""

    replica_id: str
    held_version: int | None
    newest_seen: int | None
    lag_versions: int | None
    lag_s: float
    status: Literal["starting", "ok", "syncing", "error", "recovering", "stopped"]
    apply_path: str = ""
    last_error: str | None = None
    errors: int = 0
    updated_at: float = Field(default_factory=time.time)
    recent: list[SyncRecord] = Field(default_factory=list)  # newest last, bounded
    # Base URL where the replica serves the OpenAI API under /v1 (its public front), announced
    # so that a trainer can discover the fleet from the bucket; None: not announced.
    url: str | None = None

    @classmethod
    def empty(cls, replica_id: str, **fields) -> ReplicaHeartbeat:
        """The heartbeat of a replica that holds no version yet (``fields`` override)."""
        none = dict(held_version=None, newest_seen=None, lag_versions=None, lag_s=0.0)
        return cls(**{"replica_id": replica_id, "status": "starting", **none, **fields})


class TaskFigure(_Strict):
    """A figure a task reports of its episodes, declared once by the task
    (``trainer.task.base.Task.figures``) and written once per run (``TrainerMetrics.figures``):
    the step line, the summary and the dashboard show the declared figures, in declared order,
    under their labels.

    A figure whose value is named counts (``{code: n}``, e.g. Wordle's invalid moves by code;
    ``counts`` set) is recorded as one value per count, ``"<name>/<code>"``; the step line and
    the dashboard show the other figures.
    """

    name: str  # the key in StepMetrics.figures / EvalResult.figures, e.g. "win_rate"
    label: str  # what people read, e.g. "win rate"
    unit: str = ""  # "share" (0..1, shown as a percentage), "games", ... ("" : a plain number)
    higher_is_better: bool | None = True  # None: neither (a count, a mean length)
    steps: bool = True  # measured on each step's training episodes (``Task.step_figures``)
    evals: bool = True  # measured by the held-out evaluation (``Task.evaluate``)
    headline: bool = False  # drawn on the dashboard's learning curve and named in its summary
    counts: bool = False  # the value is named counts {code: n}, recorded as "<name>/<code>"


# Wordle's figures, fields of their own in StepMetrics / EvalResult before ``figures`` existed:
# a file written then is read with these declarations and its fields moved into ``figures``.
LEGACY_FIGURES = (
    TaskFigure(name="win_rate", label="win rate", unit="share", steps=False, headline=True),
    TaskFigure(name="consistent_rate", label="consistent", unit="share", headline=True),
    TaskFigure(name="valid_guess_rate", label="valid", unit="share", steps=False, headline=True),
    TaskFigure(name="valid_rate", label="valid", unit="share", evals=False, headline=True),
    TaskFigure(name="wellformed_rate", label="well-formed calls", unit="share", steps=False),
    TaskFigure(name="guesses_mean", label="guesses a game", unit="guesses", higher_is_better=None),
    TaskFigure(
        name="invalid_rate",
        label="invalid moves a turn",
        unit="share",
        higher_is_better=False,
        steps=False,
    ),
    TaskFigure(
        name="stopped_early_rate",
        label="stopped early",
        unit="share",
        higher_is_better=False,
        steps=False,
    ),
    TaskFigure(
        name="invalid_reasons",
        label="invalid moves",
        unit="moves",
        higher_is_better=False,
        counts=True,
    ),
)
_LEGACY_STEP = ("consistent_rate", "valid_rate", "guesses_mean", "invalid_reasons")
_LEGACY_EVAL = (
    "wellformed_rate",
    "valid_guess_rate",
    "win_rate",
    "guesses_mean",
    "consistent_rate",
    "invalid_rate",
    "stopped_early_rate",
)


def flat_figures(values: dict) -> dict[str, float]:
    """A task's figures as recorded: numbers as they are, named counts ``{code: n}`` as one value
    per count under ``"<name>/<code>"``, None (not measured) and anything else left out."""
    out: dict[str, float] = {}
    for name, v in values.items():
        if isinstance(v, dict):
            out.update({f"{name}/{k}": float(n) for k, n in v.items() if _number(n)})
        elif _number(v):
            out[name] = float(v)
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _legacy_figures(data, fields: tuple[str, ...]):
    """``data`` with the old Wordle fields (``LEGACY_FIGURES``) moved into ``figures``."""
    if not isinstance(data, dict) or not any(k in data for k in fields):
        return data
    data = dict(data)
    old = {k: data.pop(k) for k in fields if k in data}
    data["figures"] = {**flat_figures(old), **(data.get("figures") or {})}
    return data


class StepMetrics(_Strict):
    """Metrics of one trainer step (None where not measured)."""

    step: int
    version: int | None = None
    time: float = Field(default_factory=time.time)
    reward: float | None = None
    loss: float | None = None
    staleness: dict[str, int] = Field(default_factory=dict)  # histogram: "0": n, "1": n, ...
    diff_s: float | None = None
    encode_s: float | None = None
    upload_s: float | None = None
    bytes: int | None = None
    density: float | None = None
    stale_fraction: float | None = None  # discarded / generated samples so far (TRL's counters)
    turns_mean: float | None = None  # assistant turns per episode (TRL's rollout/turns_mean)
    games: int | None = None  # training games (episodes) taken since the previous step
    # the task's own figures of those games, by name (``TaskFigure``, declared in
    # ``TrainerMetrics.figures``); a figure the step did not measure is absent
    figures: dict[str, float] = Field(default_factory=dict)
    kl: float | None = None  # TRL's kl (trainer policy against the sampling logprobs)
    clipped: float | None = None  # TRL's clip_ratio/region_mean: share of tokens clipped
    tokens_per_s: float | None = None  # forwarded tokens of the step / its seconds
    # episodes taken since the previous step that the environment failed (no reward): not in
    # ``games``; None in files written before it was counted
    dropped_episodes: int | None = None
    # syncs between publishes (the publisher's cadence, ``deltasync.cadence``) at this step; None
    # in files written before it was recorded
    publish_every: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data):
        return _legacy_figures(data, _LEGACY_STEP)


class EvalResult(_Strict):
    """A fixed set of held-out episodes played through a replica (the task's ``evaluate``).

    ``reward_mean`` / ``reward_se`` are the mean environment reward per episode and its standard
    error (sample std / sqrt(n)); ``figures`` are the task's own figures of the evaluation by
    name (``TaskFigure``, declared in ``TrainerMetrics.figures``; e.g. Wordle's ``win_rate``).
    Files written before ``figures`` existed carry Wordle's figures as fields of their own: they
    are read into ``figures`` (``LEGACY_FIGURES``).
    """

    label: str  # "before" (the warm start), "step-<N>" (the learning curve), "after" (final)
    step: int  # trainer step at which it was played
    version: int | None = None  # bucket version the replica served
    episodes: int
    reward_mean: float
    reward_se: float
    figures: dict[str, float] = Field(default_factory=dict)
    time: float = Field(default_factory=time.time)

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data):
        return _legacy_figures(data, _LEGACY_EVAL)


class FleetMember(_Strict):
    """One rollout replica as the trainer's fleet router sees it (``trainer.fleet``)."""

    url: str
    replica_id: str
    state: Literal["joining", "serving", "draining", "down", "gone"]
    held_version: int | None
    inflight: int  # requests sent and not answered yet
    served: int  # requests it answered, since the trainer started
    failed: int  # requests and health checks that failed


class TrainerMetrics(_Strict):
    """``metrics/trainer.json``: the trainer's recent steps, rewritten after each step, and the
    evaluations played so far."""

    run_id: str
    updated_at: float = Field(default_factory=time.time)
    steps: list[StepMetrics] = Field(default_factory=list)
    evals: list[EvalResult] = Field(default_factory=list)
    fleet: list[FleetMember] = Field(default_factory=list)  # at the last write
    # the task's figures (``TaskFigure``) in the order it declared them; a file written before
    # they were declared holds Wordle's figures (``LEGACY_FIGURES``)
    figures: list[TaskFigure] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data):
        if isinstance(data, dict) and "figures" not in data:
            data = {**data, "figures": [f.model_dump() for f in LEGACY_FIGURES]}
        return data


def write_heartbeat(store: Store, hb: ReplicaHeartbeat, keep_recent: int = 50) -> None:
    """Write a heartbeat, keeping its ``keep_recent`` newest sync records."""
    hb.recent = hb.recent[-keep_recent:]
    store.write_bytes(heartbeat_path(hb.replica_id), hb.model_dump_json().encode())


def read_heartbeats(store: Store) -> dict[str, ReplicaHeartbeat]:
    """All replica heartbeats in the bucket that parse, by replica id ({} if none).

    A heartbeat that does not parse (damaged bytes, wrong types, or fields of a newer schema this
    reader forbids) is skipped with a warning naming the file and the error (once per file and
    error, not at every read); the others are returned.

    Raises:
        StoreError: the store failed listing or reading (a file that vanished between the
            listing and the read is skipped: its replica left).
    """
    out = {}
    for path in store.ls(REPLICAS_DIR):
        if not path.endswith(".json") or path.rsplit("/", 1)[-1].startswith("."):
            continue  # not a heartbeat, or a local temp file being written
        try:
            data = store.read_bytes(path)
        except StoreNotFoundError:  # deleted between list and read: the replica left
            continue
        try:
            hb = ReplicaHeartbeat.model_validate_json(data)
        except (ValueError, RecursionError) as e:  # pydantic.ValidationError is a ValueError
            _warn_skipped(f"{store.uri}/{path}", e)
            continue
        out[hb.replica_id] = hb
    return out


_SKIPPED: dict[str, str] = {}  # heartbeat file -> the error last warned about
_SKIPPED_MAX = 1024


def _warn_skipped(where: str, error: BaseException) -> None:
    """Log a skipped heartbeat at WARNING the first time this file fails with this error (a
    trainer reads heartbeats every few seconds), at DEBUG after that."""
    what = " ".join(str(error).split())[:300]
    level = logging.DEBUG if _SKIPPED.get(where) == what else logging.WARNING
    if len(_SKIPPED) >= _SKIPPED_MAX:
        _SKIPPED.clear()
    _SKIPPED[where] = what
    log.log(
        level,
        "heartbeat %s skipped: it does not parse as a ReplicaHeartbeat (%s: %s); the replica "
        "that writes it is left out until it writes one this reader can read (same deltasync "
        "version)",
        where,
        type(error).__name__,
        what,
    )
