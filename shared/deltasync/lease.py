"""The trainer's writer lease on a run: ``writer.json`` (docs/PROTOCOL.md, section 5).

One trainer writes a run at a time. It takes the lease at start (refused while another writer's
lease is younger than that writer's ``lease_s``, unless it takes over), renews it every
``lease_s / 3`` (with a manifest commit when one is due, else on its own), checks before every
manifest commit that the lease is still its own, and deletes it on a clean close.
"""

from __future__ import annotations

import os
import socket
import time

from .errors import ConcurrentWriterError, StoreNotFoundError
from .manifest import WRITER_PATH, WriterLease
from .store import Store


class LeaseKeeper:
    """Holds one writer's lease on the run at ``store``'s root.

    Args:
        store: the run's store.
        run_id: the run's name (recorded in the lease).
        writer_id: this writer's id.
        lease_s: seconds after which a lease that was not renewed counts as abandoned.
        takeover: take the lease even if another writer's looks fresh.

    Raises:
        ConcurrentWriterError: from :meth:`acquire` and :meth:`check` when another writer holds
            the lease; the message names it and says what to do.
    """

    def __init__(self, store: Store, run_id: str, writer_id: str, lease_s: float, takeover: bool):
        self.store = store
        self.run_id = run_id
        self.writer_id = writer_id
        self.lease_s = lease_s
        self.takeover = takeover
        self.renewed_at = 0.0  # unix seconds of the last write of our lease

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
        """Take the lease (one read, one write)."""
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

    def check(self) -> WriterLease:
        """The lease in the store, if it is still ours."""
        lease = WriterLease.model_validate_json(self.store.read_bytes(WRITER_PATH))
        if lease.writer_id != self.writer_id:
            raise ConcurrentWriterError(
                f"{self.store.uri}: writer {lease.writer_id} on {lease.host} took this run over; "
                f"this trainer ({self.writer_id}) stops publishing"
            )
        return lease

    def refresh(self) -> None:
        """Check that the lease is ours, then write it anew."""
        self.check()
        self.store.write_bytes(WRITER_PATH, self.record())
        self.renewed()

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
