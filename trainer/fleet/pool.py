"""The replica fleet: every rollout replica that follows the bucket serves the trainer's rollouts.

TRL's rollout worker talks to one server (``vllm_server_base_url``): the router
(``trainer.fleet.router.FleetRouter``), which sends each request to a replica of the
:class:`ReplicaPool` kept here.

Pool membership: a fixed list of URLs (``VLLM_URL=https://a,https://b``) and/or discovery from the
bucket (``VLLM_URL=auto``): every replica announces its ``/v1`` base URL in its heartbeat
(``replicas/<id>.json``, field ``url``); a fresh heartbeat with a URL the run trusts joins the
pool (``trainer.trust.TrustedUrls``: a ``VLLM_URL`` entry, a rollout Space deployed for the
run, or on a local bucket a loopback replica; every Space holding a bucket token can write a
heartbeat, so another URL is ignored with one warning), one older than ``heartbeat_max_age_s``
leaves it. Each member's ``GET /health`` is polled every
``health_interval_s``; states: ``joining`` (not yet healthy or no version yet), ``serving``,
``draining`` (more than ``max_staleness`` versions behind the trainer: no new requests until it
catches up), ``down`` (its last health check or request failed), ``gone`` (heartbeat stale).

Policy: least outstanding requests among serving replicas; the later turns of an episode go to the
replica of its previous turn (its prefix cache), unless that one fails or is ``STICKY_SLACK``
requests busier than the least loaded (``trainer.fleet.affinity``).

Why not ``vllm-router`` (PyPI 0.1.17, evaluated on 127.0.0.1, see the fleet issue's note): it
forwards the client's ``Authorization`` but cannot set one per replica, its sticky policies retry
a failed request on the same replica until a circuit breaker opens (10 failures), and its
``sticky_least_loaded`` balances sessions, not requests in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from deltasync.status import read_heartbeats
from deltasync.store import Store
from trainer.trust import TrustedUrls

log = logging.getLogger("trainer.fleet")

AUTO = "auto"
STICKY_SLACK = 4  # extra requests in flight an episode's replica may have before load wins


@dataclass
class Replica:
    """One member of the pool (fields are read and written under the pool's lock).

    Attributes:
        url: base URL of its public front (``/v1``, ``/health`` below it), no trailing slash.
        replica_id: its id from the heartbeat, or the URL for fixed members.
        state: ``joining``, ``serving``, ``draining``, ``down`` or ``gone``.
        held_version: the bucket version it serves (``/health``), None before its first sync.
        inflight: requests sent and not yet answered.
        served: requests it answered (2xx-4xx).
        failed: requests or health checks that failed.
        last_error: the last failure, in words.
        from_heartbeat: discovered from the bucket (leaves when its heartbeat goes stale).
        answered_at: ``time.monotonic()`` of its last answer to a request (None: none yet).
    """

    url: str
    replica_id: str
    state: str = "joining"
    held_version: int | None = None
    inflight: int = 0
    served: int = 0
    failed: int = 0
    last_error: str | None = None
    from_heartbeat: bool = False
    versions: dict[int, int] = field(default_factory=dict)  # version -> requests answered
    answered_at: float | None = None  # monotonic time of its last answer (busy, not dead)

    def describe(self) -> str:
        """``id (url) state vN [error]``: one replica in a log line."""
        err = f" ({self.last_error})" if self.last_error and self.state != "serving" else ""
        return f"{self.replica_id} {self.state} v{self.held_version}{err}"


def valid_replica_url(url: str, require_https: bool) -> str | None:
    """Why ``url`` cannot be a replica's base URL, or None when it can. Plain ``http`` is
    accepted only for loopback hosts, or anywhere when ``require_https`` is False."""
    try:
        p = urlparse(url)
    except ValueError as e:
        return f"unparsable ({e})"
    if p.scheme not in ("http", "https") or not p.hostname:
        return "expected http(s)://host[:port]"
    if p.query or p.fragment or p.username or p.password:
        return "expected no query, fragment or credentials"
    loopback = p.hostname in ("127.0.0.1", "localhost", "::1")
    if require_https and p.scheme != "https" and not loopback:
        return "expected https:// (a replica reached over the internet)"
    return None


class ReplicaPool:
    """The replicas rollouts may go to, kept current by a background thread.

    Args:
        urls: fixed members (base URLs).
        store: the run's bucket, for discovery from heartbeats; None: fixed members only.
        headers_for: headers for requests to a replica's URL (e.g. a private Space's
            ``Authorization``); never forwarded from TRL's requests.
        published_version_fn: the trainer's newest published version (None before the first).
        max_staleness: a replica more than this many versions behind is drained.
        health_interval_s: seconds between health checks (HTTP to the replicas, no Hub call).
        discover_interval_s: seconds between discovery reads of the bucket (one listing of
            ``replicas/`` and one read per heartbeat: Hub calls, on the run's shared budget).
        heartbeat_max_age_s: a discovered replica whose heartbeat is older leaves the pool.
        require_https: refuse discovered non-loopback ``http://`` URLs (remote buckets).
        busy_grace_s: a replica that answered a request within this many seconds is busy, not
            dead: a ``/health`` or a request that times out then counts as a failure but does
            not take it out of the pool (a refused connection or a 503 still does).
        health_timeout_s: seconds a ``/health`` may take.
        trust: which URLs announced in heartbeats may join (``trainer.trust``); the fixed
            ``urls`` always do. None: loopback replicas only.
    """

    def __init__(
        self,
        urls: list[str] | None = None,
        store: Store | None = None,
        headers_for: Callable[[str], dict[str, str]] = lambda url: {},
        published_version_fn: Callable[[], int | None] = lambda: None,
        max_staleness: int | None = None,
        health_interval_s: float = 2.0,
        discover_interval_s: float | None = None,
        heartbeat_max_age_s: float = 180.0,
        require_https: bool = False,
        busy_grace_s: float = 120.0,
        health_timeout_s: float = 5.0,
        trust: TrustedUrls | None = None,
    ):
        self.busy_grace_s = busy_grace_s
        self.store = store
        self.headers_for = headers_for
        self.published_version_fn = published_version_fn
        self.max_staleness = max_staleness
        self.health_interval_s = health_interval_s
        self.discover_interval_s = (
            health_interval_s if discover_interval_s is None else discover_interval_s
        )
        self._discovered_at = float("-inf")
        self.heartbeat_max_age_s = heartbeat_max_age_s
        self.require_https = require_https
        self.trust = trust or TrustedUrls(local_replicas=True)
        self.lock = threading.Lock()
        self.replicas: dict[str, Replica] = {}
        self._warned: set[str] = set()
        for url in urls or []:
            problem = valid_replica_url(url, require_https=False)
            if problem:
                raise ValueError(f"VLLM_URL entry {url!r}: {problem}")
            url = url.rstrip("/")
            self.replicas[url] = Replica(url, url)
        self._http = httpx.Client(timeout=health_timeout_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition(self.lock)

    # ----------------------------------------------------------------------------- membership
    def discover(self) -> None:
        """Add replicas announced by fresh heartbeats; mark those whose heartbeat is stale (or
        names another URL now) ``gone``."""
        if self.store is None:
            return
        now = time.time()
        seen: set[str] = set()
        for hb in read_heartbeats(self.store).values():
            if not hb.url or now - hb.updated_at > self.heartbeat_max_age_s:
                continue
            url = hb.url.rstrip("/")
            problem = valid_replica_url(hb.url, self.require_https)
            if problem is None and url not in self.replicas:  # a fixed member always may
                problem = self.trust.replica_problem(url)
            if problem:
                if hb.url not in self._warned:
                    self._warned.add(hb.url)
                    log.warning(
                        "replica %s announces %r: %s; ignored", hb.replica_id, hb.url, problem
                    )
                continue
            seen.add(url)
            with self.lock:
                r = self.replicas.get(url)
                if r is None:
                    self.replicas[url] = Replica(url, hb.replica_id, from_heartbeat=True)
                    log.info("replica %s joins the fleet at %s", hb.replica_id, url)
                elif r.state == "gone":
                    r.state = "joining"
                    log.info("replica %s rejoins the fleet at %s", hb.replica_id, url)
                if r is not None and r.replica_id == url:  # a fixed member: name it
                    r.replica_id = hb.replica_id
        with self.lock:
            for url, r in self.replicas.items():
                if r.from_heartbeat and url not in seen and r.state != "gone":
                    r.state = "gone"  # kept (with its counts), never routed to
                    log.info("replica %s leaves the fleet (heartbeat stale)", r.replica_id)
            self._changed.notify_all()

    def check_health(self) -> None:
        """Poll every member's ``/health`` and set its state."""
        with self.lock:
            members = [r for r in self.replicas.values() if r.state != "gone"]
        newest = self.published_version_fn()
        for r in members:
            busy = False
            try:
                resp = self._http.get(f"{r.url}/health", headers=self.headers_for(r.url))
                body = resp.json() if resp.status_code == 200 else {}
                error = None if resp.status_code == 200 else f"/health answered {resp.status_code}"
            except httpx.TimeoutException as e:
                body, error = {}, f"/health failed: {type(e).__name__}"
                busy = self._busy(r)
            except (httpx.HTTPError, ValueError) as e:
                body, error = {}, f"/health failed: {type(e).__name__}"
            with self.lock:
                before = r.state
                if busy:  # slow under load, still answering: keeps its state
                    r.failed += 1
                    r.last_error = (
                        f"{error} (busy: answered a request within {self.busy_grace_s:.0f}s)"
                    )
                elif error is not None:
                    r.state, r.last_error = "down", error
                    r.failed += 1
                else:
                    r.held_version = body.get("held_version")
                    if r.held_version is None or body.get("ready") is False:
                        r.state = "joining"
                    elif (
                        newest is not None
                        and self.max_staleness is not None
                        and newest - r.held_version > self.max_staleness
                    ):
                        r.state = "draining"
                    else:
                        r.state = "serving"
                if r.state != before:
                    log.info("replica %s: %s -> %s", r.replica_id, before, r.describe())
                self._changed.notify_all()

    def refresh(self) -> None:
        """A discovery read when ``discover_interval_s`` has passed, and a round of health
        checks."""
        if time.monotonic() - self._discovered_at >= self.discover_interval_s:
            self._discovered_at = time.monotonic()
            self.discover()
        self.check_health()

    def start(self) -> ReplicaPool:
        """Refresh now, then every ``health_interval_s`` in a daemon thread."""
        self.refresh()

        def loop() -> None:
            while not self._stop.wait(self.health_interval_s):
                try:
                    self.refresh()
                except Exception:  # a bad bucket read must not end the fleet's upkeep
                    log.exception("fleet refresh failed; retrying in %.0fs", self.health_interval_s)

        self._thread = threading.Thread(target=loop, name="fleet-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._http.close()

    # ------------------------------------------------------------------------------- routing
    def acquire(self, exclude: set[str], prefer: str | None = None) -> Replica | None:
        """The serving replica with the fewest requests in flight (not in ``exclude``), its
        ``inflight`` counted up; None when there is none. ``prefer`` (an episode's replica)
        wins while it serves and has at most ``STICKY_SLACK`` more requests in flight than the
        least loaded."""
        with self.lock:
            ready = [
                r for r in self.replicas.values() if r.state == "serving" and r.url not in exclude
            ]
            if not ready:
                return None
            r = min(ready, key=lambda x: (x.inflight, x.served))
            p = self.replicas.get(prefer) if prefer else None
            if p is not None and p in ready and p.inflight <= r.inflight + STICKY_SLACK:
                r = p
            r.inflight += 1
            return r

    def _busy(self, r: Replica) -> bool:
        """Whether ``r`` answered a request within ``busy_grace_s`` (busy, not dead)."""
        last = r.answered_at
        return last is not None and time.monotonic() - last <= self.busy_grace_s

    def release(
        self,
        r: Replica,
        error: str | None,
        version: int | None = None,
        count_failure: bool = False,
        timed_out: bool = False,
    ) -> None:
        """Count a finished request; ``error`` marks the replica ``down`` until its next
        successful health check, unless it ``timed_out`` while the replica still answers others
        (:meth:`_busy`); ``count_failure`` counts a failed answer of a live replica."""
        with self.lock:
            r.inflight -= 1
            if error is None:  # it answered (a 5xx too): alive
                r.answered_at = time.monotonic()
            if timed_out and error is not None and self._busy(r):
                count_failure, r.last_error = True, f"{error} (busy: not taken down)"
            if count_failure:
                r.failed += 1
            elif error is None:
                r.served += 1
                if version is not None:
                    r.versions[version] = r.versions.get(version, 0) + 1
            else:
                r.failed += 1
                r.last_error = error
                if r.state == "serving":
                    log.info("replica %s: serving -> down (%s)", r.replica_id, error)
                r.state = "down"
            self._changed.notify_all()

    def wait_change(self, timeout_s: float) -> None:
        """Block until a member changes state or ``timeout_s`` passes."""
        with self.lock:
            self._changed.wait(timeout_s)

    def describe(self) -> str:
        """Every member in one line (for waits and errors)."""
        with self.lock:
            parts = [
                f"{r.describe()} at {r.url}" for r in self.replicas.values() if r.state != "gone"
            ]
        return "; ".join(parts) or "no replica known (none announced in the bucket)"

    def replica_rows(self) -> list[dict]:
        """Per replica: url, id, state, held version, in flight, served, failed, last error, and
        the answers it served per bucket version (from ``X-Deltasync-Version``)."""
        with self.lock:
            return [
                {
                    "url": r.url,
                    "replica_id": r.replica_id,
                    "state": r.state,
                    "held_version": r.held_version,
                    "inflight": r.inflight,
                    "served": r.served,
                    "failed": r.failed,
                    "last_error": r.last_error,
                    "served_by_version": dict(sorted(r.versions.items())),
                }
                for r in self.replicas.values()
            ]

    def serving_count(self) -> int:
        """How many replicas serve now (state ``serving``)."""
        with self.lock:
            return sum(r.state == "serving" for r in self.replicas.values())

    def oldest_serving_version(self) -> int | None:
        """The oldest version any serving (or draining) replica holds: the version to tag new
        rollouts with when it is not known which replica generates them."""
        with self.lock:
            held = [
                r.held_version
                for r in self.replicas.values()
                if r.state in ("serving", "draining") and r.held_version is not None
            ]
        return min(held) if held else None


def parse_vllm_urls(value: str | None) -> tuple[list[str], bool]:
    """``VLLM_URL`` -> (fixed URLs, discover from heartbeats). ``auto`` (alone or in the list)
    turns discovery on; other entries are comma-separated base URLs."""
    items = [u.strip() for u in (value or "").split(",") if u.strip()]
    return [u for u in items if u != AUTO], AUTO in items
