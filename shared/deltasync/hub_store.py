"""Hugging Face bucket access for :class:`deltasync.store.Store` (``hf://buckets/...``).

Everything that changes the bucket or asks the Hub's API goes through huggingface_hub's public
``HfApi``: the bucket check is ``bucket_info``, listings ``list_bucket_tree``, writes and deletes
``batch_bucket_files`` (which uploads the contents to Xet storage itself), ``stat``
``get_bucket_file_metadata``. Only reads are plain HTTP, through huggingface_hub's shared client
(``get_session()``, ``build_hf_headers``): ``GET {endpoint}/buckets/<id>/resolve/<path>`` with
``If-None-Match``, so that an unchanged manifest costs one resolver request and no body, where
``download_bucket_files`` would cost an API request (``paths-info``) per call.

How the Hub counts them (per token, per 5-minute window): the resolver GET/HEAD is a resolver
request; ``bucket_info``, ``list_bucket_tree`` (per page of 1,000), ``batch_bucket_files`` (one
``/batch`` POST) and the Xet write token (``/api/buckets/<id>/xet-write-token``, fetched by the
HubBucket and kept until near its expiry: see :data:`_TOKEN_REUSE_VERSIONS`) are API requests.

429: every 429 becomes :class:`HubThrottled` with the server's ``Retry-After`` (seconds or an
HTTP date) or ``RateLimit`` reset, and ``Store`` waits it (bounded by its
``max_retry_after_s``) and retries; only a 429 that outlasts the Store's retries is raised, as
:class:`StoreRateLimitError`. The functions built on huggingface_hub's ``http_backoff``
(``batch_bucket_files``, ``list_bucket_tree``, ``get_bucket_file_metadata``) have already waited
and retried by themselves by then.

hf_xet's own retries (inside ``batch_bucket_files``' upload: 5 attempts from a 3 s delay, for up
to 6 minutes by default) are bounded to :data:`XET_RETRY_MAX_DURATION` through
``HF_XET_CLIENT_RETRY_MAX_DURATION``, set by each ``HubBucket`` unless the environment sets it.
hf_xet reads it when huggingface_hub creates the process's Xet session (its first upload or
download): a session made before keeps its setting. A 503 on the Xet token route for 25 s held
one ``Store.write_bytes`` for 47.3 s and 64.6 s (two runs) with hf_xet's default, 29.7 s with
this bound (local Hub, tools/local_hub). A write that still fails after hf_xet's or
``http_backoff``'s retries comes out as a plain :class:`StoreError`, which ``Store`` does not
retry again: the caller (the publisher) retries it. Importing this module does not import
huggingface_hub.
"""

from __future__ import annotations

import email.utils
import hashlib
import os
import re
import threading
import time
from pathlib import Path
from urllib.parse import quote

from .errors import (
    StoreAuthError,
    StoreBucketNotFoundError,
    StoreError,
    StoreNotFoundError,
)

_NET_MODULES = ("httpx", "httpx2", "httpcore")

# Objects up to this size are kept with their ETag for conditional re-reads (manifest,
# heartbeats, metrics); payload parts are bigger and are read once.
_CONDITIONAL_MAX_BYTES = 4 << 20

# hf_xet's retry budget for one operation (its ``HF_XET_CLIENT_RETRY_MAX_DURATION``, a duration
# string), unless the environment sets one: a write fails within about this long when the Hub
# is down, and Store and the publisher retry it, instead of hf_xet holding it for 6 minutes.
XET_RETRY_MAX_DURATION = "30s"
XET_RETRY_ENV = "HF_XET_CLIENT_RETRY_MAX_DURATION"

# Xet write-token reuse. ``batch_bucket_files`` has no parameter for a token: each call that
# adds files lets hf_xet fetch a new one (``GET /api/buckets/<id>/xet-write-token``, one API
# request) although a token lives an hour on the Hub. hf_xet's public ``new_upload_commit`` takes
# a token to start with (``endpoint``, ``token``, ``token_expiry_unix_secs``, then no fetch), so
# a HubBucket fetches one itself, keeps it until :data:`XET_TOKEN_MARGIN_S` before it expires,
# uploads with it, and hands ``batch_bucket_files`` the uploaded files by Xet hash: the only
# /batch request then. That last step uses huggingface_hub's private ``_buckets._BucketAddFile``
# (the object its own upload fills in) and ``utils._xet`` helpers: only on the versions listed
# here (checked at the first write); on any other, every batch fetches its own token as before.
_TOKEN_REUSE_VERSIONS = ("2.4.",)
XET_TOKEN_MARGIN_S = 300  # a kept write token is fetched again this long before it expires


