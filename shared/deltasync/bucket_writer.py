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
from .errors import ConcurrentWriterError, ManifestError, StoreNotFoundError
from .lease import LeaseKeeper
from .manifest import (
    MANIFEST_PATH,
    WRITER_PATH,
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
        threads: parts hashed in parallel.

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
        tmps: list[str] = []
        try:
            delta_paths, anchor_paths = [], []
            if blobs is not None:
                groups = deltafile.split_parts(
                    [(n, len(b)) for n, b in blobs.items()], self.part_bytes
                )
                for i, names in enumerate(groups):
                    rel = f"{delta_dir(version)}/{part_name(i)}"
                    local = self._stage(rel, tmps)
                    deltafile.write_delta_part(
                        local, {n: blobs[n] for n in names}, shapes, digests,
                        {n: changed[n] for n in names}, version, base_version, self.run_id, i,
                        len(groups),
                    )  # fmt: skip
                    delta_paths.append((local, rel))
            if anchor is not None:
                names = sorted(anchor)
                groups = deltafile.split_parts(
                    [(n, anchor[n].nbytes) for n in names], self.part_bytes
                )
                for i, group in enumerate(groups):
                    rel = f"{anchor_dir(version)}/{part_name(i)}"
                    local = self._stage(rel, tmps)
                    deltafile.write_anchor_part(
                        local, {n: anchor[n] for n in group}, digests, version, self.run_id, i,
                        len(groups),
                    )  # fmt: skip
                    anchor_paths.append((local, rel))
            refs = self._upload(delta_paths + anchor_paths)
        finally:
            for t in tmps:
                shutil.rmtree(t, ignore_errors=True)
        delta = Payload(files=refs[: len(delta_paths)]) if blobs is not None else None
        anchor_payload = Payload(files=refs[len(delta_paths) :]) if anchor_paths else None
        return delta, anchor_payload

    def _stage(self, rel: str, tmps: list[str]) -> str:
        """Local path to write ``rel`` to: in place on a local store, else in a temp dir
        (appended to ``tmps``, for the caller to remove)."""
        local = self.store.local_path(rel)
        if local is not None:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            return local
        tmp = tempfile.mkdtemp(prefix="deltasync-")
        tmps.append(tmp)
        return os.path.join(tmp, os.path.basename(rel))

    def _upload(self, paths: list[tuple[str, str]]) -> list[FileRef]:
        """(local, rel) pairs -> FileRefs (digests in parallel). Uploads the files that are not
        already in place in ONE ``Store.write_many``, which also carries the pending retention
        deletes (their manifest is committed), so a version's payload costs one batch."""

        def one(lr):
            local, rel = lr
            size = os.path.getsize(local)
            with open(local, "rb") as f:
                h = xxhash.xxh3_64()
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            return FileRef(path=rel, bytes=size, digest=h.hexdigest())

        refs = list(self._pool.map(one, paths))
        remote = [(rel, Path(local)) for local, rel in paths if self.store.local_path(rel) is None]
        deletes = list(self.pending_deletes)
        self.store.write_many(remote, delete=deletes)
        del self.pending_deletes[: len(deletes)]  # kept on failure: orphans for the next writer
        return refs

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
) -> tuple[Manifest, list[VersionEntry]]:
    """Commit ``entry``: the bucket's manifest with it appended and retention applied, written
    in one batch with the lease when due (the manifest last).

    Args:
        mine: the manifest this writer committed last (None before its first).

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
        versions=kept,
        updated_at=time.time(),
    )
    renew = lease.due
    items = [(WRITER_PATH, lease.record())] if renew else []
    store.write_many(items + [(MANIFEST_PATH, manifest.to_json())])
    if renew:
        lease.renewed()
    return manifest, [v for v in versions if v not in kept]
