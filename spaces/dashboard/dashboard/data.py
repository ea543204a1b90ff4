"""The dashboard's data layer: a run's bucket -> pandas DataFrames. Imports neither torch nor
gradio.

It reads only ``manifest.json``, ``replicas/<id>.json`` and ``metrics/trainer.json`` (never payload
files), with conditional reads (``Store.read_if_changed``: on ``hf://`` one resolver request per
file, answered 304 when unchanged), lists ``replicas/`` (a Hub API request) at most every
``list_every_s``, re-reads heartbeats at most every ``heartbeat_every_s``, and reads less often
while nothing changes (:meth:`BucketReader.next_read_delay_s`). Parsed objects are cached, and what
was seen is kept in a bounded history, so plots keep versions, syncs and steps that retention or
the heartbeat's bounded ``recent`` list have since dropped.

On an ``hf://`` bucket whose event feed is live (``deltasync.hub_events``, started at the first
read; ``follow_events``), the reader is told which of its files changed: a read is due when one
did (still at most every ``min_interval_s``) or when the feed asks for a reconcile, otherwise
once a minute (a safety read); within a read, a file the feed reports unchanged is not requested
again, and ``replicas/`` is listed only when a heartbeat appears or goes (and at reconcile and
safety reads). Where the feed is not available the reader polls as described above.

An adapter run (``Manifest.adapter`` set) is read the same way: its versions, payload bytes and
the replicas' held versions are the adapter's; :attr:`RunView.adapter` names it, and the
view's lines say "adapter version".

Sync lag uses the one definition of ``deltasync.status``: ``lag_versions`` = trainer version -
replica version; ``lag_s`` = seconds from the publish of the trainer's newest version to the moment
considered, while the replica is behind (0 when it holds the newest). Times are unix seconds in the
objects and naive UTC ``datetime64`` in the frames' ``time`` columns.

States of a :class:`RunView`, each set by the kind of its ``problem``
(:class:`~dashboard.problems.ProblemKind`): ``waiting`` (no folder, no manifest or no version yet:
"waiting for the first version"), ``ok`` (no problem), and ``error`` (the run root cannot be read:
"the run root is not a folder", the store's own line such as "bucket unreadable: token lacks
access", or "bucket unreadable: storage error (retrying)"; or its manifest does not parse and no
good one was seen: "the manifest does not parse", which waiting alone does not mend, as the
trainer writes the manifest whole; the next poll still reads it again). A file skipped while the
run is still shown is a ``warnings`` entry ("the heartbeat of replica X does not parse").
``RunView.message`` and each problem's ``detail`` name the URI, the file and why (server log,
private pages); ``RunView.public`` and ``Problem.public`` name the kind only: no URI, local path
or exception text. Errors are turned into these states on purpose and logged; nothing here raises
for a bad bucket.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from deltasync.errors import StoreAccessError, StoreError, StoreNotFoundError, StoreRateLimitError
from deltasync.manifest import MANIFEST_PATH, Manifest, VersionEntry
from deltasync.status import (
    REPLICAS_DIR,
    TRAINER_METRICS_PATH,
    EvalResult,
    FleetMember,
    ReplicaHeartbeat,
    StepMetrics,
    SyncRecord,
    TaskFigure,
    TrainerMetrics,
)
from deltasync.store import Store, resolve_uri

from .frames import FramesFromHistory
from .problems import Problem, ProblemKind
from .view import ReadStats, RunView, version_noun

log = logging.getLogger("dashboard")


class BucketReader(FramesFromHistory):
    """Polls one run's bucket cheaply and keeps what it saw.

    Args:
        bucket: the run root: a folder, ``file://``, ``memory://``, ``hf://buckets/...``, ``s3://``.
        stalled_after_s: a replica whose heartbeat is older than this (seconds) is flagged
            STALLED (at least 150 on remote stores, where idle heartbeats are 60 s apart).
        history: most versions, syncs per replica, heartbeat samples per replica and trainer steps
            kept for the plots.
        retries: attempts per storage call (kept low: the next poll retries anyway).
        store: an already opened Store for ``bucket`` (tests); default: opened on the first poll.
        min_interval_s: shortest seconds between two reads of the bucket (right after a
            change); default 0 on a local folder or ``memory://``, 5 elsewhere.
        max_interval_s: longest seconds between reads while nothing changes (doubling from
            ``min_interval_s``); default 30.
        list_every_s: seconds between listings of ``replicas/`` (default 0 local, 60 remote).
        heartbeat_every_s: seconds between re-reads of known heartbeats (default 0 local, 30
            remote).
        clock: monotonic seconds (tests pass a simulated clock).
        follow_events: on an ``hf://`` bucket, follow its event feed (``deltasync.hub_events``)
            and read when it reports a change; False: poll only.

    Thread-safe: concurrent :meth:`read` calls are serialised.
    """

    def __init__(
        self,
        bucket: str,
        stalled_after_s: float = 30.0,
        history: int = 2000,
        retries: int = 2,
        store: Store | None = None,
        min_interval_s: float | None = None,
        max_interval_s: float = 30.0,
        list_every_s: float | None = None,
        heartbeat_every_s: float | None = None,
        clock=time.monotonic,
        follow_events: bool = True,
    ):
        if not bucket:
            raise ValueError("expected a bucket URI (a folder, file://, memory://, hf://, s3://)")
        if stalled_after_s <= 0 or history < 1:
            raise ValueError(
                f"expected stalled_after_s > 0 and history >= 1, found {stalled_after_s}, {history}"
            )
        self.bucket = bucket
        self.stalled_after_s = stalled_after_s
        self.history = history
        self.retries = retries
        self._store = store
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[str, object]] = {}  # path -> (read tag, parsed object)
        self._stats = ReadStats()
        resolved = resolve_uri(bucket)
        remote = not resolved.startswith(("file://", "memory://"))
        self.min_interval_s = (
            min_interval_s if min_interval_s is not None else (5.0 if remote else 0.0)
        )
        self.max_interval_s = max(self.min_interval_s, max_interval_s)
        self.list_every_s = list_every_s if list_every_s is not None else (60.0 if remote else 0.0)
        self.heartbeat_every_s = (
            heartbeat_every_s if heartbeat_every_s is not None else (30.0 if remote else 0.0)
        )
        if remote:  # replicas write heartbeats at most every 60 s on remote stores
            self.stalled_after_s = max(self.stalled_after_s, 150.0)
        self._clock = clock
        self._delay = self.min_interval_s
        self._changed = False
        self._listed_at: float | None = None
        self._hb_read_at: float | None = None
        self._listing: list[str] = []
        self._evals: dict[tuple[str, int], EvalResult] = {}
        self._figures: list[TaskFigure] = []  # the run's task figures, as the metrics declare
        self._fleet: dict[str, FleetMember] = {}  # replica id -> the trainer's view of it
        self._fleet_at: float | None = None  # updated_at of the metrics that view came from
        self._served_per_s: dict[str, float] = {}  # replica id -> answers/s between two views
        self.follow_events = follow_events
        self.feed = None  # deltasync.hub_events.ChangeFeed, started at the first read on hf://
        self._changed_event = threading.Event()  # set by the feed's thread
        self._trusted: dict[str, str] | None = None  # this read: feed-reported changes (or None)
        self._dirty: set[str] = set()  # files the feed reported changed and not read since
        self._missing: set[str] = set()  # files found missing at their last read
        self._read_at: float | None = None  # clock time of the last read
        self._safety_at: float | None = None  # clock time of the last full (reconcile) read
        self._reset_history(None)

    def next_read_delay_s(self) -> float:
        """Seconds (after the last read) until the next read is worth doing: ``min_interval_s``
        after a read that saw a change, doubling while nothing changes, up to ``max_interval_s``.
        With a live event feed: ``min_interval_s`` once the feed reported a change or asks for a
        reconcile, else its ``safety_poll_s``."""
        if self.feed is None or not self.feed.live:
            return self._delay
        if self.feed.pending or self._changed or self._dirty:
            return self.min_interval_s
        return max(self._delay, self.feed.safety_poll_s)

    def wait_for_change(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the event feed to report a change or a
        reconcile (returns at once when one is pending); whether one did. Without a feed it
        just waits."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._changed_event.clear()
            if self.feed is not None and self.feed.pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not self._changed_event.wait(left):
                return False

    def close(self) -> None:
        """Stop following the event feed (reads still work, polling)."""
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def _reset_history(self, run_id: str | None) -> None:
        self._run_id = run_id
        self._versions: dict[int, VersionEntry] = {}
        self._syncs: dict[str, dict[tuple[int, float], SyncRecord]] = {}
        self._samples: dict[str, dict[float, ReplicaHeartbeat]] = {}
        self._steps: dict[int, StepMetrics] = {}
        self._heartbeats: dict[str, ReplicaHeartbeat] = {}
        self._manifest: Manifest | None = None
        self._evals = {}
        self._figures = []

    # ------------------------------------------------------------------------------ reading
    def read(self, now: float | None = None) -> RunView:
        """Poll the bucket once and build every frame.

        Args:
            now: unix seconds to compute heartbeat ages and lag against (default: the clock).

        Returns:
            A :class:`RunView`; bucket problems become its ``problem`` and ``waiting``/``error``
            state, files skipped its ``warnings``.
        """
        with self._lock:
            now = time.time() if now is None else now
            self._stats = ReadStats()
            self._changed = False
            self._take_feed()
            warnings: list[Problem] = []
            try:
                problem = self._poll(warnings)
            except (StoreError, OSError) as e:  # shown in the UI on purpose: the next poll retries
                log.warning("dashboard: cannot read %s: %s", self.bucket, e)
                detail = f"cannot read `{self.bucket}`: {e}"
                if isinstance(e, StoreAccessError):
                    problem = Problem(ProblemKind.ACCESS_REFUSED, detail, summary=e.summary)
                elif isinstance(e, StoreRateLimitError):
                    problem = Problem(ProblemKind.RATE_LIMITED, detail)
                else:
                    problem = Problem(ProblemKind.STORE_FAILED, detail)
                self._changed = True  # an error is news: keep reading at the fastest
            self._dirty &= set(self._cache)  # a file not kept is read in full next time anyway
            m = self._manifest
            if problem is None:
                state, message = "ok", self._ok_message()
                noun = version_noun(m.adapter if m else None)
                public = f"{len(m.versions) if m else 0} {noun}(s) in the manifest"
            else:
                state, message, public = problem.kind.state, problem.detail, problem.public
            if self._changed or state != "ok":
                self._delay = self.min_interval_s
            else:
                self._delay = min(
                    max(self._delay, self.min_interval_s, 1.0) * 2, self.max_interval_s
                )
            latest = m.latest if m else None
            return RunView(
                bucket=self.bucket,
                state=state,
                message=message,
                public=public,
                problem=problem,
                read_at=now,
                run_id=m.run_id if m else None,
                trainer_version=latest.version if latest else None,
                trainer_published_at=latest.created_at if latest else None,
                adapter=m.adapter if m else None,
                warnings=warnings,
                frames=self._frames(now),
                stats=self._stats,
            )

    def _take_feed(self) -> None:
        """Decide what this read may skip: with a live feed, the files it reported changed are
        read (conditionally) and the others answered from the cache; a reconcile (first read,
        reconnect, ``reset``, a dropped stream) or a safety read (``safety_poll_s`` since the last
        full one) reads everything."""
        now = self._clock()
        self._read_at = now
        self._trusted = None
        feed = self.feed
        if feed is None:
            return
        changes, reconcile = feed.take()
        self._dirty |= set(changes)
        safety = self._safety_at is None or now - self._safety_at >= feed.safety_poll_s
        if not feed.live or reconcile or safety:
            self._safety_at = now
            self._dirty.clear()
            return
        self._trusted = changes
        listed = set(self._listing)
        for path, op in changes.items():
            if path.startswith(REPLICAS_DIR + "/") and (op == "delete") == (path in listed):
                self._listed_at = None  # a heartbeat appeared or went: list again

    def _start_feed(self, store: Store) -> None:
        if self.follow_events and self.feed is None and getattr(store, "hub", None) is not None:
            from deltasync.hub_events import follow_changes

            watched = [MANIFEST_PATH, TRAINER_METRICS_PATH, REPLICAS_DIR + "/"]
            self.feed = follow_changes(store, watched, self._changed_event.set, owner=self)

    def _open(self) -> tuple[Store | None, Problem | None]:
        """The Store, or None and the problem that stops the poll: a local run root that does not
        exist yet (it is not created) or that is not a folder (checked on every poll, one stat,
        so a root replaced by a file is named as such).

        Raises:
            StoreError: the URI is not a usable store URI.
        """
        resolved = resolve_uri(self.bucket)
        if resolved.startswith("file://"):
            path = resolved[len("file://") :]
            if os.path.exists(path) and not os.path.isdir(path):
                detail = (
                    f"cannot read `{self.bucket}`: it is a file, not a folder: pass the run's root "
                    "folder"
                )
                log.warning("dashboard: %s", detail)
                return None, Problem(ProblemKind.ROOT_NOT_A_FOLDER, detail)
            if self._store is None and not os.path.exists(path):
                detail = f"`{resolved}` does not exist yet: waiting for the first version"
                return None, Problem(ProblemKind.NOT_PUBLISHED, detail)
        if self._store is None:
            try:
                self._store = Store(resolved, retries=self.retries, backoff_s=0.2, create=False)
            except ValueError as e:  # bad URI (e.g. hf:// not a bucket, unknown protocol)
                raise StoreError(f"not a usable store URI: {e}") from e
        self._start_feed(self._store)
        return self._store, None

    def _poll(self, warnings: list[Problem]) -> Problem | None:
        """Read the manifest, the heartbeats and the metrics; the problem that keeps the run from
        being shown (None: it is shown; files skipped are added to ``warnings``)."""
        store, problem = self._open()
        if store is None:
            return problem
        problem = self._read_manifest(store, warnings)
        self._read_heartbeats(store, warnings)
        self._read_metrics(store, warnings)
        return problem

    def _read_cached(self, store: Store, path: str, parse):
        """Parsed content of ``path``, downloaded and parsed again only if it changed (one
        conditional read); None if absent.

        Raises:
            ValueError (pydantic.ValidationError): the content does not parse.
            StoreError: the store failed.
        """
        hit = self._cache.get(path)
        known = hit is not None or path in self._missing
        if known and self._trusted is not None and path not in self._dirty:
            return hit[1] if hit else None  # the live feed reported no change: no request
        self._stats.stat_calls += 1
        self._dirty.discard(path)
        self._missing.discard(path)
        try:
            data, tag = store.read_if_changed(path, hit[0] if hit else None)
        except StoreNotFoundError:
            self._missing.add(path)
            if self._cache.pop(path, None) is not None:
                self._changed = True
            return None
        if data is None and hit is not None:
            return hit[1]
        self._changed = True
        data = data if data is not None else store.read_bytes(path)
        self._stats.files_read += 1
        self._stats.bytes_read += len(data)
        self._cache.pop(path, None)
        obj = parse(data)
        self._cache[path] = (tag, obj)
        return obj

    def _read_manifest(self, store: Store, warnings: list[Problem]) -> Problem | None:
        """Read the manifest and add its versions to the history; the problem that keeps the run
        from being shown (None: it is shown, the last good manifest included)."""
        try:
            manifest = self._read_cached(store, MANIFEST_PATH, Manifest.from_json)
        except ValueError as e:  # damaged (written whole, never half): shown, and read again
            first = _why(e)
            log.warning("dashboard: %s/%s does not parse: %s", self.bucket, MANIFEST_PATH, first)
            if self._manifest is not None:
                detail = f"{MANIFEST_PATH} does not parse ({first}); showing the last good one"
                warnings.append(Problem(ProblemKind.FILE_SKIPPED, detail))
                return None
            detail = (
                f"`{self.bucket}/{MANIFEST_PATH}` does not parse ({first}): the file is damaged "
                "(the trainer writes it whole); replace it with a valid manifest or point the "
                "dashboard at another run root"
            )
            return Problem(ProblemKind.MANIFEST_UNPARSABLE, detail)
        if manifest is None:
            if self._manifest is not None:
                detail = f"{MANIFEST_PATH} disappeared; showing the last one read"
                warnings.append(Problem(ProblemKind.FILE_SKIPPED, detail))
                return None
            payloads = [p for d in ("anchors", "deltas") for p in self._ls(store, d)]
            detail = (
                f"{len(payloads)} payload file(s) but no {MANIFEST_PATH} yet: the trainer is "
                "writing its first version"
                if payloads
                else f"no {MANIFEST_PATH} yet"
            )
            detail = f"`{self.bucket}`: {detail}; waiting for the first version"
            return Problem(ProblemKind.NOT_PUBLISHED, detail)
        if manifest.run_id != self._run_id:
            if self._run_id is not None:
                log.info(
                    "dashboard: %s now holds run %s (was %s)",
                    self.bucket,
                    manifest.run_id,
                    self._run_id,
                )
            self._reset_history(manifest.run_id)
        self._manifest = manifest
        for v in manifest.versions:
            self._versions[v.version] = v
        _trim(self._versions, self.history)
        if not manifest.versions:
            detail = f"`{self.bucket}`: run {manifest.run_id} has no version yet"
            return Problem(ProblemKind.NOT_PUBLISHED, detail)
        return None

    def _ok_message(self) -> str:
        m = self._manifest
        n, noun = (len(m.versions), version_noun(m.adapter)) if m else (0, "version")
        return f"`{self.bucket}`: {n} {noun}(s) in the manifest"

    def _ls(self, store: Store, prefix: str) -> list[str]:
        """Relative paths of the objects under ``prefix`` ([] if none); one listing request."""
        self._stats.stat_calls += 1
        return store.ls(prefix)

    def _skip_unparsable(
        self,
        path: str,
        error: ValueError,
        warnings: list[Problem],
        replica_id: str | None = None,
    ) -> None:
        """Log and add to ``warnings`` that the object at ``path`` does not parse and is skipped
        (``replica_id``: it is that replica's heartbeat)."""
        first = _why(error)
        log.warning("dashboard: skipping %s/%s: %s", self.bucket, path, first)
        detail = f"{path} does not parse ({first}); skipped"
        if replica_id is None:
            warnings.append(Problem(ProblemKind.FILE_SKIPPED, detail))
        else:
            kind = ProblemKind.HEARTBEAT_UNPARSABLE
            warnings.append(Problem(kind, detail, replica_id=replica_id))

    def _read_heartbeats(self, store: Store, warnings: list[Problem]) -> None:
        now = self._clock()
        timer_due = self._listed_at is None or now - self._listed_at >= self.list_every_s
        if self._trusted is not None and self._listed_at is not None:
            timer_due = False  # the live feed says when a heartbeat appears or goes
        if timer_due:
            self._listing = self._ls(store, REPLICAS_DIR)
            self._listed_at = now
        elif self._hb_read_at is not None and now - self._hb_read_at < self.heartbeat_every_s:
            return  # heartbeats change slowly; keep the last ones read
        self._hb_read_at = now
        listing = self._listing
        heartbeats = {}
        for path in sorted(listing):
            name = path.rsplit("/", 1)[-1]
            if not name.endswith(".json") or name.startswith("."):  # ".tmp-*": a write underway
                continue
            try:
                hb = self._read_cached(store, path, ReplicaHeartbeat.model_validate_json)
            except ValueError as e:  # one bad heartbeat must not hide the others: skip it
                replica_id = name[: -len(".json")]  # replicas/<id>.json (status.heartbeat_path)
                self._skip_unparsable(path, e, warnings, replica_id)
                continue
            if hb is None:
                continue
            heartbeats[hb.replica_id] = hb
            samples = self._samples.setdefault(hb.replica_id, {})
            samples[hb.updated_at] = hb
            _trim(samples, self.history)
            syncs = self._syncs.setdefault(hb.replica_id, {})
            for rec in hb.recent:
                syncs[(rec.version, rec.applied_at)] = rec
            _trim(syncs, self.history)
        for cached in [p for p in self._cache if p.startswith(REPLICAS_DIR + "/")]:
            if cached not in listing:  # the replica left
                del self._cache[cached]
        self._heartbeats = heartbeats

    def _read_metrics(self, store: Store, warnings: list[Problem]) -> None:
        try:
            metrics = self._read_cached(
                store, TRAINER_METRICS_PATH, TrainerMetrics.model_validate_json
            )
        except ValueError as e:  # skipped this poll; the trainer rewrites it every step
            self._skip_unparsable(TRAINER_METRICS_PATH, e, warnings)
            return
        if metrics is None:
            return
        for s in metrics.steps:
            self._steps[s.step] = s
        _trim(self._steps, self.history)
        for ev in metrics.evals:
            self._evals[(ev.label, ev.step)] = ev
        self._figures = list(metrics.figures)
        prev, prev_at = self._fleet, self._fleet_at
        self._fleet = {m.replica_id: m for m in metrics.fleet}
        if prev_at is not None and metrics.updated_at > prev_at:  # requests/s since the last view
            dt = metrics.updated_at - prev_at
            self._served_per_s = {
                rid: max(0.0, (m.served - prev[rid].served) / dt)
                for rid, m in self._fleet.items()
                if rid in prev
            }
        self._fleet_at = metrics.updated_at


def _why(e: ValueError) -> str:
    """One line on why a file did not parse (the first pydantic error, with where it is)."""
    errors = getattr(e, "errors", None)
    if callable(errors) and errors():
        err = errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        return f"{loc}: {err['msg']}" if loc else err["msg"]
    return str(e).splitlines()[0]


def _trim(d: dict, keep: int) -> None:
    """Drop the smallest keys of ``d`` until it holds ``keep`` items (keys are ordered)."""
    if len(d) > keep:
        for k in sorted(d)[: len(d) - keep]:
            del d[k]
