"""One small storage interface over string URIs, built on fsspec and huggingface_hub.

Supported URIs: a plain path or ``file:///abs/path`` (the local default), ``memory://name``
(tests), ``hf://buckets/<owner>/<name>[/prefix]`` (Hugging Face Buckets, through huggingface_hub's
``HfApi``; needs the ``hf`` extra and ``HF_TOKEN``), ``s3://bucket/prefix`` (``s3`` extra).
Paths given to methods are relative to the URI's root and always use ``/``.

Transient errors are retried with exponential backoff; HTTP 429 (any call on hf://, writes
included) waits the ``Retry-After`` the server asks for (seconds, an HTTP date or the
``RateLimit`` reset; at most ``max_retry_after_s``), then retries; missing objects, missing
buckets and refused credentials fail at once (typed: ``StoreNotFoundError`` for an object,
``StoreBucketNotFoundError`` / ``StoreAuthError`` for the bucket or the token); a plain
``StoreError`` from the hf:// layer (after huggingface_hub's and hf_xet's own retries) is not
retried again. Importing this module imports neither torch nor huggingface_hub.

Hub request budget (``hf://``, code in :mod:`deltasync.hub_store`): the Hub counts *API*
requests (listings, metadata, writes) and *resolver* requests (file downloads by ``/resolve/``
URL) separately, per token and 5-minute window. A Store on a bucket reads every file by its
resolver URL (never a listing + a read), sends ``If-None-Match`` for small files it has read
before (an unchanged manifest answers 304, no body), checks the bucket once
(``HfApi.bucket_info``), writes and deletes with ``HfApi.batch_bucket_files`` (one API request
per call, the batch, plus a Xet write token when the kept one is near its expiry, or per call
that adds files on a huggingface_hub the token reuse does not know; :meth:`Store.write_many`
puts several files in one call), and lists (``HfApi.list_bucket_tree``) only when a caller asks for a
listing. Local and ``memory://`` stores are unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import fsspec

from .errors import (
    StoreAccessError,
    StoreAuthError,
    StoreError,
    StoreNotFoundError,
    StoreRateLimitError,
)
from .hub_store import HubBucket, HubThrottled

log = logging.getLogger(__name__)
T = TypeVar("T")


def _http_status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None)


def classify_error(exc: BaseException) -> str:
    """'auth', 'missing' or 'transient' for an exception raised by an fsspec backend (or a
    deltasync store error: access errors are 'auth', a missing object is 'missing')."""
    if isinstance(exc, StoreAccessError):
        return "auth"
    if isinstance(exc, StoreNotFoundError):
        return "missing"
    name = type(exc).__name__
    status = _http_status(exc)
    if isinstance(exc, PermissionError) or status in (401, 403) or "Unauthorized" in name:
        return "auth"
    if isinstance(exc, FileNotFoundError) or status == 404 or "NotFound" in name:
        return "missing"
    return "transient"


# (API, resolver) requests one attempt of a Store operation costs on hf:// (docs/SCALE.md "Hub
# request budget"); elsewhere the same figures stand for "requests", as if the bucket were the Hub
REQUEST_COST: dict[str, tuple[int, int]] = {
    "read": (0, 1),
    "stat": (0, 1),
    "download": (0, 1),
    "list": (1, 0),  # per call (the Hub counts one per page of 1,000 entries)
    # batch_bucket_files: the /batch; on hf:// the HubBucket adds the Xet write token when it
    # fetches one (kept until near its expiry: about one an hour, else one per call that adds files)
    "write": (1, 0),
    "upload": (1, 0),
    "delete": (1, 0),
}


class RequestCount:
    """Requests a :class:`Store` made since it opened, as the Hub counts them (cumulative, every
    attempt, a 429'd one too; ``REQUEST_COST``, plus on hf:// the bucket check, ``bucket_info``,
    one API request at the first call); thread-safe. Not counted: Xet CAS traffic (no Hub
    request) and huggingface_hub's own once-a-day ``/api/agent-harnesses`` fetch."""

    def __init__(self):
        self._lock = threading.Lock()
        self.api = 0
        self.resolver = 0

    def add(self, api: int, resolver: int) -> None:
        with self._lock:
            self.api += api
            self.resolver += resolver

    def snapshot(self) -> tuple[int, int]:
        """(API, resolver) so far."""
        with self._lock:
            return self.api, self.resolver


