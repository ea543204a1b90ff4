"""What the publisher writes to the bucket: a version's anchor and delta parts, written and
uploaded in ONE ``Store.write_many`` batch (which also carries the retention deletes already
due), then ``manifest.json`` last, the commit point (with the writer lease when it is due); on a
store whose batches are all-or-nothing (``Store.atomic_batches``) all of it in one batch. Every
payload file name carries the writer's id, so no writer ever overwrites a file another committed.
Also the start of a writer under its lease: the manifest read it resumes from, and the removal of
orphans a writer left when it died before its manifest commit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from . import deltafile
from .bf16 import bytes_digest
from .deltafile import PartLabel
from .errors import ConcurrentWriterError, ManifestError, SignatureError, StoreNotFoundError
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
from .signing import RunKey, sign_manifest, verify_manifest
from .store import Store

log = logging.getLogger("deltasync.publisher")


class PayloadWriter:
    """Writes one run's payload parts (see docs/PROTOCOL.md for the layout).

    Args:
        store: the run's store.
        run_id: recorded in every part's metadata.
        writer: the writer's id, in every payload file name (``manifest.part_name``): a writer
            never overwrites a file another writer wrote, committed or not.
        part_bytes: size cap of one part file in bytes (larger payloads are split).
        threads: anchor part files hashed in parallel.
        sha256: also hash each file's bytes with SHA-256 (``FileRef.sha256``), for a signed
            run (``deltasync.signing``); about 0.6 s per GB on one core (bench/bench_signing.py).

    Raises:
        ValueError: ``writer`` is not 4 to 32 of ``[0-9a-z]``.

    Attributes:
        pending_deletes: payload paths dropped by a committed manifest, deleted with the next
            batch (or on close, by the caller); after a crash they are orphans that the next
            writer removes.
    """

    def __init__(
        self,
        store: Store,
        run_id: str,
        writer: str,
        part_bytes: int,
        threads: int = 2,
        sha256: bool = False,
    ):
        self.store, self.run_id, self.part_bytes = store, run_id, part_bytes
        self.sha256 = sha256
        self.writer = writer
        part_name(0, writer)  # a writer id that cannot name a file fails here, not mid-upload
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
        commit: Callable[[Payload | None, Payload | None, list, list[str]], None] | None = None,
    ) -> tuple[Payload | None, Payload | None]:
        """Write and upload a version's delta parts (codec ``blobs`` per tensor, None for an
        anchor-only version) and anchor parts (full bf16 bits per tensor, or None).

        ``commit``: None: the parts and the pending deletes go in one ``write_many`` here. Else
        (a store whose batches are all-or-nothing, ``Store.atomic_batches``) they are not
        uploaded here: ``commit(delta, anchor, items, deletes)`` is called instead, before the
        temporary files go, to put them in the manifest's batch.

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
                    rel = f"{delta_dir(version)}/{part_name(i, self.writer)}"
                    delta.files.append(self._put(rel, data, items))
            if anchor is not None:
                names = sorted(anchor)
                groups = deltafile.split_parts(
                    [(n, anchor[n].nbytes) for n in names], self.part_bytes
                )
                files = []
                for i, group in enumerate(groups):
                    rel = f"{anchor_dir(version)}/{part_name(i, self.writer)}"
                    local = self._anchor_path(rel, items, tmp)
                    deltafile.write_anchor_part(
                        local,
                        PartLabel(version, None, self.run_id, i, len(groups)),
                        {n: anchor[n] for n in group},
                        digests,
                    )
                    files.append((local, rel))
                refs = self._pool.map(lambda f: _file_ref(f, self.sha256), files)
                anchor_payload = Payload(files=list(refs))
            deletes = list(self.pending_deletes)
            if commit is None:
                self.store.write_many(items, delete=deletes)
            else:
                commit(delta, anchor_payload, items, deletes)
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
        sha = hashlib.sha256(data).hexdigest() if self.sha256 else None
        return FileRef(path=rel, bytes=len(data), digest=bytes_digest(data), sha256=sha)

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


def payload_files(store: Store) -> list[str]:
    """Every payload file under the run's ``anchors/`` and ``deltas/`` (one listing), sorted;
    temporary files of an interrupted local write included, as they are orphans too."""
    return sorted(p for p in store.ls("") if p.startswith(("anchors/", "deltas/")))


