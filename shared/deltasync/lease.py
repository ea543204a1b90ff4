"""The trainer's writer lease on a run: ``writer.json`` (docs/PROTOCOL.md, section 5).

One trainer writes a run at a time. It takes the lease at start, before it reads anything it
relies on (refused while another writer's lease is younger than that writer's ``lease_s``,
unless it takes over; then read back, so of two writers that wrote at once only the last one
goes on), renews it every ``lease_s / 3`` (with a manifest commit when one is due, on its own
while idle, and from a thread while a payload uploads: :meth:`LeaseKeeper.renewing`), checks
before every manifest commit that the lease is still its own, and deletes it on a clean close.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

from .errors import ConcurrentWriterError, StoreNotFoundError
from .manifest import WRITER_PATH, WriterLease
from .store import Store

log = logging.getLogger("deltasync.publisher")


class LeaseKeeper:
    """Holds one writer's lease on the run at ``store``'s root.

    Args:
        store: the run's store.
        run_id: the run's name (recorded in the lease).
        writer_id: this writer's id.
        lease_s: seconds after which a lease that was not renewed counts as abandoned.
        takeover: take the lease even if another writer's looks fresh.

    Attributes:
        lost: None, or the ``ConcurrentWriterError`` a renewal found (another writer holds the
            lease); :meth:`renewing` raises it when its block ends.

    Raises:
        ConcurrentWriterError: from :meth:`acquire`, :meth:`check` and :meth:`renewing` when
            another writer holds the lease (or it is gone); the message names it and says what
            to do.
    """

    def __init__(self, store: Store, run_id: str, writer_id: str, lease_s: float, takeover: bool):
        self.store = store
        self.run_id = run_id
        self.writer_id = writer_id
        self.lease_s = lease_s
        self.takeover = takeover
        self.renewed_at = 0.0  # unix seconds of the last write of our lease
        self.lost: ConcurrentWriterError | None = None

    def record(self) -> bytes:
        """Our lease as written to ``writer.json``, stamped now."""
        lease = WriterLease(
            writer_id=self.writer_id,
            run_id=self.run_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            heartbeat_at=time.time(),
            lease_s=self.lease_s,
        )
        return lease.model_dump_json().encode()

    @property
    def due(self) -> bool:
        """Whether the lease should be renewed now (``lease_s / 3`` since the last write)."""
        return time.time() - self.renewed_at > self.lease_s / 3

    def renewed(self) -> None:
        """Note that :meth:`record` was written (e.g. in the same batch as a manifest)."""
        self.renewed_at = time.time()

    def acquire(self) -> None:
        """Take the lease: one read, one write, one read back.

        Raises:
            ConcurrentWriterError: another writer's lease is fresh (and ``takeover`` is off), or
                another writer wrote the lease at the same time and its write came last.
        """
        try:
            other = WriterLease.model_validate_json(self.store.read_bytes(WRITER_PATH))
        except StoreNotFoundError:
            other = None
        if other is not None and not self.takeover:
            age = time.time() - other.heartbeat_at
            if age < other.lease_s:
                raise ConcurrentWriterError(
                    f"{self.store.uri} is being written by writer {other.writer_id} on "
                    f"{other.host} (pid {other.pid}), last heartbeat {age:.0f}s ago. Stop that "
                    f"trainer, wait {other.lease_s - age:.0f}s for its lease to expire, or pass "
                    "takeover=True if it is dead"
                )
        self.store.write_bytes(WRITER_PATH, self.record())
        self.renewed()
        self.check()  # two writers that wrote at once: the one written last goes on

    def check(self) -> WriterLease:
        """The lease in the store, if it is still ours.

        Raises:
            ConcurrentWriterError: another writer holds the lease, or ``writer.json`` is gone
                (a writer that took over and closed deletes it).
        """
        try:
            lease = WriterLease.model_validate_json(self.store.read_bytes(WRITER_PATH))
        except StoreNotFoundError as e:
            raise ConcurrentWriterError(
                f"{self.store.uri}: expected this trainer's writer lease ({self.writer_id}) in "
                f"{WRITER_PATH}, found none: another writer took the run over and released it, "
                "or the file was deleted. This trainer stops publishing; start it again (with "
                "takeover=True if no other trainer runs) to continue the run"
            ) from e
        if lease.writer_id != self.writer_id:
            raise ConcurrentWriterError(
                f"{self.store.uri}: writer {lease.writer_id} on {lease.host} (pid {lease.pid}) "
                f"took this run over; this trainer ({self.writer_id}) stops publishing and "
                "commits nothing more. Stop one of the two trainers"
            )
        return lease

    def refresh(self) -> None:
        """Check that the lease is ours, then write it anew."""
        self.check()
        self.store.write_bytes(WRITER_PATH, self.record())
        self.renewed()

    @contextlib.contextmanager
    def renewing(self) -> Iterator[None]:
        """Renew the lease from a thread while the block runs (a payload upload that may take
        longer than ``lease_s``): every ``lease_s / 3`` after the last renewal.

        Raises:
            ConcurrentWriterError: when the block ends, if a renewal found that another writer
                took the lease (:attr:`lost`); the renewal thread then stopped renewing. A store
                error of a renewal is logged and retried at the next tick; the check before the
                manifest commit decides.
        """
        stop = threading.Event()
        thread = threading.Thread(
            target=self._renew_until, args=(stop,), name="deltasync-lease", daemon=True
        )
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        if self.lost is not None:
            raise self.lost

    def _renew_until(self, stop: threading.Event) -> None:
        while True:
            wait_s = self.renewed_at + self.lease_s / 3 - time.time()
            if stop.wait(max(wait_s, self.lease_s / 30)):
                return
            if not self.due:
                continue
            try:
                self.refresh()
            except ConcurrentWriterError as e:
                log.error("lease lost during an upload: %s", e)
                self.lost = e
                return
            except Exception as e:  # retried at the next tick; the commit's check decides
                log.warning("renewing the writer lease failed (%r); retrying", e)

    def release(self, also_delete: list[str]) -> None:
        """Delete the lease (if still ours) together with ``also_delete``, in one call."""
        try:
            lease = WriterLease.model_validate_json(self.store.read_bytes(WRITER_PATH))
        except StoreNotFoundError:
            lease = None
        paths = list(also_delete)
        if lease is not None and lease.writer_id == self.writer_id:
            paths.append(WRITER_PATH)
        if paths:
            self.store.rm(paths)
