"""Trainer side of the sync protocol: ``DeltaPublisher``.

``publish(named_tensors, step)`` diffs the model against the last PUBLISHED bf16 snapshot (exact for
any optimizer and any number of optimizer steps between publishes) and returns; ranking the
changes by exponent class and encoding them (``deltasync.publisher_encoder``), writing and uploading run on
a background thread. If uploads fall behind, a version that has not started encoding is folded
into the next one (coalesced) instead of queueing without bound. Payload files
are uploaded before the manifest that names them; retention deletes files only after a manifest
that no longer names them is committed. See docs/PROTOCOL.md.

Per version at most two ``Store.write_many`` batches (2 API requests each on ``hf://``): the payload
parts plus the retention deletes already due, then ``manifest.json`` plus the lease when due.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import codec
from .adapter import check_adapter, check_adapter_names
from .bucket_writer import PayloadWriter, commit_manifest, read_manifest
from .errors import ManifestError, ModelMismatchError
from .lease import LeaseKeeper
from .manifest import (
    AdapterInfo,
    ModelFingerprint,
    VersionEntry,
    model_digest,
)
from .publisher_config import PublisherConfig  # also imported from here by trainers and tests
from .publisher_encoder import ChangeEncoder
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


class DeltaPublisher:
    """Publishes model versions to a bucket run as anchors and sparse deltas.

    Args:
        store: a Store or URI (see ``deltasync.store``); the run lives at its root.
        run_id: a name for the run; default: the existing manifest's, else a new uuid.
        config: :class:`PublisherConfig`.
        adapter: for an adapter run (``deltasync.adapter``), the adapter recorded in every
            manifest; the tensors published are then PEFT adapter keys. None: full weights.

    Attributes:
        before_commit: None, or a function called with each version's ``VersionEntry`` after its
            payload is in the bucket and before the manifest names it (the commit point): the seam
            where tests and ``make e2e`` damage an object as a faulty bucket would. It runs on the
            publisher's thread; an exception it raises fails that publish.

    Raises:
        ConcurrentWriterError: another trainer holds a fresh writer lease on this run.
        ManifestError: the existing manifest is unreadable, or belongs to another ``run_id``.
        AdapterMismatchError: the existing run has another adapter (or is of the other kind).
    """

    def __init__(
        self,
        store: Store | str,
        run_id: str | None = None,
        config=None,
        adapter: AdapterInfo | None = None,
    ):
        self.store = open_store(store)
        self.config = config or PublisherConfig()
        self.writer_id = uuid.uuid4().hex[:12]
        self.before_commit: Callable[[VersionEntry], None] | None = None
        self.manifest = read_manifest(self.store)
        if self.manifest and run_id and self.manifest.run_id != run_id:
            raise ManifestError(
                f"{self.store.uri} holds run {self.manifest.run_id!r}, not {run_id!r}: "
                "use another bucket prefix for a new run, or pass the same run_id to continue"
            )
        if self.manifest:
            check_adapter(self.manifest.adapter, adapter, f"run {self.manifest.run_id!r}")
        self.adapter = adapter
        self.run_id = run_id or (self.manifest.run_id if self.manifest else uuid.uuid4().hex[:12])
        self.lease = LeaseKeeper(
            self.store, self.run_id, self.writer_id, self.config.lease_s, self.config.takeover
        )
        self.lease.acquire()
        self._payloads = PayloadWriter(
            self.store, self.run_id, self.config.part_bytes, self.config.encode_threads
        )
        self._payloads.remove_orphans(self.manifest)
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
        self._thread = threading.Thread(target=self._run, name="deltasync-publisher", daemon=True)
        self._thread.start()
        self.published: list[VersionEntry] = []  # entries committed by this publisher

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
            The error of a failed background upload, if one happened since the last call.
        """

        def make_job(version):
            named = self._validated(named_tensors)
            if not self._snap.bits:
                return self._first(named, version, step)
            return self._diff(named, version, step, self._snap.diff)

        return self._queue(make_job)

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
        """Wait until every queued version is committed. Raises a background error, if any."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._pending is not None or self._busy) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"uploads still running after {timeout}s")
                self._cv.wait(left)
            self._raise_error()

    def close(self) -> None:
        """Flush, stop the background thread and release the writer lease."""
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join()
            self._pool.shutdown()
            self._diff_pool.shutdown()
            self._payloads.close()
            if self._error is None:
                paths = self._payloads.take_deletes()
                self.lease.release(also_delete=paths)

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

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ----------------------------------------------------------------------- background thread
    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait(self.config.lease_s / 3)
                    if self._pending is None and not self._closed and self.lease.due:
                        try:
                            self.lease.refresh()
                        except Exception as e:  # kept; the trainer sees it on its next call
                            self._error = e
                if self._pending is None and self._closed:
                    return
                job, self._pending = self._pending, None
                self._busy = True
            try:
                self._commit(job)
            except BaseException as e:  # kept and re-raised to the trainer by publish()/flush()
                log.error("publishing v%d failed: %r", job.version, e)
                with self._cv:
                    self._error = e
                    self._busy = False
                    self._cv.notify_all()
                return
            with self._cv:
                self._busy = False
                self._cv.notify_all()

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
        delta, anchor = self._payloads.write(
            job.version, job.base_version, blobs, changed, shapes, job.digests, job.anchor
        )
        job.anchor = None  # free the copy
        job.timings["write_upload_s"] = time.perf_counter() - t1
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
        self._commit_manifest(entry)
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
    def _commit_manifest(self, entry: VersionEntry) -> None:
        self.manifest, dropped = commit_manifest(
            self.store,
            self.lease,
            entry,
            self.manifest,
            self._fingerprint,
            self.config.keep_anchors,
            self.adapter,
        )
        # garbage-collect only after the manifest that drops them is committed: with the next
        # payload batch (no extra request), or on close
        for v in dropped:
            files = (v.delta.files if v.delta else []) + (v.anchor.files if v.anchor else [])
            self._payloads.pending_deletes += [f.path for f in files]
        if dropped:
            log.info("retention: dropped versions %s", [v.version for v in dropped])