def read_manifest_at_start(
    store: Store, lease: LeaseKeeper, new_run: bool
) -> tuple[Manifest | None, list[str]]:
    """The manifest a writer resumes from, read under its lease, and the run's payload files
    (listed after the read).

    A manifest that is not found means a new run only where no payload file is there either:
    otherwise the read may have been a spurious not-found (a stale read) of a live run, or the
    manifest was lost, and starting over would drop every committed version. Such a read is tried
    once more; if it is still not found, the writer refuses to start unless ``new_run``.

    Args:
        lease: this writer's lease, taken (:meth:`LeaseKeeper.acquire`); checked first.
        new_run: start a new run even where payload files but no manifest are found (they are
            then orphans, deleted by :func:`remove_orphans`).

    Returns:
        (the manifest, or None for a new run; the payload files found).

    Raises:
        ManifestError: the manifest is not a valid manifest, or it is not found while payload
            files are there (and not ``new_run``); nothing was deleted.
        ConcurrentWriterError: the lease is not this writer's.
    """
    lease.check()
    manifest = read_manifest(store)
    found = payload_files(store)
    if manifest is not None or not found:
        return manifest, found
    manifest = read_manifest(store)
    if manifest is not None:
        log.warning(
            "%s/%s was not found on the first read but is there on the second: resuming run %r",
            store.uri,
            MANIFEST_PATH,
            manifest.run_id,
        )
        return manifest, payload_files(store)
    if new_run:
        log.warning(
            "%s: no %s but %d payload files; starting a new run as asked (new_run): they "
            "will be deleted",
            store.uri,
            MANIFEST_PATH,
            len(found),
        )
        return None, found
    raise ManifestError(
        f"{store.uri}: expected {MANIFEST_PATH} to resume a run, or an empty prefix for a new "
        f"one; found no {MANIFEST_PATH} (two reads) but {len(found)} payload files "
        f"(e.g. {found[:3]}): a run is there whose manifest did not read, or a trainer that "
        "died before its first commit. Nothing was deleted. If the store answered not-found by "
        "mistake, start again; to start a new run on this prefix and delete those files, pass "
        "new_run=True (PublisherConfig; the trainer's --new-run true); or use another prefix"
    )


def remove_orphans(
    store: Store, lease: LeaseKeeper, manifest: Manifest | None, found: list[str]
) -> list[str]:
    """Delete the payload files in ``found`` that ``manifest`` does not name (left by a writer
    that died before its manifest commit, or lost its lease), after checking that the lease is
    still this writer's.

    Args:
        manifest: the manifest read under the lease (:func:`read_manifest_at_start`), or None
            for a new run.
        found: the payload files listed after that read.

    Returns:
        The paths deleted.

    Raises:
        ConcurrentWriterError: the lease is not this writer's; nothing was deleted.
    """
    named = set()
    for v in manifest.versions if manifest else []:
        for payload in (v.delta, v.anchor):
            if payload is not None:
                named.update(f.path for f in payload.files)
    orphans = [p for p in found if p not in named]
    if orphans:
        lease.check()
        log.info("removing %d orphaned payload files, e.g. %s", len(orphans), orphans[:3])
        store.rm(orphans)
    return orphans


def _older_than(current: Manifest | None, mine: Manifest | None) -> bool:
    """Whether the manifest just read is older than the one this writer holds (its newest
    version is below the held one's): a stale read, never a concurrent writer, whose own
    commits only add versions."""
    if current is None or mine is None or mine.latest is None:
        return False
    return current.latest is None or current.latest.version < mine.latest.version


