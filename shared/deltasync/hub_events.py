"""Following a Hugging Face bucket's event feed, so that readers poll when a file changed.

The Hub serves a server-sent-events feed of per-file changes for a bucket
(``GET /api/buckets/<id>/events``; events ``ready``, ``changes`` ``{cursor, changes: [{path,
op}]}``, ``reset``, ``reconnect``; best effort: 401/403/404/501 mean "not available").
huggingface_hub 2.4 follows it for ``HfFileSystem(live_follow=True)`` with ``BucketFollower``
(``huggingface_hub._bucket_live_follow``): a daemon thread that connects, resumes after a
dropped stream from the last cursor (the server replays what was missed), reconnects with
backoff (10 s doubling to 80 s after a failed connect, 1 s after a stream that ended), and stops
for good when the feed is not available. :class:`ChangeFeed` runs one for a run's folder and
tells its reader:

- ``live``: a stream is open and past ``ready`` (False before the first one, between a dropped
  stream and the next ``ready``, and for good once the feed is not available);
- which watched paths changed since the reader last asked (:meth:`ChangeFeed.take`), and
  whether it must reconcile (one normal read of everything): after each ``ready`` (a first
  connect or a reconnect), a ``reset`` (the server could not replay from the cursor), and when a
  stream drops (until the next ``ready`` the reader polls as it does without a feed).

Readers (``rollout.sync_loop.SyncLoop``, ``dashboard.data.BucketReader``) poll as usual while
``live`` is False; while it is True they read only when told (plus a slow safety poll,
``safety_poll_s``). ``BucketFollower`` is private to huggingface_hub: this module is the only
place that uses it, and only on the version it was written for (2.4.x); any other version logs
one line and the readers keep polling. Importing this module does not import huggingface_hub.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable

log = logging.getLogger("deltasync.hub_events")

# The huggingface_hub versions whose private BucketFollower this module was written against.
SUPPORTED_HUB_VERSIONS = ("2.4.",)
SAFETY_POLL_S = 60.0  # a reader with a live feed still polls this often (seconds)

_warned: set[str] = set()


class ChangeFeed:
    """One bucket run's change feed, followed on a daemon thread (see the module docstring).

    Args:
        hub: the run's ``deltasync.hub_store.HubBucket`` (``bucket_id``, ``prefix``, ``token``,
            ``endpoint``).
        paths: paths relative to the run's folder to watch; one ending in ``/`` watches the
            files under it (``replicas/``).
        on_signal: called (no argument, on the feed's thread) after each change to a watched
            path and each reconcile (``ready``, ``reset``, a dropped stream): a reader's
            ``threading.Event.set``. It must return quickly.
        owner: the follow stops once this object is garbage collected (None: only on
            :meth:`close`).
        safety_poll_s: seconds between a reader's polls while the feed is live.

    Call :meth:`start`; it returns False (and nothing runs) where huggingface_hub is not a
    supported version.
    """

    def __init__(
        self,
        hub,
        paths: Iterable[str],
        on_signal: Callable[[], None] | None = None,
        owner: object | None = None,
        safety_poll_s: float = SAFETY_POLL_S,
    ):
        self.hub = hub
        self.safety_poll_s = safety_poll_s
        self._paths = {p.lstrip("/") for p in paths}
        self._on_signal = on_signal
        self._owner = weakref.ref(owner) if owner is not None else None
        self._lock = threading.Lock()
        self._changes: dict[str, str] = {}  # relative path -> op, since the last take()
        self._reconcile = True  # nothing taken yet: the first read reads everything
        self._live = False
        self._closed = False
        self.unavailable: str | None = None  # why the feed cannot be followed, once known
        self.sessions = 0  # streams that reached ``ready``
        self.changes_seen = 0  # watched changes received
        self._thread = None

    # ---------------------------------------------------------------------------- lifecycle
    def start(self) -> bool:
        """Start following on a daemon thread. Returns False, logging one line, where the
        installed huggingface_hub is not a version this module supports (readers then poll)."""
        import huggingface_hub

        version = huggingface_hub.__version__
        if not version.startswith(SUPPORTED_HUB_VERSIONS):
            if version not in _warned:
                _warned.add(version)
                log.warning(
                    "bucket event feed not followed: written for huggingface_hub %s, found %s; "
                    "polling instead",
                    "/".join(v + "x" for v in SUPPORTED_HUB_VERSIONS),
                    version,
                )
            self.unavailable = f"huggingface_hub {version} is not supported"
            return False
        self._thread = _follower_class()(self)
        self._thread.start()
        return True

    def close(self) -> None:
        """Stop following (the thread ends at the stream's next byte or keep-alive)."""
        self._closed = True
        self._live = False
        if self._thread is not None:
            self._thread.stop()

    @property
    def live(self) -> bool:
        """A stream is open and past ``ready``: changes arrive as they happen."""
        return self._live and not self._closed

    @property
    def pending(self) -> bool:
        """Something to :meth:`take`: a watched path changed, or a reconcile is due."""
        with self._lock:
            return self._reconcile or bool(self._changes)

    def take(self) -> tuple[dict[str, str], bool]:
        """``(changes, reconcile)`` since the last call, and forget them: the watched paths
        that changed (relative path -> ``add``, ``update`` or ``delete``, the last op seen) and
        whether the reader must read everything once (first call, ``ready``, ``reset``, a dropped
        stream)."""
        with self._lock:
            changes, reconcile = self._changes, self._reconcile
            self._changes, self._reconcile = {}, False
        return changes, reconcile

    # ------------------------------------------------------------------ the follower's calls
    def _alive(self) -> bool:
        return not self._closed and (self._owner is None or self._owner() is not None)

    def _watched(self, rel: str) -> bool:
        return rel in self._paths or any(p.endswith("/") and rel.startswith(p) for p in self._paths)

    def _on_changes(self, changes) -> None:
        prefix = self.hub.prefix + "/" if self.hub.prefix else ""
        hit = {}
        for c in changes:
            if c.path.startswith(prefix) and self._watched(c.path[len(prefix) :]):
                hit[c.path[len(prefix) :]] = c.op
        if hit:
            with self._lock:
                self._changes.update(hit)
                self.changes_seen += len(hit)
            self._signal()

    def _on_reconcile(self) -> None:
        self._set_reconcile(live=self._live)

    def _on_ready(self) -> None:
        self.sessions += 1
        if self.sessions > 1:
            log.info("bucket event feed of %s: following again", self.hub.bucket_id)
        self._set_reconcile(live=True)

    def _on_session_end(self, unavailable: str | None = None) -> None:
        if unavailable is not None:
            self.unavailable = unavailable
            log.info(
                "bucket event feed of %s not available (%s); polling",
                self.hub.bucket_id,
                unavailable,
            )
        if self._live:
            self._set_reconcile(live=False)

    def _set_reconcile(self, live: bool) -> None:
        with self._lock:
            self._reconcile = True
            self._live = live
        self._signal()

    def _signal(self) -> None:
        if self._on_signal is not None and self._alive():
            self._on_signal()


def follow_changes(
    store,
    paths: Iterable[str],
    on_signal: Callable[[], None] | None = None,
    owner: object | None = None,
    safety_poll_s: float = SAFETY_POLL_S,
) -> ChangeFeed | None:
    """A started :class:`ChangeFeed` on ``store``'s run folder, or None where there is no feed
    to follow: a store that is not ``hf://`` (``store.hub`` is None: a folder, ``memory://``,
    ``s3://``), or an unsupported huggingface_hub. Arguments as :class:`ChangeFeed`'s."""
    hub = getattr(store, "hub", None)
    if hub is None:
        return None
    feed = ChangeFeed(hub, paths, on_signal, owner, safety_poll_s)
    return feed if feed.start() else None


_FOLLOWER = None


def _follower_class():
    """``BucketFollower`` with the two hooks a reader needs (built once, on first use):
    ``ready`` (its ``subscribed`` flag set) and a stream's end (``_follow_once`` returned or
    raised)."""
    global _FOLLOWER
    if _FOLLOWER is not None:
        return _FOLLOWER
    from huggingface_hub._bucket_live_follow import BucketEventsUnavailable, BucketFollower

    class _Follower(BucketFollower):
        def __init__(self, feed: ChangeFeed):
            self._feed = feed
            hub = feed.hub
            super().__init__(
                endpoint=hub.endpoint,
                bucket_id=hub.bucket_id,
                token=hub.token,
                on_changes=feed._on_changes,
                on_reconcile=feed._on_reconcile,
                is_alive=feed._alive,
            )
            self.name = f"deltasync-events-{hub.bucket_id}"

        @property
        def subscribed(self) -> bool:
            return self.__dict__.get("_subscribed", False)

        @subscribed.setter
        def subscribed(self, value: bool) -> None:
            self.__dict__["_subscribed"] = value
            if value:  # BucketFollower sets it at every ``ready``
                self._feed._on_ready()

        def _follow_once(self) -> bool:
            try:
                healthy = super()._follow_once()
            except BucketEventsUnavailable as e:
                self._feed._on_session_end(unavailable=str(e))
                raise
            except BaseException:
                self._feed._on_session_end()
                raise
            self._feed._on_session_end()
            return healthy

    _FOLLOWER = _Follower
    return _FOLLOWER
