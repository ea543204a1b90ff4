"""The replica's sync loop: follow the bucket, prefetch and verify, pause only for the apply.

One poll (``SyncLoop.poll_once``):

1. ``deltasync.follow.Follower.poll``: read the manifest, plan from the version held to the newest
   (deltas that chain onto it, or the newest anchor and the deltas after it: fresh start, restart,
   fell behind, cheaper), fetch every step and decode + verify it against the CPU-held bf16 bits
   (digests of every post-update tensor) -- all while vLLM keeps generating on the old version;
2. write a staging file (whole tensors of every touched module for the reload path, or merged
   sparse patches for the in-place path);
3. ``pause(mode=keep)``, apply through the worker extension, record the version
   (``/update_weight_version``), reset the prefix cache, ``resume``. The pause holds no network
   transfer and no decode.

Polling adapts as the ``Follower`` does (bucket reads cost Hub requests on ``hf://``). On an
``hf://`` bucket whose event feed is live (``deltasync.hub_events``; ``follow_events``, started by
``start``), the loop polls when the feed says ``manifest.json`` changed or asks for a reconcile
(a first connect, a reconnect, a ``reset``), and otherwise once a minute (a safety poll, sooner
when a heartbeat is due); where the feed is not available it polls as above. A bucket
that cannot be read as configured (a refused token, a missing bucket: ``StoreAccessError``) sets
state ``error`` with the reason in ``last_error`` at the first poll and is retried every
``error_poll_interval_s``; the loop never exits on it. On remote stores heartbeats are written at
most every ``heartbeat_min_gap_s`` (``rollout.heartbeat``: state changes wait for the gap).

States (``rollout.state.SyncState``; its value is the heartbeat's and ``/health``'s ``status``)
change only through ``_set_state``, which refuses a transition that ``rollout.state.TRANSITIONS``
does not list.

Faults: a payload that fails verification (digest, parse, wrong base) is refused before anything
is paused; the replica keeps serving the version it has, reports the error in its heartbeat,
remembers the payload as bad, and re-plans around it (re-anchoring once a newer anchor exists).
If the apply inside vLLM fails, vLLM's weights are unknown: generation stays paused (and the front
answers 503) until every tensor has been reloaded from the verified CPU copy. ``served_version`` is
the version whose every tensor vLLM holds, apart from ``held`` (what is verified in memory): a
staging step that fails (disk full) touches nothing in vLLM, so the pull is kept and the next stage
goes from the served version (its patches and any later ones); a failed ``set_version`` or
``resume`` leaves the replica not ready (paused, status ``recovering``) until a full reload, its
version record and a resume all answer. A manifest older than the newest seen (a stale read, a
replay) or of another run is ignored and reported (``deltasync.follow``).

LoRA replicas (``adapter``): manifests are checked first (``rollout.lora.check_run``); each verified
version is loaded under a new name with no pause (``rollout.lora_load``; ``paused_s`` 0); a failed
load is retried at the next poll while the old version keeps serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from deltasync.errors import StoreAccessError, StoreError
from deltasync.follow import Follower, Pulled
from deltasync.hub_events import follow_changes
from deltasync.manifest import MANIFEST_PATH
from deltasync.status import ReplicaHeartbeat, SyncRecord, lag_s, lag_versions, write_heartbeat

from .apply_plan import ModelInfo, choose_apply_path
from .engine import Engine, EngineControlError
from .heartbeat import HeartbeatSchedule
from .lora import AdapterRoutes, AdapterTarget, CheckedSubscriber
from .lora_load import AdapterLoader
from .staging import Staged, default_stage_dir, stage_pull, unlink_stage, write_stage
from .state import SyncState, check_transition

log = logging.getLogger("rollout.sync")


class SyncLoop:
    """Keeps one vLLM server on the newest verified version of a bucket run.

    Args:
        bucket: the run's bucket URI or Store (one with a simulated ``link``: ``NET``).
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
        public_url: the URL trainers reach this replica at, announced in its heartbeat.
        adapter: serve a LoRA adapter run on the base model (None: a full-weight run).
        sync_every: the follower's forced lag (``SYNC_EVERY``; ``deltasync.follow.Follower``).
        follow_events: on an ``hf://`` bucket, follow its event feed from ``start`` on and poll
            when the manifest changes (``deltasync.hub_events``); False: poll only.
        check_interval_s: seconds between full-weights checks of what vLLM serves
            (:meth:`check_served`; no pause); 0: never on a schedule (still after a recovery).
        public_key: the run's public key (``RUN_PUBLIC_KEY``): only versions whose manifest it
            signed and whose payload bytes hash to the signed SHA-256 are served; an unsigned,
            foreign-key or tampered version is refused (status ``error``, ``last_error`` says
            why) and the served version stays. None: unsigned runs are served.

    Raises (from ``start``/``connect``):
        rollout.apply_plan.UnsupportedModelError: the served model cannot take exact bf16 updates
            (full-weight replicas).
        EngineControlError: a LoRA replica could not unload the adapters a previous sync loop
            left in vLLM.
    """

    def __init__(
        self,
        bucket,
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
        adapter: AdapterTarget | None = None,
        sync_every: int = 1,
        follow_events: bool = True,
        check_interval_s: float = 0.0,
        public_key: str | None = None,
    ):
        self.follow_events = follow_events
        self.clock = clock
        self.check_interval_s = check_interval_s
        self._checked_at = clock()
        self.checks: list[dict] = []  # the last full-weights checks (check_served's results)
        self.follower = Follower(
            CheckedSubscriber(bucket, adapter, public_key=public_key),
            poll_interval_s=poll_interval_s,
            max_poll_interval_s=max_poll_interval_s,
            error_poll_interval_s=error_poll_interval_s,
            report=self._report,
            sync_every=sync_every,
        )
        self.subscriber, self.store, self.held = (
            self.follower.subscriber,
            self.follower.store,
            self.follower.held,
        )
        self.engine = engine
        self.replica_id = replica_id
        self.public_url = public_url
        self._beats = HeartbeatSchedule.for_store(
            not self.follower.local, heartbeat_interval_s, heartbeat_min_gap_s, clock
        )
        self.requested_path = apply_path
        self.stage_dir = stage_dir or default_stage_dir()
        self.lora: AdapterLoader | None = None
        if adapter is not None:
            folder = os.path.join(self.stage_dir, "adapters", replica_id)
            self.lora = AdapterLoader(engine, adapter, folder)
        self.served_version: int | None = None  # the verified version vLLM serves
        self.dirty = False  # an apply failed inside vLLM: paused until a full reload succeeds
        self._unserved: Pulled | None = None  # verified into held, but its pause failed
        self.status = SyncState.STARTING  # changed only by _set_state
        self.errors = 0
        self.last_error: str | None = None
        self.recent: list[SyncRecord] = []
        self.info: ModelInfo | None = None
        self.apply_path = ""
        self._last_exc: BaseException | None = None
        self._prefix_reset_pending = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def connect(self) -> str:
        """Ask the worker extension about the model and choose the apply path (reported)."""
        self.info = ModelInfo.from_json(self.engine.describe())
        if self.lora is not None:  # the base weights never change: any served model will do
            self.lora.reset()
            self.apply_path = "lora"
        else:
            self.apply_path = choose_apply_path(self.info, self.requested_path)
        log.info(
            "replica %s: model %s on %s dtype=%s tied=%s apply_path=%s store=%s",
            self.replica_id,
            self.info.architecture,
            self.info.device,
            self.info.dtype,
            self.info.tie_word_embeddings,
            self.apply_path,
            self.store.uri,
        )
        return self.apply_path

    def start(self) -> None:
        """Connect, then poll on a daemon thread until ``stop``."""
        if self.info is None:
            self.connect()
        if self.follow_events and self.follower.feed is None:
            self.follower.feed = follow_changes(
                self.store, [MANIFEST_PATH], on_signal=self._wake.set, owner=self
            )
        self._thread = threading.Thread(target=self._run, name="deltasync-sync", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling and write a final ``stopped`` heartbeat."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "sync thread still busy after %.0fs; its state changes are refused", timeout
                )
        self._set_state(SyncState.STOPPED)
        self._beats.forget()  # the final heartbeat is written whatever the gap
        self._heartbeat(force=True)
        if self.follower.feed is not None:
            self.follower.feed.close()
        self.follower.close()

    def wake(self) -> None:
        """Poll now instead of at the next interval."""
        self._wake.set()

    @property
    def ready(self) -> bool:
        """Serving a verified bucket version (and not paused for a recovery)."""
        return self.served_version is not None and not self.dirty

    @property
    def routes(self) -> AdapterRoutes | None:
        """Where the front sends adapter requests (None on a full-weight replica)."""
        return self.lora.routes if self.lora is not None else None

    @property
    def newest_seen(self) -> int | None:
        return self.follower.newest_seen

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between heartbeats while nothing changes (remote stores: at least 60)."""
        return self._beats.interval_s

    @property
    def heartbeat_min_gap_s(self) -> float:
        """Least seconds between two heartbeat writes."""
        return self._beats.min_gap_s

    @property
    def poll_interval_s(self) -> float:
        return self.follower.poll_interval_s

    @property
    def error_poll_interval_s(self) -> float:
        return self.follower.error_poll_interval_s

    @property
    def feed_live(self) -> bool:
        """Whether the bucket's event feed is followed now (polls only on its changes)."""
        return self.follower.feed is not None and self.follower.feed.live

    def next_poll_delay_s(self) -> float:
        """Seconds to wait before the next poll (``Follower.delay_s``; with a live event feed
        ``Follower.wait_s``, a safety poll, cut short to write a heartbeat when one is due)."""
        wait = self.follower.wait_s()
        if wait > self.follower.delay_s:  # a live feed: keep heartbeats on time
            wait = max(self.follower.delay_s, min(wait, self._beats.next_due_s()))
        return wait

    def _run(self) -> None:
        while not self._stop.is_set():
            polls = self.follower.follow(self._stop, self._wake, self.next_poll_delay_s)
            try:
                for pulled in polls:
                    self._serve(pulled)
            except Exception as e:  # recovered on purpose: the replica keeps serving; reported
                log.exception("sync poll failed unexpectedly; serving v%s", self.served_version)
                self._report(e)
                self._stop.wait(self.poll_interval_s)
            finally:
                polls.close()  # releases the poll lock if the error left the generator suspended

    # ----------------------------------------------------------------------------------- poll
    def poll_once(self) -> SyncRecord | None:
        """One poll: sync to the newest version if behind. Returns the sync's record, if any.

        Sets :meth:`next_poll_delay_s`. Store and manifest errors are reported (status "error",
        ``last_error``), not raised; an unreadable bucket (``StoreAccessError``) is reported
        at once and slows polling to ``error_poll_interval_s``.
        """
        with self.follower.lock:
            if self.info is None:
                self.connect()
            return self._serve(self.follower.poll())

    def _serve(self, pulled: Pulled | None) -> SyncRecord | None:
        """Serve what a poll verified: stage it, then apply it inside the pause."""
        if self.info is None:
            self.connect()
        if self.dirty:
            self._recover_full()
            return None
        if self.lora is not None:
            try:
                self.lora.retire()
            except EngineControlError as e:
                self._report(e, "unloading a retired adapter failed; retrying at the next poll")
        if self.follower.failed:
            return None
        if self.status is SyncState.ERROR and isinstance(self._last_exc, StoreAccessError):
            self._set_state(SyncState.STARTING if self.served_version is None else SyncState.OK)
            self._last_exc = None
        if self._unserved is not None:  # the pause failed last time: serve it with this pull
            pulled = self._unserved if pulled is None else self._unserved.then(pulled)
            self._unserved = None
        if pulled is None:
            if self.newest_seen is not None and self.served_version != self.newest_seen:
                self._set_state(SyncState.ERROR)  # behind, and nothing verified: reported already
                self._heartbeat(force=True)
                return None
            self._retry_prefix_reset()
            if self.newest_seen is not None:
                self._set_state(SyncState.OK)
            if self.check_interval_s and self.clock() - self._checked_at >= self.check_interval_s:
                self.check_served()
            self._heartbeat()
            return None
        whole = pulled.plan.from_version is None  # a first version or a re-anchor
        self._set_state(SyncState.RECOVERING if whole else SyncState.SYNCING)
        if self.lora is not None:
            return self._load_adapter(pulled)
        assert self.info is not None
        path = os.path.join(self.stage_dir, f"{self.replica_id}-v{self.held.version}.safetensors")
        try:
            staged = stage_pull(
                pulled, self.held, self.info, self.apply_path, self.served_version, path
            )
        except (OSError, ValueError) as e:  # disk full, a lost folder: nothing reached vLLM
            # held is at the pulled version, vLLM still at served_version: keep the pull, so
            # the next stage goes from what is served (its patches and any later ones)
            self._unserved = pulled
            unlink_stage(path)
            self._report(e, f"staging v{self.held.version} failed; serving v{self.served_version}")
            return None
        return self._apply(staged)

    def _apply(self, p: Staged) -> SyncRecord | None:
        """The paused window: pause(keep), apply, record the version, reset prefixes, resume."""
        version = self.held.version
        t_pause = time.perf_counter()
        try:
            self.engine.pause("keep")
        except EngineControlError as e:  # nothing applied: keep serving the old version
            self._unserved = p.pulled
            unlink_stage(p.path)
            self._report(e, "pause failed; retrying at the next poll")
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
            unlink_stage(p.path)
        try:
            self.engine.set_version(version)
        except EngineControlError as e:  # the weights are new, the version vLLM reports is not
            self.dirty = True
            self._report(e, f"recording v{version} failed; paused for a full reload")
            self._recover_full()
            return None
        self._reset_prefixes()
        try:
            self.engine.resume()
        except EngineControlError as e:  # still paused: not ready until a resume answers
            self.dirty = True
            self._report(e, f"resume after v{version} failed; paused for a full reload")
            self._recover_full()
            return None
        paused_s = time.perf_counter() - t_pause
        rec = p.pulled.record(paused_s, apply_s, p.mode, extra_decode_s=p.stage_s)
        return self._served(rec, p.from_version, p.stage_s, p.tensors)

    def _load_adapter(self, pulled: Pulled) -> SyncRecord | None:
        """Load the held adapter version into vLLM under a new name; no pause."""
        assert self.lora is not None and pulled.manifest.adapter is not None
        version = self.held.version
        try:
            write_s, load_s = self.lora.load(self.held.tensors, pulled.manifest.adapter, version)
        except (EngineControlError, OSError) as e:  # the old version keeps serving
            self._unserved = pulled
            self._report(e, f"load of adapter v{version} failed; retrying at the next poll")
            return None
        rec = pulled.record(0.0, load_s, "lora", extra_decode_s=write_s)
        return self._served(rec, self.served_version, write_s, len(self.held.tensors))

    def _served(
        self, rec: SyncRecord, from_version: int | None, stage_s: float, tensors: int
    ) -> SyncRecord:
        """Record that vLLM now serves ``rec.version``: state, log line, heartbeat."""
        version = rec.version
        self.served_version = version
        rec.from_version = from_version
        self.recent.append(rec)
        self.recent = self.recent[-50:]
        # behind after a sync only when a step was refused (plans always go to the newest)
        self._set_state(SyncState.OK if version == self.newest_seen else SyncState.ERROR)
        log.info(
            "sync v%s->v%d %s steps=%d bytes=%d fetch=%.4fs decode=%.4fs stage=%.4fs "
            "paused=%.4fs apply=%.4fs path=%s tensors=%d lag=%.3fs newest=v%s prefix_reset=%s",
            *(from_version, version, rec.kind, rec.steps, rec.bytes, rec.fetch_s),
            *(rec.decode_s - stage_s, stage_s, rec.paused_s, rec.apply_s, rec.apply_path),
            *(tensors, rec.lag_s, self.newest_seen),
            "deferred" if self._prefix_reset_pending else "ok",
        )
        self._heartbeat(force=True)
        return rec

    def _recover_full(self, check: bool = True) -> None:
        """Reload every tensor from the verified CPU copy while generation stays paused, then
        (``check``) run the full-weights check on what it serves (:meth:`check_served`)."""
        if self.held.version is None or self.info is None:
            return
        version = self.held.version
        path = os.path.join(self.stage_dir, f"{self.replica_id}-v{version}-full.safetensors")
        try:
            write_stage(
                path,
                "dense",
                version,
                dense=dict(self.held.tensors),
                refresh_lm_head=self.info.tie_word_embeddings,
            )
            self.engine.pause("keep")  # paused already, unless a failed resume did resume
            self.engine.apply(path, "reload")
            self.engine.set_version(version)
            # proven, not assumed: a reload that does not serve the bits stays paused
            wrong = self._mismatched()[0] if check and self.lora is None else []
            if wrong:
                raise EngineControlError(
                    f"the full reload of v{version} does not serve its verified digests in "
                    f"{len(wrong)} tensors {wrong[:3]}"
                )
            self._reset_prefixes()
            self.engine.resume()
        except (EngineControlError, OSError, ValueError) as e:  # _report: recovering (dirty)
            self._report(e, f"full reload of v{version} failed; generation stays paused")
            return
        finally:
            unlink_stage(path)
        self.dirty = False
        self.served_version = version
        self._set_state(SyncState.OK if version == self.newest_seen else SyncState.SYNCING)
        log.warning("recovered: full reload of v%d applied and checked; resumed", version)
        self._heartbeat(force=True)

    def _mismatched(self) -> tuple[list[str], float]:
        """The held tensors whose digest differs from what the engine serves, and the seconds
        the read-back took (``Engine.served_digests``).

        Raises:
            EngineControlError: the read-back failed.
        """
        t0 = time.perf_counter()
        served = self.engine.served_digests()
        want = self.held.digests
        return sorted(n for n in want if served.get(n) != want[n]), time.perf_counter() - t0

    def _reset_prefixes(self) -> None:
        """Drop cached prefixes of the old weights; a refusal or a failed call is retried at
        the next poll (``_retry_prefix_reset``), never fatal."""
        try:
            self._prefix_reset_pending = not self.engine.reset_prefix_cache()
        except EngineControlError as e:
            self._prefix_reset_pending = True
            log.warning("prefix cache reset failed (retried at the next poll): %s", e)

    def check_served(self) -> dict | None:
        """Check every tensor vLLM serves against the verified digests of the version it reports.

        The worker reads each checkpoint tensor back from what the engine computes with
        (``Engine.served_digests``: linear weights through their own kernel, fused shards split,
        norms and embeddings as they are) and digests its bf16 bits; each must equal the digest
        the version's payloads carry (``held.digests``, checked when the version was verified).
        Every tensor is checked, not only those a patch touched, with no pause: the follower's
        lock keeps any sync from moving the weights meanwhile. A difference is reported (status
        ``error``, ``last_error`` naming the tensors) and repaired by a full reload from the
        verified CPU copy, paused, which is itself checked before generation resumes (as every
        full reload is). A LoRA replica, or one not serving its held version, is not checked
        (None).

        Returns:
            ``{"version", "tensors", "mismatched" (names), "read_s", "repaired"}``.
        """
        with self.follower.lock:
            self._checked_at = self.clock()
            if self.lora is not None or not self.ready or self.held.version != self.served_version:
                return None
            version = self.served_version
            try:
                wrong, read_s = self._mismatched()
            except EngineControlError as e:
                self._report(e, f"full-weights check of v{version}: reading back failed")
                return None
            want = self.held.digests
            out = {
                "version": version,
                "tensors": len(want),
                "mismatched": wrong,
                "read_s": round(read_s, 6),
                "repaired": False,
            }
            self.checks = [*self.checks[-9:], out]
            if not wrong:
                log.info(
                    "check v%d: %d tensors served as verified (%.3fs)", version, len(want), read_s
                )
                return out
            self.dirty = True  # what is served is not the version: paused until reloaded
            self._report(
                RuntimeError(
                    f"served weights of v{version} differ from its verified digests in "
                    f"{len(wrong)} of {len(want)} tensors {wrong[:3]}; repairing by a full reload"
                ),
                "full-weights check",
            )
            self._recover_full()
            out["repaired"] = not self.dirty
            return out

    def _retry_prefix_reset(self) -> None:
        if self._prefix_reset_pending:
            try:
                self._prefix_reset_pending = not self.engine.reset_prefix_cache()
            except EngineControlError as e:
                self._report(e, "prefix cache reset failed")

    # ---------------------------------------------------------------------------------- status
    def _set_state(self, new: SyncState) -> None:
        """The one place the state changes.

        Raises:
            rollout.state.SyncStateError: ``rollout.state.TRANSITIONS`` has no way from the
                current state to ``new`` (e.g. any change after ``stop``).
        """
        check_transition(self.status, new)
        self.status = new

    def _report(self, exc: BaseException, what: str = "") -> None:
        self.errors += 1
        self._last_exc = exc
        self.last_error = f"{type(exc).__name__}: {exc}"[:2000]
        self._set_state(SyncState.RECOVERING if self.dirty else SyncState.ERROR)
        log.warning(
            "%s%s (serving v%s, errors=%d)",
            f"{what}: " if what else "",
            self.last_error,
            self.served_version,
            self.errors,
        )
        self._heartbeat(force=True)

    def heartbeat(self) -> ReplicaHeartbeat:
        """The current status as a heartbeat object."""
        behind = self.newest_seen is not None and self.served_version != self.newest_seen
        return ReplicaHeartbeat(
            replica_id=self.replica_id,
            held_version=self.served_version,
            newest_seen=self.newest_seen,
            lag_versions=lag_versions(self.newest_seen, self.served_version),
            lag_s=lag_s(self.follower.newest_published_at if behind else None),
            status=self.status.value,
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
        if not self._beats.due(force):
            return
        try:
            write_heartbeat(self.store, self.heartbeat())
        except StoreError as e:  # status is best effort; serving goes on
            log.warning("heartbeat write to %s failed: %s", self.store.uri, e)
