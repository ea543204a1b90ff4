"""Trainer side of the sync protocol: ``DeltaPublisher``.

``publish(named_tensors, step)`` diffs the model against the last PUBLISHED bf16 snapshot (exact for
any optimizer and any number of optimizer steps between publishes) and returns; ranking the
changes by exponent class and encoding them (``deltasync.publisher_encoder``), writing and uploading run on
a background thread. If uploads fall behind, a version that has not started encoding is folded
into the next one (coalesced) instead of queueing without bound. Payload files
are uploaded before the manifest that names them; retention deletes files only after a manifest
that no longer names them is committed. See docs/PROTOCOL.md.

Per version two ``Store.write_many`` batches (1 API request each on ``hf://``, the Xet write token
kept): the payload parts plus the retention deletes already due, then ``manifest.json`` plus the
lease when due; ONE batch with all of it (the manifest last) on a store whose batches are
all-or-nothing (``Store.atomic_batches``; not a Hugging Face bucket's).

On ``hf://`` the trainer calls :meth:`DeltaPublisher.offer` each sync and the publisher publishes
every k-th (``deltasync.cadence.PublishCadence``: k follows the token's request budget and rises
on a 429); a 429 that outlasts the store's retries is waited out (its ``Retry-After``), never an
outage nor an error.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from . import codec
from .adapter import check_adapter, check_adapter_names
from .bucket_writer import (
    PayloadWriter,
    commit_manifest,
    read_manifest_at_start,
    remove_orphans,
)
from .cadence import PublishCadence
from .errors import (
    ManifestError,
    ModelMismatchError,
    StoreAccessError,
    StoreError,
    StoreNotFoundError,
    StoreRateLimitError,
)
from .lease import LeaseKeeper
from .manifest import (
    AdapterInfo,
    ModelFingerprint,
    VersionEntry,
    model_digest,
)
from .publisher_config import PublisherConfig  # also imported from here by trainers and tests
from .publisher_encoder import ChangeEncoder
from .signing import RunKey, trusted_history
from .snapshot import Snapshot, compose_changes
from .store import Store, open_store

log = logging.getLogger("deltasync.publisher")


@dataclass
class _Job:
    version: int
    step: int | None
    base_version: int | None  # None: anchor only
    changes: dict[str, codec.TensorChange]
    anchor: dict[str, np.ndarray] | None  # immutable copy of the full state, when anchoring
    digests: dict[str, str]  # post-update digest of every tensor of the model
    total: int
    coalesced: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def changed(self) -> int:
        return sum(c.n_changed for c in self.changes.values())


@dataclass(frozen=True)
class PublishOutage:
    """The store failed the publisher's last attempt (after the store's own retries) and
    publishing waits for it to answer again; training goes on meanwhile.

    Attributes:
        since: unix s of the first failed attempt of this outage.
        failures: attempts that failed so far (the store retries each one itself first).
        last_error: the last failure, ``"<type>: <message>"`` (at most 500 characters).
        committed: the newest version in the bucket's manifest (the newest replicas can reach),
            None before the first.
        newest: the newest version ``publish()`` queued, None before the first; it is published
            as an anchor when the store answers (the versions between are folded into it).
        ended_at: unix s of the commit that ended the outage; None while it lasts.
    """

    since: float
    failures: int
    last_error: str
    committed: int | None = None
    newest: int | None = None
    ended_at: float | None = None

    @property
    def pending(self) -> int:
        """Versions queued and not committed (0 when nothing waits)."""
        if self.newest is None:
            return 0
        return max(0, self.newest - (-1 if self.committed is None else self.committed))

    def duration_s(self, now: float | None = None) -> float:
        """Seconds from :attr:`since` to :attr:`ended_at` (while it lasts: to ``now``, unix s,
        default the current time)."""
        end = self.ended_at if self.ended_at is not None else (now or time.time())
        return max(0.0, end - self.since)

    def describe(self) -> str:
        """One line: how long, how many attempts, what waits, the last error."""
        first = 0 if self.committed is None else self.committed + 1
        waiting = f"v{first}..v{self.newest} pending" if self.pending else "nothing pending"
        return (
            f"{self.duration_s():.1f}s, {self.failures} failed attempt(s), {waiting} "
            f"(committed: v{self.committed}); last error: {self.last_error}"
        )


def _is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` is a store failure that waiting may heal (network, 5xx, 429, after the
    store's own retries): not refused credentials or a missing bucket (``StoreAccessError``),
    not a missing object (``StoreNotFoundError``), not another writer or a bug."""
    return isinstance(exc, StoreError) and not isinstance(
        exc, (StoreAccessError, StoreNotFoundError)
    )


