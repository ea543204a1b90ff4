"""One small storage interface over string URIs, built on fsspec.

Supported URIs: a plain path or ``file:///abs/path`` (the local default), ``memory://name``
(tests), ``hf://buckets/<owner>/<name>[/prefix]`` (Hugging Face Buckets, through huggingface_hub's
``HfFileSystem``; needs the ``hf`` extra and ``HF_TOKEN``), ``s3://bucket/prefix`` (``s3`` extra).
Paths given to methods are relative to the URI's root and always use ``/``.

Transient errors are retried with exponential backoff; missing objects, missing buckets and
refused credentials fail at once. Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

import fsspec

from .errors import StoreAuthError, StoreError, StoreNotFoundError

log = logging.getLogger(__name__)
T = TypeVar("T")


def _http_status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None)


def classify_error(exc: BaseException) -> str:
    """'auth', 'missing' or 'transient' for an exception raised by an fsspec backend."""
    name = type(exc).__name__
    status = _http_status(exc)
    if isinstance(exc, PermissionError) or status in (401, 403) or "Unauthorized" in name:
        return "auth"
    if isinstance(exc, FileNotFoundError) or status == 404 or "NotFound" in name:
        return "missing"
    return "transient"


class Store:
    """A bucket (or folder) addressed by URI.

    Args:
        uri: see the module docstring.
        retries: attempts for transient errors (network, 5xx, 429) before raising StoreError.
        backoff_s: first retry delay in seconds; doubles each attempt.
        create: create a local folder that does not exist yet (readers pass False).
        storage_options: passed to the fsspec filesystem (e.g. ``token=`` for hf://).
    """

    def __init__(
        self,
        uri: str,
        retries: int = 5,
        backoff_s: float = 0.5,
        create: bool = True,
        **storage_options,
    ):
        if not uri:
            raise ValueError("expected a store URI (a folder, file://, memory://, hf://, s3://)")
        uri = resolve_uri(uri)
        self.uri = uri.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        if self.uri.startswith("hf://") and not self.uri.startswith("hf://buckets/"):
            raise ValueError(
                f"expected hf://buckets/<owner>/<name>[/prefix], found {uri!r}: deltasync "
                "stores runs in Hugging Face Buckets, not model or dataset repos"
            )
        try:
            self.fs, root = fsspec.core.url_to_fs(self.uri, **storage_options)
        except ImportError as e:
            raise StoreError(
                f"no filesystem for {self.uri!r}: {e}. Install the extra: "
                "`pip install deltasync[hf]` for hf://, `deltasync[s3]` for s3://"
            ) from e
        self.root = root.rstrip("/")
        self.is_local = "file" in _protocols(self.fs)
        if self.is_local and create:
            os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def _full(self, path: str) -> str:
        return f"{self.root}/{path.lstrip('/')}" if path else self.root

    def local_path(self, path: str) -> str | None:
        """Filesystem path of ``path`` when the store is a local folder, else None."""
        return self._full(path) if self.is_local else None

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
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
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _invalidate(self, path: str) -> None:
        inv = getattr(self.fs, "invalidate_cache", None)
        if inv is not None:
            inv(self._full(path))

    def read_bytes(self, path: str) -> bytes:
        """The object's bytes. Raises StoreNotFoundError if absent."""
        self._invalidate(path)
        return self._call("read", path, lambda: self.fs.cat_file(self._full(path)))

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write an object whole. Local stores write a temp file and rename it, so readers never
        see half an object; object stores replace it in one PUT."""
        if self.is_local:
            self._call("write", path, lambda: _atomic_local_write(self._full(path), data))
        else:
            self._call("write", path, lambda: self.fs.pipe_file(self._full(path), data))

    def put_file(self, local_path: str, path: str) -> None:
        """Upload a local file (streamed from disk, never read whole into memory)."""

        def put():
            if self.is_local:
                dst = self._full(path)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                tmp = f"{dst}.tmp-{os.getpid()}"
                self.fs.put_file(local_path, tmp)
                os.replace(tmp, dst)
            else:
                self.fs.put_file(local_path, self._full(path))

        self._call("upload", path, put)

    def get_file(self, path: str, local_path: str) -> None:
        """Download an object to a local file."""
        self._call("download", path, lambda: self.fs.get_file(self._full(path), local_path))

    def exists(self, path: str) -> bool:
        self._invalidate(path)
        return self._call("exists", path, lambda: self.fs.exists(self._full(path)))

    def ls(self, prefix: str) -> list[str]:
        """Relative paths of the objects under ``prefix`` (recursive); [] if there are none."""
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
        """Delete objects; ones already gone are ignored."""
        for p in paths:
            if self.exists(p):
                self._call("delete", p, lambda p=p: self.fs.rm_file(self._full(p)))


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
