"""What the publisher writes to the bucket: a version's anchor and delta parts, written and
uploaded in ONE ``Store.write_many`` batch (which also carries the retention deletes already
due), then ``manifest.json`` last, the commit point (with the writer lease when it is due). Also
the removal of orphans a writer left when it died before its manifest commit.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from . import deltafile
from .bf16 import bytes_digest
from .deltafile import PartLabel
from .errors import ConcurrentWriterError, ManifestError, StoreNotFoundError
from .lease import LeaseKeeper
from .manifest import (
    MANIFEST_PATH,
    WRITER_PATH,
    AdapterInfo,
    FileRef,
    Manifest,
    ModelFingerprint,
    Payload,
    VersionEntry,
    anchor_dir,
    delta_dir,
    part_name,
    retained,
)
from .store import Store

log = logging.getLogger("deltasync.publisher")


class PayloadWriter:
    """Writes one run's payload parts (see docs/PROTOCOL.md for the layout).

    Args:
        store: the run's store.
        run_id: recorded in every part's metadata.
        part_bytes: size cap of one part file in bytes (larger payloads are split).
        threads: anchor part files hashed in parallel.

    Attributes:
        pending_deletes: payload paths dropped by a committed manifest, deleted with the next
            batch (or on close, by the caller); after a crash they are orphans that the next
            writer removes.
    """

    def __init__(self, store: Store, run_id: str, part_bytes: int, threads: int = 2):
        self.store, self.run_id, self.part_bytes = store, run_id, part_bytes
        self.pending_deletes: list[str] = []
        self._pool = ThreadPoolExecutor(threads, "deltasync-hash")

    def close(self) -> None:
        self._pool.shutdown()

    def take_deletes(self) -> list[str]:
        """The pending deletes, handed over (and forgotten here)."""
        out, self.pending_deletes = self.pending_deletes, []
        return out

    def write(
        self,
        version: int,
        base_version: int | None,
        blobs: dict[str, bytes] | None,
        changed: dict[str, int],
        shapes: dict[str, tuple[int, ...]],
        digests: dict[str, str],
        anchor: dict[str, np.ndarray] | None,
    ) -> tuple[Payload | None, Payload | None]:
        """Write and upload a version's delta parts (codec ``blobs`` per tensor, None for an
        anchor-only version) and anchor parts (full bf16 bits per tensor, or None).

        Returns:
            (delta payload or None, anchor payload or None), with each file's size and xxh3.

        Raises:
            The store's errors; temporary files are removed either way.
        """
        items: list[tuple[str, bytes | Path]] = []
        tmp: list[str] = []  # the temp folder of anchor parts for a remote store, once made
        try:
            delta = anchor_payload = None
            if blobs is not None:
                groups = deltafile.split_parts(
                    [(n, len(b)) for n, b in blobs.items()], self.part_bytes
                )
                delta = Payload(files=[])
                for i, names in enumerate(groups):
                    data = deltafile.delta_part(
                        PartLabel(version, base_version, self.run_id, i, len(groups)),
                        {n: blobs[n] for n in names},
                        shapes,
                        digests,
                        {n: changed[n] for n in names},
                    )
                    rel = f"{delta_dir(version)}/{part_name(i)}"
                    delta.files.append(self._put(rel, data, items))
            if anchor is not None:
                names = sorted(anchor)
                groups = deltafile.split_parts(
                    [(n, anchor[n].nbytes) for n in names], self.part_bytes
                )
                files = []
                for i, group in enumerate(groups):
                    rel = f"{anchor_dir(version)}/{part_name(i)}"
                    local = self._anchor_path(rel, items, tmp)
                    deltafile.write_anchor_part(
                        local,
                        PartLabel(version, None, self.run_id, i, len(groups)),
                        {n: anchor[n] for n in group},
                        digests,
                    )
                    files.append((local, rel))
                anchor_payload = Payload(files=list(self._pool.map(_file_ref, files)))
            deletes = list(self.pending_deletes)
            self.store.write_many(items, delete=deletes)
            del self.pending_deletes[: len(deletes)]  # kept on failure: orphans for the next writer
        finally:
            for t in tmp:
                shutil.rmtree(t, ignore_errors=True)
        return delta, anchor_payload

    def _put(self, rel: str, data: bytes, items: list) -> FileRef:
        """A delta part: written in place on a local store (atomically), else added to the batch
        as bytes (no temp file). Its FileRef is taken from the bytes in memory."""
        local = self.store.local_path(rel)
        if local is None:
            items.append((rel, data))
        else:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            tmp = f"{local}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, local)
        return FileRef(path=rel, bytes=len(data), digest=bytes_digest(data))

    def _anchor_path(self, rel: str, items: list, tmp: list[str]) -> str:
        """Where an anchor part is written: in place on a local store, else a file in a temp
        folder that the batch uploads (added to ``items``)."""
        local = self.store.local_path(rel)
        if local is not None:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            return local
        if not tmp:
            tmp.append(tempfile.mkdtemp(prefix="deltasync-"))
        path = os.path.join(tmp[0], rel.replace("/", "_"))
        items.append((rel, Path(path)))
        return path

    def remove_orphans(self, manifest: Manifest | None) -> None:
        """Delete payload files no manifest names (left by a writer that died before its
        manifest commit). Safe: only the lease holder writes payloads. One listing of the run."""
        named = set()
        for v in manifest.versions if manifest else []:
            for payload in (v.delta, v.anchor):
                if payload is not None:
                    named.update(f.path for f in payload.files)
        found = [p for p in self.store.ls("") if p.startswith(("anchors/", "deltas/"))]
        orphans = [p for p in found if p not in named]
        if orphans:
            log.info("removing %d orphaned payload files, e.g. %s", len(orphans), orphans[:3])
            self.store.rm(orphans)


def read_manifest(store: Store) -> Manifest | None:
    """The run's manifest, or None where there is none yet.

    Raises:
        ManifestError: the file exists and is not a valid manifest.
    """
    try:
        data = store.read_bytes(MANIFEST_PATH)
    except StoreNotFoundError:
        return None
    try:
        return Manifest.from_json(data)
    except ValueError as e:
        raise ManifestError(
            f"{store.uri}/{MANIFEST_PATH} is not a valid deltasync manifest ({e}); "
            "point the trainer at an empty prefix or repair the file"
        ) from e


def commit_manifest(
    store: Store,
    lease: LeaseKeeper,
    entry: VersionEntry,
    mine: Manifest | None,
    model: ModelFingerprint,
    keep_anchors: int,
    adapter: AdapterInfo | None = None,
) -> tuple[Manifest, list[VersionEntry]]:
    """Commit ``entry``: the bucket's manifest with it appended and retention applied, written
    in one batch with the lease when due (the manifest last).

    Args:
        mine: the manifest this writer committed last (None before its first).
        adapter: the run's adapter, recorded in the manifest (None: a full-weight run).

    Returns:
        (the committed manifest, the versions retention dropped: their files can go now).

    Raises:
        ConcurrentWriterError: another writer changed the manifest since ``mine``.
        The lease's errors (``LeaseKeeper.check``) and the store's.
    """
    current = read_manifest(store)
    if current is not None and current.writer_id != lease.writer_id:
        if mine is None or current.updated_at != mine.updated_at:
            raise ConcurrentWriterError(
                f"{store.uri}: the manifest was changed by writer {current.writer_id!r} "
                f"while this trainer ({lease.writer_id}) was publishing; stop one of them"
            )
    lease.check()
    versions = list(current.versions) if current else []
    versions = [v for v in versions if v.version < entry.version] + [entry]
    kept = retained(versions, keep_anchors)
    manifest = Manifest(
        run_id=lease.run_id,
        writer_id=lease.writer_id,
        model=model,
        adapter=adapter,
        versions=kept,
        updated_at=time.time(),
    )
    renew = lease.due
    items = [(WRITER_PATH, lease.record())] if renew else []
    store.write_many(items + [(MANIFEST_PATH, manifest.to_json())])
    if renew:
        lease.renewed()
    return manifest, [v for v in versions if v not in kept]


def _file_ref(local_rel: tuple[str, str]) -> FileRef:
    """The FileRef of a written file: its size and xxh3-64, read back from the page cache (for
    an anchor part that is faster than serializing it in memory first; docs/BENCHMARKS.md)."""
    local, rel = local_rel
    h = xxhash.xxh3_64()
    with open(local, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return FileRef(path=rel, bytes=os.path.getsize(local), digest=h.hexdigest())