# close() waits this long (s) for an attempt already under way once it has given up on a failing
# store; the thread is a daemon, so a stuck attempt does not keep the process alive
_JOIN_AFTER_GIVING_UP_S = 60.0


class DeltaPublisher:
    """Publishes model versions to a bucket run as anchors and sparse deltas.

    Args:
        store: a Store or URI (see ``deltasync.store``); the run lives at its root.
        run_id: a name for the run; default: the existing manifest's, else a new uuid.
        config: :class:`PublisherConfig`.
        adapter: for an adapter run (``deltasync.adapter``), the adapter recorded in every
            manifest; the tensors published are then PEFT adapter keys. None: full weights.
        signer: the run key (``deltasync.signing.RunKey``) that signs every manifest commit; each
            payload file's SHA-256 is then computed from the bytes uploaded and signed with it.
            None: unsigned (replicas given a ``RUN_PUBLIC_KEY`` refuse such versions).

    Attributes:
        before_commit: None, or a function called with each version's ``VersionEntry`` after its
            payload is in the bucket and before the manifest names it (the commit point): the seam
            where tests and ``make e2e`` damage an object as a faulty bucket would. It runs on the
            publisher's thread; an exception it raises fails that publish.
        outage: the store outage publishing is waiting out (:class:`PublishOutage`), or None.
            A store that fails for a while (network, 5xx, 429 after the store's retries) does not
            stop publishing: ``publish()`` keeps diffing and queueing (the versions fold into
            the newest), the thread retries, and the newest version is published as an ANCHOR
            when the store answers (the delta chain broke; no delta is ever committed whose base
            is not). Committed versions stay committed.
        retry_s: (first, longest) seconds between the thread's attempts while the store fails,
            doubling; each attempt is a whole publish, with the store's own retries inside (on
            hf:// about 30 s). The longest bounds how long after the store answers the newest
            version waits for its next attempt.
        close_wait_s: seconds :meth:`close` waits for a failing store to answer before it gives
            up on the versions not committed.
        on_outage: None, or a function called on the publisher's thread with the
            :class:`PublishOutage` when an outage starts and when it ends (``ended_at`` set).

    Raises:
        ConcurrentWriterError: another trainer holds a fresh writer lease on this run, or took
            it at the same moment (then this one stops and the other goes on).
        ManifestError: the existing manifest is unreadable, or belongs to another ``run_id``;
            or there is no manifest but payload files are there (a run whose manifest did not
            read, or one that never committed), unless ``config.new_run``. Nothing is deleted.
        AdapterMismatchError: the existing run has another adapter (or is of the other kind).
    """

    retry_s: tuple[float, float] = (1.0, 10.0)
    close_wait_s: float = 600.0
    on_outage: Callable[[PublishOutage], None] | None = None
    _outage: PublishOutage | None = None  # its committed/newest are filled in by _outage_view
    _outage_t0 = 0.0  # monotonic s of the outage's first failure
    _reanchor = False  # a version failed: the next one goes as an anchor
    _limited_t0: float | None = None  # monotonic s of the first 429 not yet followed by a commit
    rate_limited = 0  # 429s (StoreRateLimitError after the store's retries) waited out

    def __init__(
        self,
        store: Store | str,
        run_id: str | None = None,
        config=None,
        adapter: AdapterInfo | None = None,
        signer: RunKey | None = None,
    ):
        self.store = open_store(store)
        self.signer = signer
        self.config = config or PublisherConfig()
        self.writer_id = uuid.uuid4().hex[:12]
        self.before_commit: Callable[[VersionEntry], None] | None = None
        self.adapter = adapter
        # the lease first: what start-up reads and deletes, it reads and deletes as the writer
        self.lease = LeaseKeeper(
            self.store, run_id or "", self.writer_id, self.config.lease_s, self.config.takeover
        )
        self.lease.acquire()
        try:
            self._start(run_id)
        except BaseException:  # a publisher that did not start holds nothing
            try:
                self.lease.release(also_delete=[])
            except StoreError as release_error:  # the start's own error is the one to see
                log.warning(
                    "writer lease not released after a failed start (%s); it expires after %.0fs",
                    release_error,
                    self.config.lease_s,
                )
            raise
        self._payloads = PayloadWriter(
            self.store,
            self.run_id,
            self.writer_id,
            self.config.part_bytes,
            self.config.encode_threads,
            sha256=signer is not None,
        )
        latest = self.manifest.latest if self.manifest else None
        self._next_version = latest.version + 1 if latest else 0
        self._snap_version: int | None = None
        self._fingerprint: ModelFingerprint | None = None
        self._since_anchor = 0  # versions since the last anchor (diffed, not only committed)
        self._delta_bytes_since_anchor = 0
        self._anchor_bytes = 0
        self._cv = threading.Condition()
        self._pending: _Job | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._pool = ThreadPoolExecutor(self.config.encode_threads, "deltasync-encode")
        self._encoder = ChangeEncoder(self.config.zstd_level, self._pool.map)  # its thread only
        self._diff_pool = ThreadPoolExecutor(self.config.encode_threads, "deltasync-diff")
        self._snap = Snapshot(self.config.diff_on, self._diff_pool.map)
        adaptive = self.config.adaptive_cadence
        if adaptive is None:
            adaptive = self.store.hub is not None or self.store.uri.startswith("hf://")
        # None: every offer() publishes (a fixed cadence, as before)
        self.cadence: PublishCadence | None = None
        if adaptive:
            self.cadence = PublishCadence(
                self.store.requests.snapshot,
                self.config.hub_plan,
                target_share=self.config.target_share,
                low_share=0.75 * self.config.target_share,
                ceiling=self.config.max_publish_every,
            )
        self._thread = threading.Thread(target=self._run, name="deltasync-publisher", daemon=True)
        self._thread.start()
        self.published: list[VersionEntry] = []  # entries committed by this publisher

    def _start(self, run_id: str | None) -> None:
        """Under the lease: read the manifest to resume from (refusing one of another run or
        adapter, and a missing one where payload files are), then remove orphans."""
        self.manifest, found = read_manifest_at_start(self.store, self.lease, self.config.new_run)
        if self.manifest and run_id and self.manifest.run_id != run_id:
            raise ManifestError(
                f"{self.store.uri} holds run {self.manifest.run_id!r}, not {run_id!r}: "
                "use another bucket prefix for a new run, or pass the same run_id to continue"
            )
        if self.manifest:
            check_adapter(self.manifest.adapter, self.adapter, f"run {self.manifest.run_id!r}")
        if self.manifest and self.signer is not None:
            where = f"{self.store.uri}/manifest.json"
            self.manifest = trusted_history(self.manifest, self.signer, where)
        self.run_id = run_id or (self.manifest.run_id if self.manifest else uuid.uuid4().hex[:12])
        if self.lease.run_id != self.run_id:  # taken before the manifest named the run
            self.lease.run_id = self.run_id
            self.lease.refresh()
        remove_orphans(self.store, self.lease, self.manifest, found)

    # ----------------------------------------------------------------------------- trainer side
    def publish(self, named_tensors: Iterable[tuple[str, Any]], step: int | None = None) -> int:
        """Diff the model against the last published snapshot and queue the new version.

        Args:
            named_tensors: (checkpoint name, tensor) pairs covering the whole model, in HF names;
                torch tensors of any float dtype/device (cast to bf16) or np.uint16 bf16 bits.
            step: the trainer's optimizer step, recorded in the manifest.

        Returns:
            The new version number (versions increase by one per call).

        Raises:
            ModelMismatchError: names or shapes differ from the first published version.
            StoreAccessError, StoreNotFoundError, ConcurrentWriterError, ...: the error that
                stopped the background thread (refused credentials, a missing bucket, another
                writer: waiting does not heal them), raised again by every later call. A store
                that fails for a while raises nothing here: see :attr:`outage`.
        """

        def make_job(version):
            named = self._validated(named_tensors)
            if not self._snap.bits:
                return self._first(named, version, step)
            return self._diff(named, version, step, self._snap.diff)

        return self._queue(make_job)

    def offer(
        self, named_tensors: Iterable[tuple[str, Any]], step: int | None = None
    ) -> int | None:
        """One sync of the trainer: :meth:`publish` it if the cadence says so (every call where
        :attr:`cadence` is None), else skip it without reading ``named_tensors``: the next
        publish diffs against the last published bits, so it carries this sync's changes too.

        Returns:
            The new version number, or None when this sync was skipped.

        Raises:
            As :meth:`publish`; also the error that stopped the thread on a skipped sync.
        """
        if not self.cadence_due():
            return None
        return self.publish(named_tensors, step)

    def cadence_due(self) -> bool:
        """Count one sync against the cadence; whether it is to be published (always True
        without a cadence). :meth:`offer` calls it; a caller that must read its tensors lazily
        calls it and then :meth:`publish` (or skips)."""
        if self.cadence is None:
            return True
        with self._cv:
            self._raise_error()
            return self.cadence.due()

    @property
    def publish_every(self) -> int:
        """The cadence now: syncs (``offer`` calls) between publishes; 1 without a cadence."""
        return self.cadence.k if self.cadence is not None else 1

    def publish_changes(self, changes: dict[str, codec.TensorChange], step: int | None = None):
        """Queue a version given as its changes against the last version queued.

        For trainers whose parameters are spread over ranks (``deltasync.sharded``): each rank
        diffs what it holds and rank 0 passes the gathered changes here. The first version must
        come through :meth:`publish` (whole tensors).

        Args:
            changes: {checkpoint name: TensorChange} with flat positions in the full tensor,
                ascending; tensors that did not change are left out.
            step: the trainer's optimizer step, recorded in the manifest.

        Returns:
            The new version number.

        Raises:
            ModelMismatchError: nothing was published yet, or a name is not in the model.
            ValueError: a change's old bits are not the last version's bits (diffed against
                another base) or its positions are out of range; nothing is queued then.
        """

        def advance(_):
            self._snap.advance(changes)
            return dict(changes)

        def make_job(version):
            if not self._snap.bits:
                raise ModelMismatchError(
                    "publish_changes() before publish(): send whole tensors first"
                )
            unknown = sorted(set(changes) - set(self._snap.bits))
            if unknown:
                raise ModelMismatchError(f"changes name tensors not in the model: {unknown[:3]}")
            return self._diff(None, version, step, advance)

        return self._queue(make_job)

    def _queue(self, make_job: Callable[[int], _Job]) -> int:
        """Build the next version's job under the lock (``make_job(version)``; an exception
        leaves nothing changed) and hand it to the background thread."""
        t0 = time.perf_counter()
        with self._cv:
            self._raise_error()
            if self._closed:
                raise RuntimeError("publishing after close()")
            job = make_job(self._next_version)
            self._next_version += 1
            job.timings["diff_s"] = time.perf_counter() - t0
            self._pending = job
            self._snap_version = job.version
            self._cv.notify_all()
        log.debug(
            "diffed v%d: %d changed in %.3fs", job.version, job.changed, job.timings["diff_s"]
        )
        return job.version

    def _validated(self, named_tensors) -> list[tuple[str, Any]]:
        """Check names and shapes before anything changes, so bad input leaves no trace."""
        named = list(named_tensors)
        shapes = {}
        for name, t in named:
            if name in shapes:
                raise ModelMismatchError(f"tensor {name!r} given twice; names must be unique")
            shapes[name] = tuple(t.shape)
            if isinstance(t, np.ndarray) and t.dtype != np.uint16:
                raise TypeError(
                    f"{name}: expected bf16 bits as np.uint16 or a torch tensor, found numpy "
                    f"{t.dtype}; pass the torch parameter itself"
                )
        if not shapes:
            raise ModelMismatchError("publish() got no tensors; pass model.named_parameters()")
        if self.adapter is not None:
            check_adapter_names(shapes)
        fp = self._fingerprint or (self.manifest.model if self.manifest else None)
        if fp is not None:
            fp.check(shapes, f"run {self.run_id!r} in {self.store.uri}")
        return named

    def _first(self, named, version, step) -> _Job:
        snap = self._snap
        snap.reset(named)
        self._fingerprint = ModelFingerprint.of({n: a.shape for n, a in snap.bits.items()})
        self._since_anchor = 0
        return _Job(version, step, None, {}, snap.copy_bits(), dict(snap.digests), snap.total)

    def _diff(self, named, version, step, find_changes) -> _Job:
        """The next version: ``find_changes(named)`` advances the snapshot and returns the
        changes (``Snapshot.diff``, or ``Snapshot.advance`` for changes found by the ranks)."""
        snap = self._snap
        changes = find_changes(named)
        base_version = self._snap_version
        coalesced, force_anchor = 0, False
        pending, self._pending = self._pending, None
        if pending is not None:  # not started: fold it into this version
            coalesced, force_anchor = pending.coalesced + 1, pending.anchor is not None
            base_version = pending.base_version
            if base_version is None:  # it was an anchor-only version: anchor-only again
                self._since_anchor = 0
                anchor = snap.copy_bits()
                digests = dict(snap.digests)
                return _Job(version, step, None, {}, anchor, digests, snap.total, coalesced)
            changes = compose_changes(pending.changes, changes)
        self._since_anchor += 1
        anchor_due = (
            force_anchor
            or self._since_anchor >= self.config.anchor_every
            or (
                self._anchor_bytes
                and self._delta_bytes_since_anchor
                > self.config.anchor_replay_fraction * self._anchor_bytes
            )
        )
        anchor = None
        if anchor_due:
            anchor = snap.copy_bits()
            self._since_anchor = 0
        return _Job(
            version, step, base_version, changes, anchor, dict(snap.digests), snap.total, coalesced
        )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is committed. While the store fails (see
        :attr:`outage`) it waits for the store to answer again: the thread keeps retrying.

        Args:
            timeout: the longest wait in seconds; None: no limit.

        Raises:
            TimeoutError: versions still not committed after ``timeout`` (the message names
                the outage, if one is on).
            StoreError: a failing store made :meth:`close` give up on the versions not committed.
            The error that stopped the background thread, if one did (see :meth:`publish`).
        """
        self._wait_committed(timeout, outage_wait_s=None)

    def close(self) -> None:
        """Flush, stop the background thread and release the writer lease. A second call does
        nothing (it raises the error that stopped the thread again, if one did).

        While the store fails it waits up to :attr:`close_wait_s` for it to answer, then stops
        without committing the rest and leaves the lease to expire (after ``lease_s``).

        Raises:
            StoreError: the store still failed after ``close_wait_s``; the message names the
                newest version committed and the ones that were not.
            The error that stopped the background thread, if one did (see :meth:`publish`).
        """
        if self._closed and not self._thread.is_alive():
            self._raise_error()
            return
        try:
            self._wait_committed(None, outage_wait_s=self.close_wait_s)
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            gave_up = self._pending is not None or self._busy  # versions not committed
            self._thread.join(_JOIN_AFTER_GIVING_UP_S if gave_up else None)
            self._pool.shutdown()
            self._diff_pool.shutdown()
            self._payloads.close()
            if self._error is None and not gave_up:
                self._release_lease()

    def _release_lease(self) -> None:
        """Release the lease with the pending deletes; a failing store leaves it to expire."""
        paths = self._payloads.take_deletes()
        try:
            self.lease.release(also_delete=paths)
        except StoreError as e:
            if not _is_outage(e):
                raise
            log.warning(
                "writer lease not released (the store failed: %s); it expires %.0fs after its "
                "last renewal, and the next writer removes %d orphaned files",
                e,
                self.config.lease_s,
                len(paths),
            )

    def _wait_committed(self, timeout: float | None, outage_wait_s: float | None) -> None:
        """Wait until nothing is queued or being published; ``outage_wait_s``: give up when an
        outage has lasted that long (counted from this call at the earliest)."""
        t0 = time.monotonic()
        with self._cv:
            while (self._pending is not None or self._busy) and self._error is None:
                now = time.monotonic()
                left = None if timeout is None else t0 + timeout - now
                if left is not None and left <= 0:
                    out = self._outage_view()
                    why = f"; the store is failing: {out.describe()}" if out else ""
                    raise TimeoutError(f"versions still not committed after {timeout}s{why}")
                stuck_t0 = self._stuck_t0()
                if stuck_t0 is not None and not self._thread.is_alive():
                    raise StoreError(self._not_published())  # close() gave up on it
                if stuck_t0 is not None and outage_wait_s is not None:
                    out_left = max(t0, stuck_t0) + outage_wait_s - now
                    if out_left <= 0:
                        raise StoreError(self._not_published())
                    left = out_left if left is None else min(left, out_left)
                self._cv.wait(left)
            self._raise_error()

    def _stuck_t0(self) -> float | None:
        """Monotonic s since when the store fails (an outage) or rate-limits the publisher; None
        while it answers (under ``_cv``)."""
        if self._outage is not None:
            return self._outage_t0
        return self._limited_t0

    def _not_published(self) -> str:
        out = self._outage_view()
        if out is None:  # rate limited (HTTP 429), not an outage
            newest = self._next_version - 1
            return (
                f"{self.store.uri}: v{newest} not published: the Hub kept rate-limiting this "
                f"token (HTTP 429, {self.rate_limited} time(s) after the store's retries). "
                f"Expected it to answer within DeltaPublisher.close_wait_s="
                f"{self.close_wait_s:.0f}s. Committed: v{self.latest_committed}. Fix: another "
                "token for the replicas and the dashboard, a higher --hub-plan if the token has "
                "one, or a larger --weight-sync-steps"
            )
        return (
            f"{self.store.uri}: v{out.newest} not published: the store kept failing "
            f"({out.describe()}). Expected it to answer within "
            f"DeltaPublisher.close_wait_s={self.close_wait_s:.0f}s. "
            f"Committed: v{out.committed}, which replicas can reach; the newer weights were "
            "not published. Fix the store or the network and publish them again (a new "
            "DeltaPublisher on this run continues after the committed version), or raise "
            "DeltaPublisher.close_wait_s"
        )

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def newest_published(self) -> int | None:
        """The newest version this publisher committed, or None before its first (unlike
        :attr:`latest_committed`, never a version an earlier writer left in the manifest)."""
        return self.published[-1].version if self.published else None

    @property
    def latest_committed(self) -> int | None:
        """The newest version committed to the manifest, or None."""
        m = self.manifest
        return m.latest.version if m and m.latest else None

    @property
    def outage(self) -> PublishOutage | None:
        """The store outage publishing is waiting out, or None while the store answers (see the
        class docstring). It changes on the publisher's thread: read it anew after each step."""
        with self._cv:
            return self._outage_view()

    def _outage_view(self) -> PublishOutage | None:
        """The outage with the committed and newest versions filled in (under ``_cv``)."""
        if self._outage is None:
            return None
        newest = self._next_version - 1 if self._next_version > 0 else None
        return replace(self._outage, committed=self.latest_committed, newest=newest)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ----------------------------------------------------------------------- background thread
    def _run(self) -> None:
        retry_at = 0.0  # monotonic s: after a failed attempt, the next one waits until then
        while True:
            refresh = False
            with self._cv:
                while not self._closed:
                    if self._pending is not None:
                        wait_s = retry_at - time.monotonic()
                        if wait_s <= 0:
                            break
                        self._cv.wait(wait_s)
                        continue
                    self._cv.wait(self.config.lease_s / 3)
                    if self._pending is None and not self._closed and self.lease.due:
                        refresh = True  # outside the lock: publish() never waits on the store
                        break
                if self._closed and (self._pending is None or self._stuck_t0() is not None):
                    return  # all committed; or close() gave up on a failing store
                if not refresh:
                    job, self._pending = self._take(), None
                    self._busy = True
            if refresh:
                try:
                    self.lease.refresh()
                except BaseException as e:
                    if self._failed(None, e) is None:
                        return
                    continue
                self._answered(None)
                continue
            try:
                self._commit(job)
            except BaseException as e:  # an outage is waited out; any other error is kept
                delay_s = self._failed(job, e)  # and re-raised to the trainer by publish()/flush()
                if delay_s is None:
                    return
                retry_at = time.monotonic() + delay_s
                continue
            self._answered(job)

    def _take(self) -> _Job:
        """The pending job, handed to the thread (under ``_cv``). After a failed version it
        becomes an anchor: the bucket may lack the base its delta names."""
        job = self._pending
        if self._reanchor and job.base_version is not None:
            # the pending job is the newest queued version: the snapshot holds its bits
            assert job.version == self._snap_version, (job.version, self._snap_version)
            anchor = job.anchor if job.anchor is not None else self._snap.copy_bits()
            job = _Job(
                job.version,
                job.step,
                None,
                {},
                anchor,
                job.digests,
                job.total,
                job.coalesced,
                job.timings,
            )
            self._since_anchor = 0
        return job

    def _failed(self, job: _Job | None, exc: BaseException) -> float | None:
        """Record a failed publish of ``job`` (None: a lease renewal). A store outage keeps the
        newest version pending (as an anchor) and returns the seconds until the next attempt;
        any other error is kept for the trainer and returns None (the thread stops)."""
        what = f"publishing v{job.version}" if job is not None else "renewing the writer lease"
        if isinstance(exc, StoreRateLimitError):
            return self._rate_limited(job, exc, what)
        with self._cv:
            self._busy = False
            if not _is_outage(exc):
                log.error("%s failed: %r", what, exc)
                self._error = exc
                self._cv.notify_all()
                return None
            started = self._outage is None
            if started:
                self._outage = PublishOutage(since=time.time(), failures=0, last_error="")
                self._outage_t0 = time.monotonic()
            failures = self._outage.failures + 1
            error = f"{type(exc).__name__}: {exc}"[:500]
            self._outage = replace(self._outage, failures=failures, last_error=error)
            self._keep_failed(job)
            delay_s = min(self.retry_s[1], self.retry_s[0] * 2 ** (failures - 1))
            view = self._outage_view()
            self._cv.notify_all()
        if started:
            log.warning(
                "store outage: %s failed; training goes on, the newest version waits and goes "
                "as an anchor once the store answers (next attempt in %.1fs): %s",
                what,
                delay_s,
                view.describe(),
            )
            self._tell(view)
        else:
            log.debug("%s failed again (next attempt in %.1fs): %s", what, delay_s, error)
        return delay_s

    def _keep_failed(self, job: _Job | None) -> None:
        """Keep the failed ``job``'s version pending, to go as an anchor (under ``_cv``)."""
        if job is None:
            return
        self._reanchor = True
        if self._pending is None:  # it is the newest: kept, to go as an anchor
            # (_take turns it into one; no base and no anchor copy here, so that each
            # publish() meanwhile folds it in as a delta, without a copy of the model)
            base = job.base_version if job.base_version is not None else job.version
            self._pending = replace(job, base_version=base, anchor=None)
        else:  # a newer version waits: it goes as an anchor, this one folded into it
            self._pending.coalesced += job.coalesced + 1

    def _rate_limited(self, job: _Job | None, exc: StoreRateLimitError, what: str) -> float:
        """A 429 outlasted the store's retries: not an outage nor an error. The version stays
        pending (as after an outage: the next attempt goes as an anchor, since part of its batch
        may have landed), the cadence publishes less often, and the next attempt waits the
        server's ``Retry-After``. Returns that wait (s)."""
        wait_s = max(exc.retry_after_s or 0.0, self.retry_s[0])
        with self._cv:
            self._busy = False
            first = self._limited_t0 is None
            if first:
                self._limited_t0 = time.monotonic()
            self.rate_limited += 1
            self._keep_failed(job)
            k = self.cadence.throttled(wait_s) if self.cadence is not None else None
            self._cv.notify_all()
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "rate limited (HTTP 429) %s: waiting %.1fs (Retry-After), then publishing%s; "
            "training goes on",
            what,
            wait_s,
            f" every {k} sync(s)" if k is not None else " again",
        )
        return wait_s

    def _answered(self, job: _Job | None) -> None:
        """The store took ``job`` (None: a lease renewal): an outage, if one was on, ends."""
        with self._cv:
            if job is not None and job.base_version is None:
                self._reanchor = False
            if self._limited_t0 is not None:
                done = f"v{job.version} committed" if job is not None else "the lease renewed"
                log.info(
                    "rate limit over: %s after %.1fs", done, time.monotonic() - self._limited_t0
                )
                self._limited_t0 = None
            ended = None
            if self._outage is not None:
                ended = replace(self._outage_view(), ended_at=time.time())
                self._outage = None
        if ended is not None:  # told before flush() returns
            done = f"v{job.version} committed" if job is not None else "the lease renewed"
            log.warning("store outage over: %s after %s", done, ended.describe())
            self._tell(ended)
        with self._cv:
            self._busy = False
            self._cv.notify_all()

    def _tell(self, outage: PublishOutage) -> None:
        if self.on_outage is not None:
            try:
                self.on_outage(outage)
            except Exception:  # a reporting hook must not stop publishing
                log.exception("on_outage hook failed")

    def _commit(self, job: _Job) -> None:
        t0 = time.perf_counter()
        blobs = None
        if job.base_version is None:  # anchor only: the classes of the next base are its own
            self._encoder.reset(job.anchor)
        else:
            blobs = self._encoder.encode(job.changes)
            job.timings["encode_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        changed = {n: ch.n_changed for n, ch in job.changes.items()}
        shapes = self._fingerprint.shapes()
        done: list[VersionEntry] = []

        def commit(delta, anchor, items=None, deletes=None) -> None:
            job.timings["write_upload_s"] = time.perf_counter() - t1  # one batch: before the upload
            entry = VersionEntry(
                version=job.version,
                step=job.step,
                created_at=time.time(),
                base_version=job.base_version,
                delta=delta,
                anchor=anchor,
                changed=job.changed,
                total=job.total,
                digest=model_digest(job.digests),
                coalesced=job.coalesced,
                timings_s={k: round(v, 6) for k, v in job.timings.items()},
            )
            if self.before_commit is not None:
                self.before_commit(entry)
            self._commit_manifest(entry, items, deletes)
            done.append(entry)

        # an all-or-nothing batch (Store.atomic_batches): payload parts, lease, manifest in one
        one_batch = commit if self.store.atomic_batches else None
        with self.lease.renewing():  # an upload may outlast the lease; a lost lease raises here
            delta, anchor = self._payloads.write(
                job.version,
                job.base_version,
                blobs,
                changed,
                shapes,
                job.digests,
                job.anchor,
                commit=one_batch,
            )
        job.anchor = None  # free the copy
        if not done:
            commit(delta, anchor)
        entry = done[0]
        if anchor is not None:
            self._anchor_bytes = anchor.bytes
            self._delta_bytes_since_anchor = 0
        elif delta is not None:
            self._delta_bytes_since_anchor += delta.bytes
        self.published.append(entry)
        kind = "anchor+delta" if delta and anchor else ("anchor" if anchor else "delta")
        nbytes = (delta.bytes if delta else 0) + (anchor.bytes if anchor else 0)
        log.info(
            "publish v%d %s base=%s step=%s changed=%d density=%.4f%% bytes=%d B/chg=%.3f "
            "coalesced=%d diff=%.3fs encode=%.3fs write+upload=%.3fs",
            job.version,
            kind,
            job.base_version,
            job.step,
            job.changed,
            100 * entry.density,
            nbytes,
            (delta.bytes / job.changed) if delta and job.changed else 0.0,
            job.coalesced,
            job.timings.get("diff_s", 0),
            job.timings.get("encode_s", 0),
            job.timings.get("write_upload_s", 0),
        )

    # ------------------------------------------------------------------------ manifest + lease
    def _commit_manifest(
        self, entry: VersionEntry, items: list | None = None, deletes: list[str] | None = None
    ) -> None:
        self.manifest, dropped = commit_manifest(
            self.store,
            self.lease,
            entry,
            self.manifest,
            self._fingerprint,
            self.config.keep_anchors,
            self.adapter,
            self.signer,
            items,
            deletes,
        )
        # garbage-collect only after the manifest that drops them is committed: with the next
        # payload batch (no extra request), or on close
        for v in dropped:
            files = (v.delta.files if v.delta else []) + (v.anchor.files if v.anchor else [])
            self._payloads.pending_deletes += [f.path for f in files]
        if dropped:
            log.info("retention: dropped versions %s", [v.version for v in dropped])