def commit_manifest(
    store: Store,
    lease: LeaseKeeper,
    entry: VersionEntry,
    mine: Manifest | None,
    model: ModelFingerprint,
    keep_anchors: int,
    adapter: AdapterInfo | None = None,
    signer: RunKey | None = None,
    items: list | None = None,
    delete: list[str] | None = None,
) -> tuple[Manifest, list[VersionEntry]]:
    """Commit ``entry``: the bucket's manifest with it appended and retention applied, written
    in one batch with the lease when due (the manifest last).

    ``items``, ``delete``: the version's payload files and the deletes already due, put in the
    same batch before the lease and the manifest: only on a store whose batches are
    all-or-nothing (``Store.atomic_batches``), where a manifest cannot land without them.

    Args:
        mine: the manifest this writer committed last, or the one it resumed from (None for a
            new run before its first commit).
        adapter: the run's adapter, recorded in the manifest (None: a full-weight run).
        signer: the run key that signs the manifest (``deltasync.signing``); None: unsigned.
            A manifest read that does not verify with it (changed in the bucket since this
            writer signed it) is not signed again: the commit goes on ``mine``.

    Returns:
        (the committed manifest, the versions retention dropped: their files can go now).

    Raises:
        ConcurrentWriterError: the lease is not this writer's any more, or another writer
            changed the manifest since ``mine``; nothing was written. A manifest read that is
            older than ``mine`` (a stale read) or not found is not one: the commit goes on
            ``mine``, so no committed version is dropped.
        The store's errors.
    """
    lease.check()
    current = read_manifest(store)
    if _older_than(current, mine):  # a stale read (a cache, a replay): never commit less history
        log.warning(
            "%s/%s read as v%s before the commit of v%d, older than the v%s this writer "
            "committed; committing on the manifest it holds",
            store.uri,
            MANIFEST_PATH,
            current.latest.version if current.latest else None,
            entry.version,
            mine.latest.version,
        )
        current = mine
    if current is not None and current.writer_id != lease.writer_id:
        if mine is None or current.updated_at != mine.updated_at:
            expected = (
                "no manifest (a new run)"
                if mine is None
                else f"the one of writer {mine.writer_id!r} at {mine.updated_at:.3f}"
            )
            raise ConcurrentWriterError(
                f"{store.uri}: expected {expected}, found a manifest committed by writer "
                f"{current.writer_id!r} at {current.updated_at:.3f} while this trainer "
                f"({lease.writer_id}) was publishing v{entry.version}; it commits nothing. "
                "Stop one of the two trainers"
            )
    if signer is not None and current is not None and mine is not None and current is not mine:
        try:  # sign only the history this key signed: never launder a manifest changed meanwhile
            verify_manifest(current, signer.public_key, f"{store.uri}/{MANIFEST_PATH}")
        except SignatureError as e:
            log.warning(
                "%s/%s does not verify with this run's key before the commit of v%d (%s); "
                "committing on the manifest this writer signed",
                store.uri,
                MANIFEST_PATH,
                entry.version,
                type(e).__name__,
            )
            current = mine
    if current is None and mine is not None:  # a spurious not-found: never commit less history
        log.warning(
            "%s/%s read as not found before the commit of v%d; committing on the manifest "
            "this writer holds (%d versions)",
            store.uri,
            MANIFEST_PATH,
            entry.version,
            len(mine.versions),
        )
        current = mine
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
    if signer is not None:
        manifest = sign_manifest(manifest, signer)
    renew = lease.due
    lease_items = [(WRITER_PATH, lease.record())] if renew else []
    payload = list(items or [])
    if (payload or delete) and not store.atomic_batches:
        raise ValueError(f"{store.uri}: its batches are not all-or-nothing: upload payloads first")
    store.write_many(payload + lease_items + [(MANIFEST_PATH, manifest.to_json())], delete=delete)
    if renew:
        lease.renewed()
    return manifest, [v for v in versions if v not in kept]


def _file_ref(local_rel: tuple[str, str], sha256: bool = False) -> FileRef:
    """The FileRef of a written file: its size and xxh3-64 (and SHA-256 with ``sha256``), read
    back from the page cache (for an anchor part that is faster than serializing it in memory
    first; docs/BENCHMARKS.md). The bytes hashed are the bytes the batch uploads."""
    local, rel = local_rel
    h = xxhash.xxh3_64()
    sha = hashlib.sha256() if sha256 else None
    with open(local, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
            if sha is not None:
                sha.update(chunk)
    return FileRef(
        path=rel,
        bytes=os.path.getsize(local),
        digest=h.hexdigest(),
        sha256=sha.hexdigest() if sha is not None else None,
    )
