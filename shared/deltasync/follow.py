"""Following a bucket run: the one poll loop of every reader (replicas, tests, benches).

A :class:`Follower` keeps a :class:`HeldWeights` on the newest version it can verify:

1. read the manifest (a conditional read: an unchanged manifest costs one 304 on hf://);
2. plan from the held version to the newest, around payloads it refused before (re-anchoring once
   a newer anchor exists);
3. fetch and verify each step into ``held`` (``DeltaSubscriber.fetch`` + ``decode_into``), stopping at
   the first step that is refused; the verified steps come back as one :class:`Pulled`.

What a reader does with a :class:`Pulled` (apply it to vLLM inside a pause, to a dict, nothing) is
its own. Polling adapts, because bucket reads count against the Hub's rate limit: after a poll
that found nothing new the wait doubles up to ``max_poll_interval_s``, it snaps back to
``poll_interval_s`` once a new version appears, and it is ``error_poll_interval_s`` while the
bucket cannot be read as configured (``StoreAccessError``: a refused token, a missing bucket).

With a live event feed (``feed``, a ``deltasync.hub_events.ChangeFeed`` a long-lived reader
attaches and whose signal sets the ``wake`` event of :meth:`Follower.follow`), the wait is the
feed's ``safety_poll_s`` instead (:meth:`Follower.wait_s`): the follower polls when the feed says
the manifest changed or asks for a reconcile, and otherwise once a minute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .errors import (
    BaseVersionMismatch,
    DeltaCorruptError,
    ForeignRunError,
    ManifestError,
    ModelMismatchError,
    StaleManifestError,
    StoreAccessError,
    StoreError,
    StoreNotFoundError,
)
from .manifest import Manifest
from .status import SyncRecord
from .store import Store
from .subscriber import DeltaSubscriber, HeldWeights, PlanStep, SyncPlan

log = logging.getLogger("deltasync.follow")

# A payload that cannot be applied onto what is held (refused and avoided from then on), or that
# vanished after the manifest named it (retention moved on).
REFUSED = (DeltaCorruptError, BaseVersionMismatch, ModelMismatchError, StoreNotFoundError)

Report = Callable[[BaseException, str], None]


@dataclass
class Pulled:
    """The steps one poll fetched, verified and applied to the held weights.

    Attributes:
        manifest: the manifest the plan was made from.
        plan: the whole plan (``steps`` is a prefix of ``plan.steps`` when a step was refused).
        steps: the steps that verified, oldest first.
        applied: per step, ``list[Patch]`` (delta) or ``list[FullTensor]`` (anchor).
        sizes: per step, payload bytes downloaded.
        fetch_s: seconds downloading, digest-checking and parsing (all steps).
        decode_s: seconds decoding and verifying (all steps).
    """

    manifest: Manifest
    plan: SyncPlan
    steps: list[PlanStep] = field(default_factory=list)
    applied: list[list] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    fetch_s: float = 0.0
    decode_s: float = 0.0

    @property
    def version(self) -> int:
        """The version the held weights are at now."""
        return self.steps[-1].version

    @property
    def kind(self) -> str:
        """``anchor`` (the pull starts from an anchor), ``delta`` (one) or ``chain`` (several)."""
        if any(s.kind == "anchor" for s in self.steps):
            return "anchor"
        return "chain" if len(self.steps) > 1 else "delta"

    def then(self, later: Pulled) -> Pulled:
        """This pull followed by a ``later`` one, as one pull (for a reader that could not serve
        this one yet: the held weights are at ``later``'s version)."""
        return Pulled(
            later.manifest,
            SyncPlan(self.plan.from_version, later.plan.to_version, self.steps + later.steps),
            self.steps + later.steps,
            self.applied + later.applied,
            self.sizes + later.sizes,
            self.fetch_s + later.fetch_s,
            self.decode_s + later.decode_s,
        )

    def record(
        self, paused_s: float, apply_s: float, apply_path: str, extra_decode_s: float = 0.0
    ) -> SyncRecord:
        """The ``SyncRecord`` of this pull once a reader served it (now is ``applied_at``).

        Args:
            paused_s, apply_s: seconds generation was paused, and of the apply inside it.
            apply_path: the reader's apply path (``in-place``, ``reload``, ``cpu-dict``).
            extra_decode_s: reader work outside the pause added to ``decode_s`` (staging).
        """
        entry = self.manifest.entry(self.version)
        return SyncRecord(
            version=self.version,
            from_version=self.plan.from_version,
            kind=self.kind,
            steps=len(self.steps),
            bytes=sum(self.sizes),
            fetch_s=round(self.fetch_s, 6),
            decode_s=round(self.decode_s + extra_decode_s, 6),
            paused_s=round(paused_s, 6),
            apply_s=round(apply_s, 6),
            published_at=entry.created_at if entry else time.time(),
            applied_at=time.time(),
            apply_path=apply_path,
        )


class Follower:
    """Keeps ``held`` on the newest verified version of one bucket run.

    Args:
        store: the run's Store or bucket URI, or a ``DeltaSubscriber`` to use.
        held: the weights to keep current (default: empty; the first poll loads an anchor).
        poll_interval_s: seconds between polls right after a change (the shortest).
        max_poll_interval_s: the longest wait while nothing changes (default:
            ``poll_interval_s`` on a local folder or ``memory://``, max(5, poll_interval_s) on a
            remote store, where each poll is a Hub request).
        error_poll_interval_s: seconds between polls while the bucket is unreadable as
            configured.
        report: called with (error, what) for every error of a poll, which is then not raised
            (a long-lived replica); None: errors propagate (tests, benches, one-shot catch-ups).
        sync_every: a forced lag (``make train SYNC_EVERY=k``, to see what lag does to
            learning): a poll pulls only once the newest version is at least this many versions
            past the one held, or once the newest has not changed for ``idle_sync_s`` seconds (the
            run paused for an evaluation, or ended); 1: every new version (the default).
        idle_sync_s: see ``sync_every``.
        clock: ``time.monotonic`` (a simulated clock in tests).
        subscriber_kw: ``DeltaSubscriber`` arguments when ``store`` is not one.

    Attributes:
        newest_seen, newest_published_at: the manifest's newest version and its commit time
            (unix s) at the last poll that read one. Never move backward: a manifest older than
            ``newest_seen`` or the held version (``StaleManifestError``) or of another
            ``run_id`` than the first one read (``ForeignRunError``) is ignored and reported.
        run_id: the run followed (None before the first manifest).
        refused: payloads refused or found gone, ``(kind, version, file digests) -> reason``.
        stuck: why no verified path to the newest version exists (None when one does).
        failed: the last poll ended in a reported error before anything verified.
        lock: held by each poll (a reader's control route and its thread poll one at a time).
        feed: a ``deltasync.hub_events.ChangeFeed`` watching the manifest (None: polling only);
            set by the reader that owns the follower.
    """

    def __init__(
        self,
        store: Store | str | DeltaSubscriber,
        held: HeldWeights | None = None,
        poll_interval_s: float = 1.0,
        max_poll_interval_s: float | None = None,
        error_poll_interval_s: float = 30.0,
        report: Report | None = None,
        sync_every: int = 1,
        idle_sync_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        **subscriber_kw,
    ):
        if sync_every < 1:
            raise ValueError(f"sync_every: expected 1 or more versions, found {sync_every}")
        if isinstance(store, DeltaSubscriber):
            self.subscriber = store
        else:
            self.subscriber = DeltaSubscriber(store, **subscriber_kw)
        self.store = self.subscriber.store
        self.held = held if held is not None else HeldWeights()
        if max_poll_interval_s is None:
            max_poll_interval_s = poll_interval_s if self.local else 5.0
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max(poll_interval_s, max_poll_interval_s)
        self.error_poll_interval_s = max(poll_interval_s, error_poll_interval_s)
        self.delay_s = poll_interval_s
        self.report = report
        self.sync_every, self.idle_sync_s, self.clock = sync_every, idle_sync_s, clock
        self._newest_since = clock()  # when newest_seen last changed
        self.newest_seen: int | None = None
        self.newest_published_at: float | None = None
        self.refused: dict[tuple, str] = {}
        self.stuck: str | None = None
        self.failed = False
        self.lock = threading.RLock()
        self.feed = None
        self._lagging = False  # the last poll held back on purpose (sync_every)
        self.run_id: str | None = None  # the run followed: set by the first manifest read

    @property
    def local(self) -> bool:
        """A folder or ``memory://`` store (polls cost no API request)."""
        return self.store.is_local or self.store.uri.startswith("memory://")

    def close(self) -> None:
        self.subscriber.close()

    # ----------------------------------------------------------------------------------- polls
    def poll(self, target: int | None = None) -> Pulled | None:
        """One poll: bring ``held`` to ``target`` (default: the newest version) as far as it
        verifies. Sets ``delay_s`` for the next poll.

        Returns:
            the verified steps, or None when ``held`` already is at the target, the run has no
            version yet, nothing verified, or (with ``report``) the poll failed (``failed``).

        Raises (only without ``report``):
            StoreAccessError: the bucket cannot be read as configured.
            ManifestError, StoreError: the manifest is invalid or the store kept failing.
            DeltaCorruptError, BaseVersionMismatch, ModelMismatchError, StoreNotFoundError: a
                step was refused (remembered in ``refused``; ``held`` stays at the last step that
                verified).
        """
        with self.lock:
            self.failed = False
            self._lagging = False
            try:
                manifest = self.subscriber.read_manifest()
            except StoreAccessError as e:
                self.delay_s = self.error_poll_interval_s
                return self._fail(e, "bucket unreadable; retrying slowly")
            except (ManifestError, StoreError) as e:
                self._backoff()
                return self._fail(e, "")
            if manifest is None or manifest.latest is None:
                self._backoff()
                return None
            refused = self._refuse_backward(manifest)
            if refused is not None:
                self._backoff()
                return self._fail(refused, "manifest ignored")
            self.run_id = manifest.run_id
            if manifest.latest.version != self.newest_seen:
                self.delay_s = self.poll_interval_s  # something moved: poll at the fastest
                self._newest_since = self.clock()
            else:
                self._backoff()
            self.newest_seen = manifest.latest.version
            self.newest_published_at = manifest.latest.created_at
            if target is None and self._lagging_on_purpose():
                return None
            plan = self._plan(manifest, target)
            if plan is None or not plan.steps:
                return None
            return self._pull(manifest, plan)

    def wait_s(self) -> float:
        """Seconds to wait before the next poll: ``delay_s``, or, while ``feed`` is live and
        the last poll did not fail, the feed's ``safety_poll_s`` (the feed wakes the follower
        when the manifest changes); a forced lag (``sync_every``) still polls when
        ``idle_sync_s`` is up."""
        feed = self.feed
        if feed is None or not feed.live or self.failed:
            return self.delay_s
        wait = max(self.delay_s, feed.safety_poll_s)
        if self._lagging:
            idle_left = self.idle_sync_s - (self.clock() - self._newest_since)
            wait = max(self.delay_s, min(wait, idle_left))
        return wait

    def follow(
        self,
        stop: threading.Event,
        wake: threading.Event | None = None,
        wait_s: Callable[[], float] | None = None,
    ) -> Iterator[Pulled | None]:
        """Poll until ``stop`` is set: yields each poll's result, then waits ``wait_s()``
        seconds (default :meth:`wait_s`) or until ``wake`` is set (a wake during a poll makes the
        next poll start at once). The poll's ``lock`` is held while the caller handles the
        result, so a reader can serve a pull before anyone polls again."""
        while not stop.is_set():
            if wake is not None:
                wake.clear()
            with self.lock:
                yield self.poll()
            (wake or stop).wait(wait_s() if wait_s is not None else self.wait_s())

    def _refuse_backward(self, manifest: Manifest) -> ManifestError | None:
        """Why ``manifest`` must not be followed, or None: another run's, or older than what
        was seen or is held (versions only move forward; a trainer's restart continues the
        numbering, so only a stale read or a replay goes back)."""
        if self.run_id is not None and manifest.run_id != self.run_id:
            return ForeignRunError(
                f"{self.store.uri}/manifest.json: expected run {self.run_id!r}, found run "
                f"{manifest.run_id!r}; a new run on this prefix needs a new reader (restart the "
                "replica) or another prefix"
            )
        floor = max(
            (v for v in (self.newest_seen, self.held.version) if v is not None), default=None
        )
        if floor is not None and manifest.latest.version < floor:
            return StaleManifestError(
                f"{self.store.uri}/manifest.json: expected a newest version of at least v{floor} "
                f"(seen before), found v{manifest.latest.version}; a stale read or an old "
                f"manifest written back: keeping v{self.held.version}"
            )
        return None

    def _lagging_on_purpose(self) -> bool:
        """Whether the forced lag (``sync_every``) keeps the held version for now."""
        held = self.held.version
        if self.sync_every == 1 or held is None or self.newest_seen is None:
            return False
        behind = self.newest_seen - held
        idle = self.clock() - self._newest_since >= self.idle_sync_s
        if 0 < behind < self.sync_every and not idle:
            self.delay_s = min(self.delay_s, self.idle_sync_s)
            self._lagging = True
            return True
        return False

    def _backoff(self) -> None:
        self.delay_s = min(max(self.delay_s, self.poll_interval_s) * 2, self.max_poll_interval_s)

    def _fail(self, exc: BaseException, what: str) -> None:
        if self.report is None:
            raise exc
        self.failed = True
        self.report(exc, what)
        return None

    @staticmethod
    def _key(step: PlanStep) -> tuple:
        return (step.kind, step.version, tuple(f.digest for f in step.files))

    def _plan(self, manifest: Manifest, target: int | None) -> SyncPlan | None:
        """The plan from what is held, or a re-anchor when that path uses a refused payload."""
        self.stuck = None
        for held in dict.fromkeys([self.held.version, None]):
            try:
                plan = self.subscriber.plan(held, manifest, target)
            except ManifestError as e:
                self._fail(e, "")
                continue
            bad = [s for s in plan.steps if self._key(s) in self.refused]
            if not bad:
                return plan
            log.info(
                "plan v%s->v%s uses refused %s v%d; trying a re-anchor",
                held,
                plan.to_version,
                bad[0].kind,
                bad[0].version,
            )
        self.stuck = (
            f"no verified path to v{manifest.latest.version}; holding v{self.held.version} "
            "until a newer anchor is published"
        )
        log.warning(self.stuck)
        return None

    def _pull(self, manifest: Manifest, plan: SyncPlan) -> Pulled | None:
        pulled = Pulled(manifest, plan)
        for step in plan.steps:
            try:
                fetched = self.subscriber.fetch(step)
                t0 = time.perf_counter()
                out = self.subscriber.decode_into(fetched, self.held, manifest)
            except REFUSED as e:
                self.refused[self._key(step)] = f"{type(e).__name__}: {e}"
                gone = isinstance(e, StoreNotFoundError)
                what = "payload gone; re-planning next poll" if gone else "refused"
                self._fail(e, f"{what} {step.kind} v{step.version}")
                break
            except StoreError as e:
                self._fail(e, "store read failed; retrying next poll")
                break
            pulled.decode_s += time.perf_counter() - t0
            pulled.fetch_s += fetched.fetch_s
            pulled.steps.append(step)
            pulled.applied.append(out)
            pulled.sizes.append(fetched.nbytes)
        self.failed = self.failed and not pulled.steps
        return pulled if pulled.steps else None