class Store:
    """A bucket (or folder) addressed by URI.

    Args:
        uri: see the module docstring.
        retries: attempts for transient errors (network, 5xx, 429) before raising StoreError.
        backoff_s: first retry delay in seconds; doubles each attempt.
        create: create a local folder that does not exist yet (readers pass False).
        max_retry_after_s: longest wait (seconds) honoured from a 429's ``Retry-After``.
        sleep: how the Store waits between retries (``time.sleep``; a simulated clock in tests).
        link: a ``deltasync.link.Link`` every request and byte goes through (a simulated
            network on a local store, ``NET``); None: none. With a link, a local store's files are
            not written in place (:meth:`local_path` is None), as on a remote store.
        storage_options: passed to the fsspec filesystem (s3://, ...); on hf:// ``token=`` and
            ``endpoint=`` go to huggingface_hub's ``HfApi``.

    Raises:
        ValueError: an empty URI, or an ``hf://`` URI that is not a bucket.
        StoreError: no filesystem for the URI's scheme (the extra is not installed).
    """

    #: Whether one :meth:`write_many` is all-or-nothing for what reads the manifest: a failed
    #: batch never leaves a later item written without the earlier ones. Then the publisher puts a
    #: version's payload parts and its manifest in ONE batch (one request on a Hub); else two, the
    #: manifest after the payloads have landed (docs/PROTOCOL.md). False everywhere by default:
    #: the Hub's ``/batch`` applies the operations it can and reports the others (huggingface_hub:
    #: "non-transactional", failures listed in a 200), and so does the local Hub (tools/local_hub:
    #: only a bad path refuses the whole batch; an unknown Xet hash fails that one operation).
    #: Local and memory stores write in order and stop at the first failure (an item after a
    #: failed one is never written), which would do, but they save no Hub request by it.
    atomic_batches: bool = False

    def __init__(
        self,
        uri: str,
        retries: int = 5,
        backoff_s: float = 0.5,
        create: bool = True,
        max_retry_after_s: float = 120.0,
        sleep: Callable[[float], None] = time.sleep,
        link=None,
        **storage_options,
    ):
        if not uri:
            raise ValueError("expected a store URI (a folder, file://, memory://, hf://, s3://)")
        uri = resolve_uri(uri)
        self.uri = uri.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.sleep = sleep
        self.link = link
        self.hub: HubBucket | None = None
        self.requests = RequestCount()
        if self.uri.startswith("hf://") and not self.uri.startswith("hf://buckets/"):
            raise ValueError(
                f"expected hf://buckets/<owner>/<name>[/prefix], found {uri!r}: deltasync "
                "stores runs in Hugging Face Buckets, not model or dataset repos"
            )
        try:
            if self.uri.startswith("hf://buckets/"):
                self.hub = HubBucket.from_uri(self.uri, **storage_options)
                self.hub.count = self.requests.add  # the Xet write tokens it fetches
                self.fs, root = None, self.uri[len("hf://") :]
            else:
                self.fs, root = fsspec.core.url_to_fs(self.uri, **storage_options)
        except ImportError as e:
            raise StoreError(
                f"no filesystem for {self.uri!r}: {e}. Install the extra: "
                "`pip install deltasync[hf]` for hf://, `deltasync[s3]` for s3://"
            ) from e
        self.root = root.rstrip("/")
        self.is_local = self.fs is not None and "file" in _protocols(self.fs)
        if self.is_local and create:
            os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def _full(self, path: str) -> str:
        return f"{self.root}/{path.lstrip('/')}" if path else self.root

    def local_path(self, path: str) -> str | None:
        """Filesystem path of ``path`` when the store is a local folder without a link, else
        None."""
        return self._full(path) if self.is_local and self.link is None else None

    def _call(
        self, what: str, path: str, fn: Callable[[], T], cost: tuple[int, int] | None = None
    ) -> T:
        """``fn()`` with the retries; ``cost``: (API, resolver) requests of one attempt as the
        Hub counts them (default by ``what``: :data:`REQUEST_COST`), added to :attr:`requests`
        per attempt, a 429 too."""
        if self.link is not None:
            self.link.request()
        api, resolver = cost or REQUEST_COST.get(what, (1, 0))
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            # hf://: until the bucket check (``bucket_info``, 1 API) succeeds, every call starts
            # with it
            check = 1 if self.hub is not None and not self.hub.checked else 0
            self.requests.add(api + check, resolver)
            try:
                return fn()
            except HubThrottled as e:  # 429: wait what the server asks for, then retry
                wait = min(max(e.retry_after_s or delay, delay), self.max_retry_after_s)
                if attempt == self.retries:
                    raise StoreRateLimitError(
                        f"{what}: {self.uri}/{path} was rate limited (HTTP 429) {attempt} times. "
                        "Expected fewer requests per 5 minutes on this token: slow the replicas "
                        "(POLL_INTERVAL_S) or the dashboard (REFRESH_S), or use separate tokens",
                        retry_after_s=wait,
                    ) from e
                log.warning(
                    "%s %s rate limited (429); waiting %.1fs (retry %d)", what, path, wait, attempt
                )
                self.sleep(wait)
                delay *= 2
            except StoreError:
                # already typed, with the bucket and the fix in the message; on hf:// a plain
                # StoreError comes after huggingface_hub's and hf_xet's own retries (or from an
                # answer that a retry does not change): retrying it here would multiply theirs
                raise
            except Exception as e:  # classified below: re-raised typed, or retried and logged
                kind = classify_error(e)
                where = f"{self.uri}/{path}"
                if kind == "missing":
                    raise StoreNotFoundError(f"{what}: {where} does not exist ({e})") from e
                if kind == "auth":
                    raise StoreAuthError(
                        f"{what}: access to {where} refused ({type(e).__name__}). Check that "
                        "HF_TOKEN (or your cloud credentials) can read and write this bucket"
                    ) from e
                if attempt == self.retries:
                    raise StoreError(
                        f"{what}: {where} failed after {attempt} attempts: {e!r}"
                    ) from e
                log.warning("%s %s failed (%r); retry %d in %.1fs", what, where, e, attempt, delay)
                self.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _invalidate(self, path: str) -> None:
        inv = getattr(self.fs, "invalidate_cache", None)
        if inv is not None:
            inv(self._full(path))

    def read_bytes(self, path: str) -> bytes:
        """The object's bytes.

        Raises:
            StoreNotFoundError: the object does not exist.
            StoreAuthError, StoreBucketNotFoundError: (hf://) the token or the bucket is wrong.
            StoreError: the store kept failing after ``retries`` attempts.
        """
        if self.hub is not None:
            return self._call("read", path, lambda: self.hub.get(path)[0])
        self._invalidate(path)
        data = self._call("read", path, lambda: self.fs.cat_file(self._full(path)))
        if self.link is not None:
            self.link.transfer(len(data))
        return data

    def read_if_changed(self, path: str, tag: str | None) -> tuple[bytes | None, str]:
        """The object's bytes if it changed since ``tag`` was returned, else None.

        Args:
            path: the object.
            tag: the tag a previous call returned for ``path`` (None: read it whatever it holds).

        Returns:
            (bytes or None when unchanged, the object's current tag). On hf:// one conditional
            resolver request (``If-None-Match``); elsewhere a read compared by content digest
            (local reads cost nothing, and a digest cannot miss a same-size rewrite).

        Raises:
            StoreNotFoundError: the object does not exist; other errors as :meth:`read_bytes`.
        """
        if self.hub is not None:
            data, new = self._call("read", path, lambda: self.hub.get(path, if_none_match=tag))
            return (None if data is None or new == tag else data), new
        data = self.read_bytes(path)
        new = hashlib.blake2b(data, digest_size=16).hexdigest()
        return (None if new == tag else data), new

    def stat(self, path: str) -> dict | None:
        """``{"size": bytes or None, "tag": a string that changes when the object is rewritten,
        or None}`` for an object, or None when it does not exist. On hf:// one resolver ``HEAD``
        (``HfApi.get_bucket_file_metadata``; the tag is the file's Xet hash).

        Raises:
            StoreAuthError, StoreBucketNotFoundError, StoreError: as :meth:`read_bytes`.
        """
        if self.hub is not None:
            return self._call("stat", path, lambda: self.hub.head(path))

        def info():
            self._invalidate(path)
            try:
                return self.fs.info(self._full(path))
            except FileNotFoundError:
                return None

        got = self._call("stat", path, info)
        if got is None or got.get("type") == "directory":
            return None
        stamps = [str(got[k]) for k in _CHANGE_FIELDS if got.get(k) is not None]
        return {"size": got.get("size"), "tag": ":".join(stamps) if stamps else None}

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write an object whole. Local stores write a temp file and rename it, so readers never
        see half an object; object stores replace it in one PUT (hf://: one
        ``batch_bucket_files`` call, one API request: prefer :meth:`write_many` for several).

        Raises:
            StoreAuthError, StoreBucketNotFoundError, StoreError: the write failed.
        """
        if self.link is not None:
            self.link.transfer(len(data))
        if self.hub is not None:
            self._call("write", path, lambda: self.hub.put([(path, data)]))
        elif self.is_local:
            self._call("write", path, lambda: _atomic_local_write(self._full(path), data))
        else:
            self._call("write", path, lambda: self.fs.pipe_file(self._full(path), data))

    def write_many(
        self, items: list[tuple[str, bytes | Path]], delete: list[str] | None = None
    ) -> None:
        """Write several objects: ``(path, bytes or a local file as a pathlib.Path)``, and delete
        the objects in ``delete`` (ones already gone are ignored). On hf:// one
        ``batch_bucket_files`` call for all of it (one API request, plus the Xet write token
        when one is fetched; plus a resolver ``HEAD`` per path to delete); elsewhere the writes one by
        one, then the deletes. Not transactional: after an error some may be done, so a
        reader-visible file that names the others (``manifest.json``) belongs in a later call,
        and a delete belongs in a call after the one that stops naming the file.

        Raises:
            StoreAuthError, StoreBucketNotFoundError, StoreError: a write or delete failed.
        """
        delete = list(delete or [])
        if not items and not delete:
            return
        if self.hub is not None:
            present = [p for p in delete if self.exists(p)]
            if not items and not present:
                return
            first = items[0][0] if items else present[0]
            self._call("write", first, lambda: self.hub.put(items, delete=present))
            return
        for path, src in items:
            if isinstance(src, bytes):
                self.write_bytes(path, src)
            else:
                self.put_file(str(src), path)
        if delete:
            self.rm(delete)

    def put_file(self, local_path: str, path: str) -> None:
        """Upload a local file (streamed from disk, never read whole into memory).

        Raises:
            StoreAuthError, StoreBucketNotFoundError, StoreError: the upload failed.
        """

        def put():
            if self.hub is not None:
                self.hub.put([(path, Path(local_path))])
            elif self.is_local:
                dst = self._full(path)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                tmp = f"{dst}.tmp-{os.getpid()}"
                self.fs.put_file(local_path, tmp)
                os.replace(tmp, dst)
            else:
                self.fs.put_file(local_path, self._full(path))

        if self.link is not None:
            self.link.transfer(os.path.getsize(local_path))
        self._call("upload", path, put)

    def get_file(self, path: str, local_path: str) -> None:
        """Download an object to a local file.

        Raises:
            StoreNotFoundError: the object does not exist; other errors as :meth:`read_bytes`.
        """
        if self.hub is not None:
            self._call("download", path, lambda: self.hub.download(path, local_path))
            return
        self._call("download", path, lambda: self.fs.get_file(self._full(path), local_path))
        if self.link is not None:
            self.link.transfer(os.path.getsize(local_path))

    def exists(self, path: str) -> bool:
        """Whether the object exists (hf://: one resolver ``HEAD``).

        Raises:
            StoreAuthError, StoreBucketNotFoundError, StoreError: the store cannot answer.
        """
        if self.hub is not None:
            return self.stat(path) is not None
        self._invalidate(path)
        return self._call("exists", path, lambda: self.fs.exists(self._full(path)))

    def ls(self, prefix: str) -> list[str]:
        """Relative paths of the objects under ``prefix`` (recursive); [] if there are none.
        On hf:// one API call per page of 1,000 entries: call it sparingly.

        Raises:
            StoreAuthError, StoreBucketNotFoundError, StoreError: the store cannot answer.
        """
        if self.hub is not None:
            return self._call("list", prefix, lambda: self.hub.list(prefix))
        base = self._full(prefix)
        self._invalidate(prefix)

        def find():
            try:
                found = self.fs.find(base)
            except FileNotFoundError:
                return []
            return [p[len(self.root) + 1 :] for p in found]

        return self._call("list", prefix, find)

    def rm(self, paths: list[str]) -> None:
        """Delete objects; ones already gone are ignored (hf://: a resolver HEAD per path, then
        one ``batch_bucket_files`` call, one API request).

        Raises:
            StoreAuthError, StoreBucketNotFoundError, StoreError: the delete failed.
        """
        if self.hub is not None:
            present = [p for p in paths if self.exists(p)]
            if present:
                self._call("delete", present[0], lambda: self.hub.delete(present))
            return
        for p in paths:
            if self.exists(p):
                self._call("delete", p, lambda p=p: self.fs.rm_file(self._full(p)))


# Fields of an fsspec ``info`` dict that change when an object is rewritten (any backend).
_CHANGE_FIELDS = (
    "mtime",
    "created",
    "LastModified",
    "last_modified",
    "ETag",
    "etag",
    "md5",
    "blob_id",
    "xet_hash",
    "sha",
    "last_commit",
)


_BUCKET_SHORTHAND = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w./-]*)?$")


def resolve_uri(uri: str) -> str:
    """Expand the shorthands users type: ``owner/name[/prefix]`` that is not an existing local
    path means ``hf://buckets/owner/name[/prefix]`` (as in ``make train BUCKET=user/run``); any
    other path without a scheme is a local folder (``file://`` + its absolute path)."""
    if "://" in uri:
        return uri
    if _BUCKET_SHORTHAND.match(uri) and not os.path.exists(uri.split("/")[0]):
        return f"hf://buckets/{uri}"
    return "file://" + os.path.abspath(uri)


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _atomic_local_write(dst: str, data: bytes) -> None:
    d = os.path.dirname(dst)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(dst))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise


def open_store(store: Store | str) -> Store:
    """A Store for a URI string, or the Store itself."""
    return store if isinstance(store, Store) else Store(store)