def bound_xet_retries() -> None:
    """Set hf_xet's retry budget (:data:`XET_RETRY_MAX_DURATION`) unless the user set one; only
    an Xet session created afterwards reads it."""
    os.environ.setdefault(XET_RETRY_ENV, XET_RETRY_MAX_DURATION)


class HubThrottled(Exception):
    """HTTP 429 from the Hub; ``retry_after_s``: the server's ``Retry-After`` (or the rate-limit
    reset), seconds, when it sent one. Handled by ``Store._call`` (wait, then retry)."""

    def __init__(self, message: str, retry_after_s: float | None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class HubTransient(Exception):
    """A Hub answer worth retrying (5xx, 408, a network error)."""


class HubBucket:
    """One Hugging Face bucket (and a folder in it), through huggingface_hub.

    Args:
        bucket_id: ``owner/name``.
        prefix: the run's folder inside the bucket ("" for the root).
        token: a Hugging Face token, or None for the environment's (``HF_TOKEN``, saved login).
        endpoint: the Hub URL (default ``huggingface_hub.constants.ENDPOINT``).

    Raises:
        ImportError: huggingface_hub is not installed (the ``hf`` extra).
    """

    def __init__(self, bucket_id: str, prefix: str = "", token=None, endpoint: str | None = None):
        from huggingface_hub import HfApi, constants  # lazy: importing deltasync stays light
        from huggingface_hub.utils import disable_progress_bars

        # One dense line per publish is ours to print: huggingface_hub's bars and hf_xet's upload
        # progress (reported through huggingface_hub's reporter) would print per batch.
        disable_progress_bars()
        bound_xet_retries()  # before the process's Xet session exists (its first upload)
        self.bucket_id = bucket_id
        self.prefix = prefix.strip("/")
        self.token = token
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.api = HfApi(endpoint=self.endpoint, token=token)
        self._checked = False
        self._lock = threading.Lock()
        # (API, resolver) requests the Hub counts that this bucket makes on its own (a Xet
        # write token); Store sets it to its request counter
        self.count = lambda api, resolver: None
        self._reuse: bool | None = None  # whether Xet write tokens are reused (first write)
        self._xet: tuple[str, int, str] | None = None  # kept write token, its expiry, CAS URL
        self._etags: dict[str, tuple[str, bytes]] = {}  # path -> (etag, body) of small files

    @classmethod
    def from_uri(cls, uri: str, token=None, endpoint: str | None = None, **_ignored) -> HubBucket:
        """The bucket of ``hf://buckets/<owner>/<name>[/prefix]``.

        Raises:
            ValueError: the URI does not name a bucket (owner and name).
        """
        rest = uri[len("hf://buckets/") :].strip("/").split("/")
        if len(rest) < 2 or not all(rest[:2]):
            raise ValueError(f"expected hf://buckets/<owner>/<name>[/prefix], found {uri!r}")
        return cls("/".join(rest[:2]), "/".join(rest[2:]), token, endpoint)

    def _key(self, path: str) -> str:
        return f"{self.prefix}/{path.lstrip('/')}" if self.prefix else path.lstrip("/")

    def _rel(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def resolve_url(self, path: str) -> str:
        """The resolver URL of ``path`` (as ``HfFileSystem.url`` builds it for a bucket file)."""
        return f"{self.endpoint}/buckets/{self.bucket_id}/resolve/{quote(self._key(path))}"

    # ------------------------------------------------------------------------- errors
    def _fail(self, resp, what: str, path: str, write: bool = False):
        """Raise the typed error for an unsuccessful answer."""
        code = resp.status_code
        where = f"hf://buckets/{self.bucket_id}/{self._key(path)}".rstrip("/")
        need = "write" if write else "read"
        if code == 429:
            raise HubThrottled(f"{what} {where}: HTTP 429", _retry_after(resp.headers))
        if code == 401:
            found = "no token" if not self._has_token() else "a token the Hub rejected"
            raise StoreAuthError(
                f"{what} {where}: the Hub refused the request (HTTP 401). Expected a valid token "
                f"with {need} access to bucket {self.bucket_id}; found {found}. Fix: set HF_TOKEN "
                "(a Space secret on a Space) to a current token from "
                "https://huggingface.co/settings/tokens",
                summary="bucket unreadable: token missing or invalid",
            )
        if code == 403:
            raise StoreAuthError(
                f"{what} {where}: the token lacks permission (HTTP 403). Expected a token allowed "
                f"to {need} bucket {self.bucket_id}; fix the token's scope (a fine-grained token "
                f"needs {need} access to this bucket or its namespace) or use another HF_TOKEN",
                summary="bucket not writable: token lacks write access"
                if write
                else "bucket unreadable: token lacks access",
            )
        if code == 404:
            err = resp.headers.get("x-error-code", "")
            if err in ("RepoNotFound", "BucketNotFound") or (not path and what == "check"):
                raise StoreBucketNotFoundError(
                    f"{what} {where}: bucket {self.bucket_id} does not exist or this token cannot "
                    f"see it (HTTP 404). Expected an existing bucket: check the bucket name "
                    f"(BUCKET=hf://buckets/<owner>/<name>), create it (`hf buckets create "
                    f"{self.bucket_id}`), or, if it is private, use a token of its owner"
                )
            raise StoreNotFoundError(f"{what}: {where} does not exist")
        if code >= 500 or code == 408:
            raise HubTransient(f"{what} {where}: HTTP {code}")
        raise StoreError(f"{what} {where}: unexpected HTTP {code} from the Hub")

    def _has_token(self) -> bool:
        from huggingface_hub.utils import build_hf_headers

        return any(k.lower() == "authorization" for k in build_hf_headers(token=self.token))

    def _lib(self, what: str, path: str, fn, write: bool = False, retried: bool = True):
        """Call a huggingface_hub function; its errors come out typed. ``retried``: the function
        already retries 429, 5xx and network errors itself (``http_backoff``): not again here."""
        from huggingface_hub.errors import BucketBatchError, HfHubHTTPError

        where = f"hf://buckets/{self.bucket_id}/{self._key(path)}".rstrip("/")
        try:
            return fn()
        except BucketBatchError as e:
            raise StoreError(
                f"{what} {where}: the Hub refused {len(e.failures)} operation(s): "
                f"{str(e.failures)[:300]}"
            ) from e
        except HfHubHTTPError as e:
            resp = e.response
            if resp is None:
                raise HubTransient(f"{what} {where}: {e}") from e
            code = resp.status_code
            if code == 429:  # Store waits the Retry-After, then retries (after http_backoff's)
                raise HubThrottled(f"{what} {where}: HTTP 429", _retry_after(resp.headers)) from e
            if retried and (code >= 500 or code == 408):
                raise StoreError(
                    f"{what} {where}: HTTP {code} after huggingface_hub's retries"
                ) from e
            self._fail(resp, what, path, write)
        except Exception as e:
            # hf_xet (Rust) fetches its own Xet token and talks to the CAS: a refused token
            # comes back as a ConnectionError naming the HTTP status, not as an HTTP error.
            refused = re.search(r"HTTP status client error \((40[13]|429)", str(e))
            if refused:
                self._fail(_Status(int(refused.group(1))), what, path, write)
            if type(e).__module__.split(".")[0] in _NET_MODULES:
                if retried:
                    raise StoreError(
                        f"{what} {where}: {e!r} after huggingface_hub's retries"
                    ) from e
                raise HubTransient(f"{what} {where}: {type(e).__name__}: {e}") from e
            if retried and write and isinstance(e, (ConnectionError, TimeoutError)):
                # hf_xet's upload (a builtin error naming the status), after its own retries
                budget = os.environ.get(XET_RETRY_ENV, "6m")
                raise StoreError(
                    f"{what} {where}: {e} (after hf_xet's retries, {XET_RETRY_ENV}={budget})"
                ) from e
            raise

    @property
    def checked(self) -> bool:
        """Whether :meth:`check` succeeded (until then every call starts with it: one more API
        request, which ``Store.requests`` counts)."""
        return self._checked

    def check(self) -> None:
        """Check once per HubBucket that the bucket exists and the token may see it
        (``HfApi.bucket_info``, one API request); a later resolver 404 then means a missing file.

        Raises:
            StoreAuthError, StoreBucketNotFoundError: the token or the bucket is wrong.
        """
        if self._checked:
            return
        self._lib("check", "", lambda: self.api.bucket_info(self.bucket_id), retried=False)
        self._checked = True

    # -------------------------------------------------------------------------- reads
    def _send(self, method: str, url: str, **kw):
        from huggingface_hub.utils import get_session

        try:
            return get_session().request(method, url, **kw)
        except Exception as e:  # network errors: retried by Store._call
            if type(e).__module__.split(".")[0] in _NET_MODULES:
                raise HubTransient(f"{method} {url}: {type(e).__name__}: {e}") from e
            raise

    def get(self, path: str, if_none_match: str | None = None) -> tuple[bytes | None, str]:
        """(bytes, tag) of ``path``; (None, tag) when ``if_none_match`` still matches. Sends
        the tag of the last read of ``path`` when it kept one: an unchanged file returns those
        bytes.

        The tag is the Hub's own (``X-Linked-Etag``, else ``ETag``, else ``X-Xet-Hash`` of the
        resolver's answer), never the file bridge's. The resolver is asked without following its
        redirect: a 304, or a 302 whose tag equals the one sent, means unchanged, so an unchanged
        poll costs one resolver request whatever the bridge does with ``If-None-Match``; only a
        changed file follows the redirect (to another origin: without ``Authorization``)."""
        from huggingface_hub.utils import build_hf_headers

        self.check()
        headers = build_hf_headers(token=self.token)
        kept = self._etags.get(path)
        etag = if_none_match or (kept[0] if kept else None)
        if etag:
            headers["If-None-Match"] = etag
        url = self.resolve_url(path)
        resp = self._send("GET", url, headers=headers, follow_redirects=False)
        tag = _etag(resp)
        if resp.status_code == 304 or (resp.is_redirect and etag is not None and tag == etag):
            if if_none_match:
                return None, if_none_match
            if kept is not None:
                return kept[1], kept[0]
            raise HubTransient(f"read {path}: 304 without a cached copy")
        if resp.is_redirect:
            resp = self._follow(url, resp, headers)
        if resp.status_code != 200:
            self._fail(resp, "read", path)
        data = resp.content
        tag = tag or hashlib.blake2b(data, digest_size=16).hexdigest()
        if len(data) <= _CONDITIONAL_MAX_BYTES and _etag(resp) is not None:
            with self._lock:
                self._etags[path] = (tag, data)
        return data, tag

    def _follow(self, url: str, resp, headers: dict):
        """The answer at a redirect's ``Location`` (further redirects followed). Leaving the
        Hub's origin drops ``Authorization`` (a bridge URL is signed); ``If-None-Match`` is not
        sent: its tag is the Hub's, which the bridge may not know."""
        from urllib.parse import urljoin, urlsplit

        target = urljoin(url, resp.headers["location"])
        keep = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
        if urlsplit(target)[:2] != urlsplit(url)[:2]:
            keep = {k: v for k, v in keep.items() if k.lower() != "authorization"}
        return self._send("GET", target, headers=keep, follow_redirects=True)

    def head(self, path: str) -> dict | None:
        """``{"size", "tag"}`` of ``path`` (``HfApi.get_bucket_file_metadata``: one resolver
        HEAD; the tag is the file's Xet hash), or None when it is missing."""
        self.check()
        try:
            meta = self._lib(
                "stat",
                path,
                lambda: self.api.get_bucket_file_metadata(self.bucket_id, self._key(path)),
            )
        except StoreNotFoundError:
            return None
        except ValueError:  # answered, but without Xet metadata or size: it exists
            return {"size": None, "tag": None}
        return {"size": meta.size, "tag": meta.xet_file_data.file_hash}

    def download(self, path: str, local_path: str) -> None:
        """Stream ``path`` into ``local_path`` (one resolver request)."""
        from huggingface_hub.utils import build_hf_headers, get_session

        self.check()
        try:
            with get_session().stream(
                "GET", self.resolve_url(path), headers=build_hf_headers(token=self.token)
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self._fail(resp, "download", path)
                with open(local_path, "wb") as f:
                    for chunk in resp.iter_bytes(1 << 20):
                        f.write(chunk)
        except (HubThrottled, HubTransient, StoreError):
            raise
        except Exception as e:
            if type(e).__module__.split(".")[0] in _NET_MODULES:
                raise HubTransient(f"download {path}: {e}") from e
            raise

    def list(self, prefix: str) -> list[str]:
        """Relative paths of the files under ``prefix`` (``HfApi.list_bucket_tree``, recursive:
        one API request per page of 1,000 entries)."""
        self.check()
        key = self._key(prefix).strip("/")

        def walk():
            tree = self.api.list_bucket_tree(self.bucket_id, prefix=key or None, recursive=True)
            return [e.path for e in tree if e.type == "file"]

        try:
            found = self._lib("list", prefix, walk)
        except StoreNotFoundError:  # a folder that does not exist
            return []
        return sorted(self._rel(p) for p in found if not key or p.startswith(key + "/"))

    # ------------------------------------------------------------------------- writes
    @property
    def reuses_write_tokens(self) -> bool:
        """Whether uploads reuse a kept Xet write token (this huggingface_hub version is one
        :data:`_TOKEN_REUSE_VERSIONS` names and its internals are there)."""
        if self._reuse is None:
            self._reuse = _token_reuse_supported()
        return self._reuse

    def _write_token(self, path: str) -> tuple[str, int, str]:
        """(token, expiry unix s, CAS URL): the kept Xet write token, or a new one (one API
        request, counted) when none is kept or it expires within :data:`XET_TOKEN_MARGIN_S`."""
        from huggingface_hub.utils import build_hf_headers

        with self._lock:
            kept = self._xet
        if kept is not None and kept[1] > time.time() + XET_TOKEN_MARGIN_S:
            return kept
        url = f"{self.endpoint}/api/buckets/{self.bucket_id}/xet-write-token"
        self.count(1, 0)
        resp = self._send("GET", url, headers=build_hf_headers(token=self.token))
        if resp.status_code != 200:
            self._fail(resp, "write", path, write=True)
        h = resp.headers
        try:  # the Hub's headers (what huggingface_hub reads), else the JSON hf_xet reads
            got = (h["x-xet-access-token"], int(h["x-xet-token-expiration"]), h["x-xet-cas-url"])
        except (KeyError, ValueError):
            try:
                body = resp.json()
                got = (body["accessToken"], int(body["exp"]), body["casUrl"])
            except (ValueError, KeyError, TypeError) as e:
                raise HubTransient(f"write {path}: a Xet write token without its fields") from e
        with self._lock:
            self._xet = got
        return got

    def _upload(self, items: list[tuple[str, bytes | str | Path]]) -> list:
        """Upload ``items`` to Xet storage with the kept write token; the batch's add operations
        (huggingface_hub's ``_BucketAddFile``, hash and size filled in, as its own upload does)."""
        from hf_xet import SKIP_SHA256
        from huggingface_hub._buckets import _BucketAddFile
        from huggingface_hub.utils import _xet, build_hf_headers

        token, expiry, cas_url = self._write_token(items[0][0])
        headers = build_hf_headers(token=self.token)
        ops = [_BucketAddFile(source=src, destination=self._key(p)) for p, src in items]
        try:
            with _xet.get_xet_session().new_upload_commit(
                endpoint=cas_url,
                token=token,
                token_expiry_unix_secs=expiry,
                # only if the token expires during the upload (it is fetched again before)
                token_refresh_url=f"{self.endpoint}/api/buckets/{self.bucket_id}/xet-write-token",
                token_refresh_headers=headers,
                custom_headers=_xet.xet_headers_without_auth(headers),
            ) as commit:
                handles = [
                    commit.start_upload_bytes(op.source, sha256=SKIP_SHA256)
                    if isinstance(op.source, bytes)
                    else commit.start_upload_file(str(op.source), sha256=SKIP_SHA256)
                    for op in ops
                ]
            for handle, op in zip(handles, ops, strict=True):
                result = handle.result()
                op.xet_hash, op.size = result.xet_info.hash, result.xet_info.file_size
        except KeyboardInterrupt:
            _xet.abort_xet_session()
            raise
        except Exception as e:
            if re.search(r"HTTP status client error \((401|403)", str(e)):
                with self._lock:  # a refused token is not kept: the retry fetches a new one
                    self._xet = None
            raise
        return ops

    def put(self, items: list[tuple[str, bytes | str | Path]], delete: list[str] = ()) -> None:
        """Add files and delete others in one ``HfApi.batch_bucket_files`` call (``(path, bytes
        or a local file)``). The upload to Xet storage comes first, with a kept write token
        (:attr:`reuses_write_tokens`; else inside ``batch_bucket_files``, with a new token each
        call). Not transactional: on an error some of the operations may be done."""
        if not items:
            self.delete(list(delete))
            return
        self.check()
        items = [(p, src if isinstance(src, bytes) else Path(src)) for p, src in items]
        keys = [self._key(p) for p in delete] or None

        def batch():
            if self.reuses_write_tokens:
                add = self._upload(items)
            else:
                self.count(1, 0)  # batch_bucket_files fetches a Xet write token itself
                add = [
                    (src if isinstance(src, bytes) else str(src), self._key(p)) for p, src in items
                ]
            self.api.batch_bucket_files(self.bucket_id, add=add, delete=keys)

        self._lib("write", items[0][0], batch, write=True)
        with self._lock:
            for p in [p for p, _ in items] + list(delete):
                self._etags.pop(p, None)

    def delete(self, paths: list[str]) -> None:
        """Delete files in one ``HfApi.batch_bucket_files`` call (nothing when ``paths`` is
        empty)."""
        if not paths:
            return
        self.check()
        keys = [self._key(p) for p in paths]
        self._lib(
            "delete",
            paths[0],
            lambda: self.api.batch_bucket_files(self.bucket_id, delete=keys),
            write=True,
        )
        with self._lock:
            for p in paths:
                self._etags.pop(p, None)


def _token_reuse_supported() -> bool:
    """Whether this huggingface_hub is one the Xet write-token reuse was written against."""
    try:
        import hf_xet
        import huggingface_hub
        from huggingface_hub._buckets import _BucketAddFile  # noqa: F401
        from huggingface_hub.utils import _xet
    except ImportError:
        return False
    return (
        huggingface_hub.__version__.startswith(_TOKEN_REUSE_VERSIONS)
        and hasattr(hf_xet, "SKIP_SHA256")
        and all(hasattr(_xet, n) for n in ("get_xet_session", "xet_headers_without_auth"))
    )


class _Status:
    """An HTTP status reported inside another error's message (hf_xet's), for :meth:`_fail`."""

    def __init__(self, status_code: int):
        self.status_code = status_code
        self.headers: dict[str, str] = {}


def _etag(resp) -> str | None:
    h = resp.headers
    return h.get("x-linked-etag") or h.get("etag") or h.get("x-xet-hash")


def _retry_after(headers, now: float | None = None) -> float | None:
    """Seconds to wait from ``Retry-After`` (seconds, or an HTTP date: the time until it from
    ``now``, unix s, default the current time) or ``RateLimit`` (``...;t=N``), if any; never
    negative. Unbounded: ``Store`` caps the wait (``max_retry_after_s``)."""
    value = (headers.get("retry-after") or "").strip()
    if value:
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            when = None
        if when is not None and when.tzinfo is not None:
            return max(0.0, when.timestamp() - (time.time() if now is None else now))
    m = re.search(r"t=(\d+)", headers.get("ratelimit", ""))
    return float(m.group(1)) if m else None
