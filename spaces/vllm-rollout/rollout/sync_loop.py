"""The replica's sync loop: follow the bucket, prefetch and verify, pause only for the apply.

One poll (``SyncLoop.poll_once``):

1. read the manifest; plan from the version held to the newest (deltas that chain onto it, or the
   newest anchor and the deltas after it: fresh start, restart, fell behind, cheaper);
2. fetch every step (download + file digests + parse) and decode + verify it against the CPU-held
   bf16 bits (``DeltaSubscriber.apply``; digests of every post-update tensor) -- all while vLLM
   keeps generating on the old version;
3. write a staging file (whole tensors of every touched module for the reload path, or merged
   sparse patches for the in-place path);
4. ``pause(mode=keep)``, apply through the worker extension, record the version
   (``/update_weight_version``), reset the prefix cache, ``resume``. The pause holds no network
   transfer and no decode.

Polling adapts (bucket reads cost Hub requests on ``hf://``): after a poll that found nothing
new the interval doubles up to ``max_poll_interval_s``, and snaps back to ``poll_interval_s`` once a
new version appears. A bucket that cannot be read as configured (a refused token, a missing
bucket: ``StoreAccessError``) sets status "error" with the reason in ``last_error`` at the first
poll and is retried every ``error_poll_interval_s``; the loop never exits on it. On remote stores
heartbeats are written at most every ``heartbeat_min_gap_s`` (state changes wait for the gap).

Faults: a payload that fails verification (digest, parse, wrong base) is refused before anything
is paused; the replica keeps serving the version it has, reports the error in its heartbeat,
remembers the payload as bad, and re-plans around it (re-anchoring once a newer anchor exists).
If the apply inside vLLM fails, vLLM's weights are unknown: generation stays paused (and the front
answers 503) until every tensor has been reloaded from the verified CPU copy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from deltasync.errors import (
    BaseVersionMismatch,
    DeltaCorruptError,
    ManifestError,
    ModelMismatchError,
    StoreAccessError,
    StoreError,
    StoreNotFoundError,
)
from deltasync.manifest import Manifest
from deltasync.status import ReplicaHeartbeat, SyncRecord, lag_versions, write_heartbeat
from deltasync.subscriber import (
    DeltaSubscriber,
    HeldWeights,
    PlanStep,
    SyncPlan,
    merge_patches,
)

from .engine import EngineControlError
from .plan import ModelInfo, choose_apply_path, plan_reload, sum_deltas
from .stage import default_stage_dir, write_stage

log = logging.getLogger("rollout.sync")

# Errors that mean "this payload cannot be applied onto what we hold": refuse it, keep serving.
_REFUSED = (DeltaCorruptError, BaseVersionMismatch, ModelMismatchError)


class Engine(Protocol):
    """What the loop needs from the serving engine (``rollout.engine.VLLMControl``)."""

    def describe(self) -> dict: ...
    def apply(self, path: str, mode: str) -> list[dict]: ...
    def pause(self, mode: str = "keep") -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def reset_prefix_cache(self) -> bool: ...


@dataclass
class _Prepared:
    """A verified sync, staged and ready for the pause."""

    plan: SyncPlan
    steps: list[PlanStep]  # the steps that verified (a prefix of plan.steps)
    from_version: int | None
    nbytes: int
    fetch_s: float
    decode_s: float
    stage_s: float
    path: str
    mode: str
    tensors: int


def _is_nan_bits(bits: np.ndarray) -> bool:
    return bool(np.any((bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)))


class SyncLoop:
    """Keeps one vLLM server on the newest verified version of a bucket run.

    Args:
        store_uri: the run's bucket URI.
        engine: the engine control (``VLLMControl`` for a real server).
        replica_id: name of the heartbeat ``replicas/<replica_id>.json``.
        poll_interval_s: seconds between manifest polls right after a change (the shortest).
        heartbeat_interval_s: seconds between heartbeats while nothing changes (remote stores:
            at least 60).
        apply_path: ``auto`` | ``in-place`` | ``reload``.
        stage_dir: folder of staging files (default ``/dev/shm/deltasync-stage-<uid>``).
        max_poll_interval_s: longest interval (seconds) the poll backs off to while nothing
            changes (default: ``poll_interval_s`` on a local folder, max(5, poll_interval_s)
            elsewhere).
        error_poll_interval_s: seconds between polls while the bucket is unreadable as
            configured (bad token, missing bucket).
        heartbeat_min_gap_s: least seconds between two heartbeat writes (default 0 on a local
            folder, 60 elsewhere: each write costs 2 Hub API requests).
        clock: monotonic seconds (tests pass a simulated clock).

    Raises (from ``start``/``connect``):
        rollout.plan.UnsupportedModelError: the served model cannot take exact bf16 updates.
    """

    def __init__(
        self,
        store_uri: str,
        engine: Engine,
        replica_id: str,
        poll_interval_s: float = 1.0,
        heartbeat_interval_s: float = 10.0,
        apply_path: str = "auto",
        stage_dir: str | None = None,
        max_poll_interval_s: float | None = None,
        error_poll_interval_s: float = 30.0,
        heartbeat_min_gap_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        public_url: str | None = None,
    ):
        self.subscriber = DeltaSubscriber(store_uri)
        self.store = self.subscriber.store
        self.engine = engine
        self.replica_id = replica_id
        self.public_url = public_url
        remote = not self.store.is_local and not self.store.uri.startswith("memory://")
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max(
            poll_interval_s,
            max_poll_interval_s
            if max_poll_interval_s is not None
            else (5.0 if remote else poll_interval_s),
        )
        self.error_poll_interval_s = max(poll_interval_s, error_poll_interval_s)
        self.heartbeat_interval_s = (
            max(heartbeat_interval_s, 60.0) if remote else heartbeat_interval_s
        )
        self.heartbeat_min_gap_s = (
            heartbeat_min_gap_s if heartbeat_min_gap_s is not None else (60.0 if remote else 0.0)
        )
        self._clock = clock
        self._delay = poll_interval_s  # the wait before the next poll (adaptive)
        self._hb_pending = False  # a forced heartbeat waits for heartbeat_min_gap_s
        self.requested_path = apply_path
        self.stage_dir = stage_dir or default_stage_dir()
        self.held = HeldWeights()
        self.served_version: int | None = None  # the verified version vLLM serves
        self.dirty = False  # an apply failed inside vLLM: paused until a full reload succeeds
        self.newest_seen: int | None = None
        self.newest_published_at: float | None = None
        self.status = "starting"
        self.errors = 0
        self.last_error: str | None = None
        self.recent: list[SyncRecord] = []
        self.info: ModelInfo | None = None
        self.apply_path = ""
        self._bad: dict[tuple, str] = {}  # refused payloads -> reason
        self._last_exc: BaseException | None = None
        self._prefix_reset_pending = False
        self._last_heartbeat: float | None = None
        self._lock = threading.Lock()  # one poll at a time (thread and control route)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def connect(self) -> str:
        """Ask the worker extension about the model and choose the apply path (reported)."""
        self.info = ModelInfo.from_json(self.engine.describe())
        self.apply_path = choose_apply_path(self.info, self.requested_path)
        log.info(
            "replica %s: model %s on %s dtype=%s tied=%s apply_path=%s store=%s",
            self.replica_id, self.info.architecture, self.info.device, self.info.dtype,
            self.info.tie_word_embeddings, self.apply_path, self.store.uri,
        )  # fmt: skip
        return self.apply_path

    def start(self) -> None:
        """Connect, then poll on a daemon thread until ``stop``."""
        if self.info is None:
            self.connect()
        self._thread = threading.Thread(target=self._run, name="deltasync-sync", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling and write a final ``stopped`` heartbeat."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.status = "stopped"
        self._last_heartbeat = None  # the final heartbeat is written whatever the gap
        self._heartbeat(force=True)
        self.subscriber.close()

    def wake(self) -> None:
        """Poll now instead of at the next interval."""
        self._wake.set()

    @property
    def ready(self) -> bool:
        """Serving a verified bucket version (and not paused for a recovery)."""
        return self.served_version is not None and not self.dirty

    def next_poll_delay_s(self) -> float:
        """Seconds to wait before the next poll: ``poll_interval_s`` right after a change,
        doubling while nothing changes up to ``max_poll_interval_s``, and
        ``error_poll_interval_s`` while the bucket is unreadable as configured."""
        return self._delay

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # recovered on purpose: the replica keeps serving; reported
                log.exception("sync poll failed unexpectedly; serving v%s", self.served_version)
                self._report(e)
                self._delay = max(self._delay, self.poll_interval_s)
            self._wake.wait(self.next_poll_delay_s())
            self._wake.clear()

    # ----------------------------------------------------------------------------------- poll
    def poll_once(self) -> SyncRecord | None:
        """One poll: sync to the newest version if behind. Returns the sync's record, if any.

        Sets :meth:`next_poll_delay_s`. Store and manifest errors are reported (status "error",
        ``last_error``), not raised; an unreadable bucket (``StoreAccessError``) is reported
        at once and slows polling to ``error_poll_interval_s``.
        """
        with self._lock:
            if self.info is None:
                self.connect()
            if self.dirty:
                self._recover_full()
                return None
            before = self.newest_seen
            try:
                manifest = self.subscriber.read_manifest()
            except StoreAccessError as e:
                self._report(e, "bucket unreadable; retrying slowly")
                self._delay = self.error_poll_interval_s
                return None
            except (ManifestError, StoreError) as e:
                self._report(e)
                self._backoff()
                return None
            if self.status == "error" and isinstance(self._last_exc, StoreAccessError):
                self.status = "starting" if self.served_version is None else "ok"
                self._last_exc = None
            if manifest is None or manifest.latest is None:
                self._backoff()
                self._heartbeat()
                return None
            self.newest_seen = manifest.latest.version
            self.newest_published_at = manifest.latest.created_at
            if self.newest_seen != before:
                self._delay = self.poll_interval_s  # something moved: poll at the fastest again
            else:
                self._backoff()
            if self.served_version == self.newest_seen:
                self._retry_prefix_reset()
                self.status = "ok"
                self._heartbeat()
                return None
            prepared = self._prepare(manifest)
            if prepared is None:
                self._heartbeat(force=True)
                return None
            return self._apply(prepared, manifest)

    def _backoff(self) -> None:
        self._delay = min(max(self._delay, self.poll_interval_s) * 2, self.max_poll_interval_s)

    def _bad_key(self, step: PlanStep) -> tuple:
        return (step.kind, step.version, tuple(f.digest for f in step.files))

    def _plan(self, manifest: Manifest) -> SyncPlan | None:
        """The plan from what is held, or a re-anchor when that path uses a refused payload."""
        for held in dict.fromkeys([self.held.version, None]):
            try:
                plan = self.subscriber.plan(held, manifest)
            except ManifestError as e:
                self._report(e)
                continue
            bad = [s for s in plan.steps if self._bad_key(s) in self._bad]
            if not bad:
                return plan
            log.info(
                "plan v%s->v%s uses refused %s v%d; trying a re-anchor",
                held, plan.to_version, bad[0].kind, bad[0].version,
            )  # fmt: skip
        self.status = "error"
        log.warning(
            "no clean path to v%s; serving v%s until a newer anchor is published",
            manifest.latest.version, self.served_version,
        )  # fmt: skip
        return None

    def _prepare(self, manifest: Manifest) -> _Prepared | None:
        """Plan, fetch, verify and stage while generation continues. None when nothing verified."""
        plan = self._plan(manifest)
        if plan is None or not plan.steps:
            return None
        self.status = "syncing" if plan.from_version is not None else "recovering"
        from_version = self.served_version
        fetch_s = decode_s = 0.0
        nbytes = 0
        done: list[tuple[PlanStep, list]] = []
        for step in plan.steps:
            try:
                fetched = self.subscriber.fetch(step)
                fetch_s += fetched.fetch_s
                nbytes += fetched.nbytes
                t0 = time.perf_counter()
                out = self.subscriber.apply(fetched, self.held, manifest)
                decode_s += time.perf_counter() - t0
            except _REFUSED as e:
                self._bad[self._bad_key(step)] = f"{type(e).__name__}: {e}"
                self._report(e, f"refused {step.kind} v{step.version}")
                break
            except StoreNotFoundError as e:
                # retention deleted it after we read the manifest (the next manifest no longer
                # names it), or it vanished while still named: either way avoid this payload
                # from now on, so a path through a later anchor is taken
                self._bad[self._bad_key(step)] = f"{type(e).__name__}: {e}"
                self._report(e, "payload gone; re-planning next poll")
                break
            except StoreError as e:
                self._report(e, "store read failed; retrying next poll")
                break
            done.append((step, out))
        if not done:
            self.status = "error"
            return None
        t0 = time.perf_counter()
        path, mode, n = self._stage(done)
        return _Prepared(
            plan, [s for s, _ in done], from_version, nbytes, fetch_s, decode_s,
            time.perf_counter() - t0, path, mode, n,
        )  # fmt: skip

    def _stage(self, done: list[tuple[PlanStep, list]]) -> tuple[str, str, int]:
        """Write the staging file for the verified steps; returns (path, mode, tensors)."""
        assert self.info is not None
        version = self.held.version
        path = os.path.join(self.stage_dir, f"{self.replica_id}-v{version}.safetensors")
        anchored = any(s.kind == "anchor" for s, _ in done)
        names = list(self.held.tensors)
        if anchored or self.served_version is None:
            touched = names
        else:
            touched = sorted({p.name for _, ps in done for p in ps})
        if self.apply_path == "in-place" and not anchored and self.served_version is not None:
            merged = merge_patches(self.held, [ps for _, ps in done])
            if not any(_is_nan_bits(p.values) for p in merged):  # NaN is vLLM's "unchanged" mark
                sparse = {p.name: (p.shape, p.indices, p.values) for p in merged}
                sums = sum_deltas(merged, self.info.packed_modules_mapping)
                write_stage(path, "sparse", version, sparse=sparse, sum_deltas=sums)
                return path, "in-place", len(sparse)
        rp = plan_reload(
            touched, names, self.info.packed_modules_mapping, self.info.tie_word_embeddings
        )
        dense = {n: self.held.tensors[n] for n in rp.names}
        write_stage(path, "dense", version, dense=dense, refresh_lm_head=rp.refresh_lm_head)
        return path, "reload", len(dense)

    def _apply(self, p: _Prepared, manifest: Manifest) -> SyncRecord | None:
        """The paused window: pause(keep), apply, record the version, reset prefixes, resume."""
        version = self.held.version
        t_pause = time.perf_counter()
        try:
            self.engine.pause("keep")
        except EngineControlError as e:  # nothing applied: keep serving the old version
            self._report(e, "pause failed; will retry")
            return None
        try:
            t0 = time.perf_counter()
            self.engine.apply(p.path, p.mode)
            apply_s = time.perf_counter() - t0
        except EngineControlError as e:
            self.dirty = True
            self._report(e, f"apply of v{version} failed inside vLLM; paused for a full reload")
            self._recover_full()
            return None
        finally:
            _unlink(p.path)
        try:
            self.engine.set_version(version)
            self._prefix_reset_pending = not self.engine.reset_prefix_cache()
        finally:
            self.engine.resume()
        paused_s = time.perf_counter() - t_pause
        self.served_version = version
        entry = manifest.entry(version)
        published_at = entry.created_at if entry else time.time()
        kinds = {s.kind for s in p.steps}
        rec = SyncRecord(
            version=version,
            from_version=p.from_version,
            kind="anchor" if "anchor" in kinds else ("chain" if len(p.steps) > 1 else "delta"),
            steps=len(p.steps),
            bytes=p.nbytes,
            fetch_s=round(p.fetch_s, 6),
            decode_s=round(p.decode_s + p.stage_s, 6),
            paused_s=round(paused_s, 6),
            apply_s=round(apply_s, 6),
            published_at=published_at,
            applied_at=time.time(),
            apply_path=p.mode,
        )
        self.recent.append(rec)
        self.recent = self.recent[-50:]
        # behind after a sync only when a step was refused (plans always go to the newest)
        self.status = "ok" if version == self.newest_seen else "error"
        log.info(
            "sync v%s->v%d %s steps=%d bytes=%d fetch=%.4fs decode=%.4fs stage=%.4fs "
            "paused=%.4fs apply=%.4fs path=%s tensors=%d lag=%.3fs newest=v%s prefix_reset=%s",
            p.from_version, version, rec.kind, rec.steps, rec.bytes, p.fetch_s, p.decode_s,
            p.stage_s, paused_s, apply_s, p.mode, p.tensors, rec.lag_s, self.newest_seen,
            "deferred" if self._prefix_reset_pending else "ok",
        )  # fmt: skip
        self._heartbeat(force=True)
        return rec

    def _recover_full(self) -> None:
        """Reload every tensor from the verified CPU copy while generation stays paused."""
        if self.held.version is None or self.info is None:
            return
        version = self.held.version
        path = os.path.join(self.stage_dir, f"{self.replica_id}-v{version}-full.safetensors")
        try:
            write_stage(
                path, "dense", version, dense=dict(self.held.tensors),
                refresh_lm_head=self.info.tie_word_embeddings,
            )  # fmt: skip
            self.engine.apply(path, "reload")
            self.engine.set_version(version)
            self._prefix_reset_pending = not self.engine.reset_prefix_cache()
            self.engine.resume()
        except EngineControlError as e:
            self.status = "error"
            self._report(e, f"full reload of v{version} failed; generation stays paused")
            return
        finally:
            _unlink(path)
        self.dirty = False
        self.served_version = version
        self.status = "ok" if version == self.newest_seen else "syncing"
        log.warning("recovered: full reload of v%d applied; generation resumed", version)
        self._heartbeat(force=True)

    def _retry_prefix_reset(self) -> None:
        if self._prefix_reset_pending:
            try:
                self._prefix_reset_pending = not self.engine.reset_prefix_cache()
            except EngineControlError as e:
                self._report(e, "prefix cache reset failed")

    # ---------------------------------------------------------------------------------- status
    def _report(self, exc: BaseException, what: str = "") -> None:
        self.errors += 1
        self._last_exc = exc
        self.last_error = f"{type(exc).__name__}: {exc}"[:2000]
        if self.dirty or self.served_version is None:
            self.status = "recovering" if self.dirty else "error"
        else:
            self.status = "error"
        log.warning(
            "%s%s (serving v%s, errors=%d)",
            f"{what}: " if what else "", self.last_error, self.served_version, self.errors,
        )  # fmt: skip
        self._heartbeat(force=True)

    def heartbeat(self) -> ReplicaHeartbeat:
        """The current status as a heartbeat object."""
        behind = self.newest_seen is not None and self.served_version != self.newest_seen
        lag_s = (
            time.time() - self.newest_published_at if behind and self.newest_published_at else 0.0
        )
        return ReplicaHeartbeat(
            replica_id=self.replica_id,
            held_version=self.served_version,
            newest_seen=self.newest_seen,
            lag_versions=lag_versions(self.newest_seen, self.served_version),
            lag_s=max(0.0, lag_s),
            status=self.status,
            apply_path=self.apply_path,
            last_error=self.last_error,
            errors=self.errors,
            recent=list(self.recent[-20:]),
            url=self.public_url,
        )

    def _heartbeat(self, force: bool = False) -> None:
        """Write the heartbeat when forced (a state change) or when ``heartbeat_interval_s``
        passed; never twice within ``heartbeat_min_gap_s`` (a forced one then waits: it is
        written by the first poll after the gap)."""
        now = self._clock()
        last = self._last_heartbeat
        since = float("inf") if last is None else now - last
        if force or self._hb_pending:
            if since < self.heartbeat_min_gap_s:
                self._hb_pending = True
                return
        elif since < self.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        self._hb_pending = False
        try:
            write_heartbeat(self.store, self.heartbeat())
        except StoreError as e:  # status is best effort; serving goes on
            log.warning("heartbeat write to %s failed: %s", self.store.uri, e)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
