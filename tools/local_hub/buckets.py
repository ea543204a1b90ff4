"""The bucket routes of the local Hub, as huggingface_hub 2.4.0 calls them and reads their answers.

Sources: ``hf_api.py`` (``create_bucket``, ``bucket_info``, ``list_bucket_tree``,
``get_bucket_paths_info``, ``_batch_bucket_files``, ``get_bucket_file_metadata``), ``_buckets.py``
(the JSON field names and ``parse_datetime``'s date format), ``utils/_pagination.py`` (``Link:
<url>; rel="next"``), ``utils/_xet.py`` (the Xet token's ``X-Xet-*`` headers and refresh routes),
``utils/_http.py`` (``X-Error-Code`` ``RepoNotFound`` / ``EntryNotFound``, redirects that leave
the Hub's origin are not followed for metadata) and ``_bucket_live_follow.py`` (the event feed).

A file is stored as its Xet hash in the bucket's ``files.json``; its bytes live in the Xet CAS
(:class:`tools.local_hub.cas.CasStore`), uploaded there by the client's hf_xet before the
``/batch`` that adds it. A resolve answers 302 to the *file bridge* on the CAS origin (another
port, as the real Hub's bridge is another host), with the Hub's tags on the 302.

Settings the caller may change while it runs (:class:`BucketSettings`): whether a resolve with a
matching ``If-None-Match`` answers 304 itself, and the bridge's ETag policy (``same`` as the
Hub's tag, ``different``, or ``ignore`` ``If-None-Match``), because the real Hub's behaviour there
is not known (../NOTES-local-hub.md).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import json
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote, urlencode

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

XET_TOKEN_TTL_S = 3600  # how long a Xet access token lives (the client refreshes before expiry)
BRIDGE_URL_TTL_S = 3600  # how long a bridge URL is valid


@dataclasses.dataclass
class BucketSettings:
    """What the real Hub may do either way (see the module docstring)."""

    resolve_304: bool = True  # the Hub answers a matching If-None-Match with 304
    bridge_etag: str = "different"  # "same" | "different" | "ignore"
    page_size: int = 1000  # tree entries per page


def iso(t: float) -> str:
    """A unix time as the Hub writes dates (``%Y-%m-%dT%H:%M:%S.%fZ``, what ``parse_datetime``
    reads)."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _not_found(code: str, what: str) -> HTTPException:
    return HTTPException(404, what, headers={"X-Error-Code": code, "X-Error-Message": what})


class Signer:
    """HMAC-signed strings (Xet access tokens, bridge URLs): valid across a Hub restart, since
    the key is kept in ``<root>/secret``."""

    def __init__(self, root: Path):
        path = Path(root) / "secret"
        if not path.exists():
            path.write_bytes(
                base64.b64encode(hashlib.sha256(str(time.time_ns()).encode()).digest())
            )
            path.chmod(0o600)
        self.key = path.read_bytes()

    def sign(self, payload: dict) -> str:
        body = base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")
        mac = hmac.new(self.key, body.encode(), "sha256").hexdigest()[:32]
        return f"{body}.{mac}"

    def open(self, token: str) -> dict | None:
        """The payload of a signed string, or None when it is forged, malformed or expired."""
        body, _, mac = token.partition(".")
        want = hmac.new(self.key, body.encode(), "sha256").hexdigest()[:32]
        if not hmac.compare_digest(mac, want):
            return None
        payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        return payload if payload.get("exp", 0) > time.time() else None


def path_error(path) -> str | None:
    """Why ``path`` cannot name a file in a bucket (None when it can): it must be a non-empty
    relative path of non-empty segments, none of them ``.`` or ``..``, without control
    characters (so no ``/x``, ``a//b``, ``a/``, ``../x``, ``a/./b``)."""
    if not isinstance(path, str) or not path:
        return f"expected a non-empty path string, found {path!r}"
    if path.startswith("/"):
        return "expected a relative path, found a leading '/'"
    if any(ord(c) < 32 or c == "\x7f" for c in path):
        return "expected a path without control characters"
    parts = path.split("/")
    if "" in parts:
        return "expected no empty path segment ('//' or a trailing '/')"
    if any(p in (".", "..") for p in parts):
        return "expected no '.' or '..' path segment"
    return None


class BatchRefused(ValueError):
    """A whole batch refused before anything was applied: ``failed`` lists ``{path, error}``."""

    def __init__(self, message: str, failed: list[dict]):
        super().__init__(message)
        self.failed = failed


class Buckets:
    """Every bucket's files and change log, on disk under ``<root>/buckets/<ns>/<name>/``.

    What a batch may link (:meth:`linkable`): a Xet file hash already in the bucket, one that a
    write token of the bucket's namespace uploaded (:meth:`CasStore.uploaded_by`) or that a bucket
    of that namespace holds, or, for ``copyFile``, one its source bucket holds when the caller
    may read that bucket. Another namespace's hash is refused as an unknown one is: a hash is not
    a capability (on the Hub, Xet file hashes appear in every public tree listing).
    """

    def __init__(self, root: Path, cas):
        self.root = Path(root) / "buckets"
        self.cas = cas
        self._lock = threading.Lock()
        self.waiters: list = []  # callables woken after each change (the event feeds)

    def _dir(self, bucket_id: str) -> Path:
        return self.root / bucket_id

    def meta(self, bucket_id: str) -> dict | None:
        path = self._dir(bucket_id) / "meta.json"
        return json.loads(path.read_text()) if path.exists() else None

    def files(self, bucket_id: str) -> dict[str, dict]:
        path = self._dir(bucket_id) / "files.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _write(self, path: Path, value) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(path)

    def create(self, bucket_id: str, private: bool) -> bool:
        """Create a bucket; False when it exists already."""
        with self._lock:
            if self.meta(bucket_id) is not None:
                return False
            self._dir(bucket_id).mkdir(parents=True, exist_ok=True)
            now = time.time()
            self._write(self._dir(bucket_id) / "files.json", {})
            self._write(
                self._dir(bucket_id) / "meta.json",
                {"id": bucket_id, "private": private, "created": now, "updated": now, "seq": 0},
            )
            return True

    def linkable(self, bucket_id: str, op: dict, present: set, can_read=None) -> bool:
        """Whether ``op`` (``addFile``/``copyFile``) may link its ``xetHash`` into ``bucket_id``
        (``present``: the Xet hashes in the bucket now; ``can_read(bucket_id)``: whether the caller may read
        another bucket, for a ``copyFile``'s source). See the class docstring."""
        xet_hash = op.get("xetHash")
        if not isinstance(xet_hash, str) or not self.cas.has_file(xet_hash):
            return False
        if xet_hash in present:
            return True
        namespace = bucket_id.split("/")[0]
        if namespace in self.cas.uploaded_by(xet_hash):
            return True
        if any(
            f["xetHash"] == xet_hash
            for d in (self.root / namespace).iterdir()
            if d.is_dir()
            for f in self.files(f"{namespace}/{d.name}").values()
        ):
            return True  # e.g. uploaded before this Hub recorded uploaders
        source = op.get("sourceRepoId")
        if op.get("type") != "copyFile" or op.get("sourceRepoType", "bucket") != "bucket":
            return False
        if not isinstance(source, str) or path_error(source) or source.count("/") != 1:
            return False
        if self.meta(source) is None or can_read is None or not can_read(source):
            return False
        return any(f["xetHash"] == xet_hash for f in self.files(source).values())

    def apply(self, bucket_id: str, ops: list[dict], can_read=None) -> tuple[int, list[dict]]:
        """Apply a batch's operations in order: (succeeded, failed ``[{path, error}]``).

        ``can_read(bucket_id)``: whether the caller may read a ``copyFile``'s source bucket.

        Raises:
            BatchRefused: an operation's path cannot name a file (:func:`path_error`); nothing is
                applied.
        """
        bad = [
            {"path": op.get("path") if isinstance(op, dict) else None, "error": error}
            for op in ops
            if (
                error := path_error(op.get("path"))
                if isinstance(op, dict)
                else "expected a JSON object"
            )
        ]
        if bad:
            raise BatchRefused(
                f"{len(bad)} of {len(ops)} operations have an invalid path; nothing was applied",
                bad,
            )
        ok, failed, changes = 0, [], []
        with self._lock:
            files, meta = self.files(bucket_id), self.meta(bucket_id)
            present = {f["xetHash"] for f in files.values()}
            now = time.time()
            for op in ops:
                path = op["path"]
                kind = op.get("type")
                if kind in ("addFile", "copyFile"):
                    xet_hash = op.get("xetHash")
                    if not self.linkable(bucket_id, op, present, can_read):
                        failed.append(
                            {
                                "path": path,
                                "error": f"Xet file {xet_hash} not found for {bucket_id}: upload "
                                f"it with a write token of {bucket_id.split('/')[0]}",
                            }
                        )
                        continue
                    mtime = op.get("mtime") or int(now * 1000)
                    files[path] = {
                        "xetHash": xet_hash,
                        "size": self.cas.file_size(xet_hash),
                        "mtime": mtime / 1000,
                        "uploadedAt": now,
                    }
                    present.add(xet_hash)
                    changes.append({"path": path, "op": "add", "xetHash": xet_hash})
                elif kind == "deleteFile":
                    if files.pop(path, None) is not None:
                        changes.append({"path": path, "op": "delete"})
                else:
                    failed.append({"path": path, "error": f"unknown operation type {kind!r}"})
                    continue
                ok += 1
            if changes:
                meta["updated"] = now
                meta["seq"] += 1
                self._write(self._dir(bucket_id) / "files.json", files)
                self._write(self._dir(bucket_id) / "meta.json", meta)
                with open(self._dir(bucket_id) / "changes.jsonl", "a") as f:
                    f.write(json.dumps({"seq": meta["seq"], "changes": changes}) + "\n")
        for wake in list(self.waiters):
            wake()
        return ok, failed

    def changes_after(self, bucket_id: str, seq: int) -> list[dict]:
        path = self._dir(bucket_id) / "changes.jsonl"
        if not path.exists():
            return []
        with open(path) as f:
            return [c for c in map(json.loads, f) if c["seq"] > seq]


def file_entry(path: str, f: dict) -> dict:
    """A file as ``list_bucket_tree`` / ``paths-info`` answer it (``BucketFile``'s fields)."""
    return {
        "type": "file",
        "path": path,
        "size": f["size"],
        "xetHash": f["xetHash"],
        "mtime": iso(f["mtime"]),
        "uploadedAt": iso(f["uploadedAt"]),
    }


def bucket_router(
    accounts, buckets: Buckets, signer: Signer, settings: BucketSettings, hub_url: str, cas_url: str
) -> APIRouter:
    """The bucket routes (``/api/buckets/...``, ``/buckets/.../resolve/...``).

    Args:
        accounts: :class:`tools.local_hub.accounts.Accounts` (authorization).
        hub_url: this Hub's base URL (for ``url`` answers and ``Link`` headers).
        cas_url: the CAS origin's base URL (the Xet ``casUrl``; the bridge lives under it).
    """
    r = APIRouter()

    def readable(request: Request, bucket_id: str) -> dict:
        meta = buckets.meta(bucket_id)
        if meta is None or meta["private"]:
            user = accounts.authorize(request, write=False, resource=f"bucket:{bucket_id}")
            if meta is None or user != bucket_id.split("/")[0]:
                raise _not_found("RepoNotFound", f"Bucket {bucket_id} not found")
        elif request.headers.get("authorization"):
            accounts.authorize(request, write=False, resource=f"bucket:{bucket_id}")
        return meta

    def writable(request: Request, bucket_id: str) -> dict:
        accounts.authorize(request, write=True, resource=f"bucket:{bucket_id}")
        meta = buckets.meta(bucket_id)
        if meta is None:
            raise _not_found("RepoNotFound", f"Bucket {bucket_id} not found")
        return meta

    @r.post("/api/buckets/{ns}/{name}")
    async def create(ns: str, name: str, request: Request):
        user = accounts.authorize(request, write=False)
        ns = user if ns == "me" else ns
        bucket_id = f"{ns}/{name}"
        accounts.authorize(request, write=True, resource=f"bucket:{bucket_id}")
        body = await request.json() if await request.body() else {}
        url = f"{hub_url}/buckets/{bucket_id}"
        if not buckets.create(bucket_id, body.get("visibility", "public") == "private"):
            return JSONResponse({"error": "You already created this bucket", "url": url}, 409)
        return {"url": url, "id": bucket_id}

    @r.get("/api/buckets/{ns}/{name}")
    def info(ns: str, name: str, request: Request):
        bucket_id = f"{ns}/{name}"
        meta = readable(request, bucket_id)
        files = buckets.files(bucket_id)
        return {
            "id": bucket_id,
            "private": meta["private"],
            "createdAt": iso(meta["created"]),
            "updatedAt": iso(meta["updated"]),
            "size": sum(f["size"] for f in files.values()),
            "totalFiles": len(files),
        }

    @r.get("/api/buckets/{ns}/{name}/tree")
    @r.get("/api/buckets/{ns}/{name}/tree/{prefix:path}")
    def tree(
        ns: str,
        name: str,
        request: Request,
        prefix: str = "",
        recursive: str = "false",
        cursor: int = 0,
    ):
        bucket_id = f"{ns}/{name}"
        readable(request, bucket_id)
        prefix = prefix.strip("/")
        under = f"{prefix}/" if prefix else ""
        files = buckets.files(bucket_id)
        entries, folders = [], set()
        for path in sorted(p for p in files if p.startswith(under)):
            rest = path[len(under) :]
            if recursive.lower() != "true" and "/" in rest:
                folders.add(under + rest.split("/")[0])
                continue
            entries.append(file_entry(path, files[path]))
        if recursive.lower() == "true":
            for path in list(files):
                parts = path[len(under) :].split("/")[:-1] if path.startswith(under) else []
                folders.update(under + "/".join(parts[: i + 1]) for i in range(len(parts)))
        entries += [{"type": "directory", "path": p} for p in sorted(folders)]
        if prefix and not entries:
            raise _not_found("EntryNotFound", f"{prefix} does not exist in bucket {bucket_id}")
        page = entries[cursor : cursor + settings.page_size]
        headers = {}
        if cursor + settings.page_size < len(entries):
            query = urlencode({"recursive": recursive, "cursor": cursor + settings.page_size})
            tail = f"/{quote(prefix, safe='')}" if prefix else ""
            headers["Link"] = f'<{hub_url}/api/buckets/{bucket_id}/tree{tail}?{query}>; rel="next"'
        return JSONResponse(page, headers=headers)

    @r.post("/api/buckets/{ns}/{name}/paths-info")
    async def paths_info(ns: str, name: str, request: Request):
        bucket_id = f"{ns}/{name}"
        readable(request, bucket_id)
        paths = (await request.json()).get("paths", [])
        if len(paths) > 1000:
            raise HTTPException(400, "expected at most 1000 paths")
        files = buckets.files(bucket_id)
        return [file_entry(p, files[p]) for p in paths if p in files]

    def xet_token(request: Request, bucket_id: str, write: bool):
        (writable if write else readable)(request, bucket_id)
        exp = int(time.time()) + XET_TOKEN_TTL_S
        holder = accounts.token_of(request)
        token = signer.sign({"b": bucket_id, "w": write, "exp": exp, "n": holder and holder.name})
        headers = {
            "X-Xet-Cas-Url": cas_url,
            "X-Xet-Access-Token": token,
            "X-Xet-Token-Expiration": str(exp),
        }
        return JSONResponse({"accessToken": token, "exp": exp, "casUrl": cas_url}, headers=headers)

    @r.get("/api/buckets/{ns}/{name}/xet-write-token")
    def write_token(ns: str, name: str, request: Request):
        return xet_token(request, f"{ns}/{name}", True)

    @r.get("/api/buckets/{ns}/{name}/xet-read-token")
    def read_token(ns: str, name: str, request: Request):
        return xet_token(request, f"{ns}/{name}", False)

    @r.post("/api/buckets/{ns}/{name}/batch")
    async def batch(ns: str, name: str, request: Request):
        bucket_id = f"{ns}/{name}"
        writable(request, bucket_id)
        try:
            ops = [json.loads(line) for line in (await request.body()).splitlines() if line.strip()]
        except ValueError as e:
            raise HTTPException(400, f"expected NDJSON operations: {e}") from e
        if not all(isinstance(op, dict) for op in ops):
            raise HTTPException(400, "expected one JSON object per NDJSON line")

        def can_read(source: str) -> bool:
            try:
                readable(request, source)
                return True
            except HTTPException:
                return False

        try:
            ok, failed = buckets.apply(bucket_id, ops, can_read)
        except BatchRefused as e:
            body = {"error": str(e), "success": False, "processed": 0, "succeeded": 0}
            headers = {"X-Error-Message": str(e)}
            return JSONResponse({**body, "failed": e.failed}, 400, headers)
        body = {"success": not failed, "processed": len(ops), "succeeded": ok, "failed": failed}
        return JSONResponse(body, 422 if ops and not ok else 200)

    @r.api_route("/buckets/{ns}/{name}/resolve/{path:path}", methods=["GET", "HEAD"])
    def resolve(ns: str, name: str, path: str, request: Request):
        bucket_id = f"{ns}/{name}"
        readable(request, bucket_id)
        f = buckets.files(bucket_id).get(path)
        if f is None:
            raise _not_found("EntryNotFound", f"{path} does not exist in bucket {bucket_id}")
        etag = f'"{f["xetHash"]}"'
        headers = {
            "ETag": etag,
            "X-Linked-Etag": etag,
            "X-Linked-Size": str(f["size"]),
            "X-Xet-Hash": f["xetHash"],
            "Link": f'<{hub_url}/api/buckets/{bucket_id}/xet-read-token>; rel="xet-auth"',
        }
        if settings.resolve_304 and request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        holder = accounts.token_of(request)
        exp = int(time.time()) + BRIDGE_URL_TTL_S
        sig = signer.sign({"h": f["xetHash"], "exp": exp, "n": holder and holder.name})
        headers["Location"] = f"{cas_url}/bridge/{quote(path)}?sig={sig}"
        return Response(status_code=302, headers=headers)

    @r.get("/api/buckets/{ns}/{name}/events")
    async def events(
        ns: str, name: str, request: Request, cursor: str | None = None, since: str | None = None
    ):
        bucket_id = f"{ns}/{name}"
        meta = readable(request, bucket_id)
        if cursor and not cursor.isdigit():
            raise HTTPException(400, "expected a cursor this Hub gave")
        start = int(cursor) if cursor else meta["seq"]
        if start > meta["seq"]:  # a cursor this bucket never gave (recreated): reconcile
            reset = f"event: reset\ndata: {json.dumps({'reason': 'unknown cursor'})}\n\n"
            return StreamingResponse(iter([reset]), media_type="text/event-stream")
        return StreamingResponse(_feed(request, bucket_id, start), media_type="text/event-stream")

    async def _feed(request: Request, bucket_id: str, seq: int):
        """SSE: replayed ``changes`` after ``seq``, ``ready``, then live ``changes`` (``since``
        is not kept: without a cursor the feed starts at the bucket's current change)."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake():
            loop.call_soon_threadsafe(woken.set)

        buckets.waiters.append(wake)
        try:
            ready = False
            while True:
                for c in buckets.changes_after(bucket_id, seq):
                    seq = c["seq"]
                    data = {"cursor": str(seq), "changes": c["changes"]}
                    yield f"event: changes\ndata: {json.dumps(data)}\n\n"
                if not ready:
                    yield f"event: ready\ndata: {json.dumps({'cursor': str(seq)})}\n\n"
                    ready = True
                if await request.is_disconnected():
                    return
                try:
                    await asyncio.wait_for(woken.wait(), 15)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                woken.clear()
        finally:
            buckets.waiters.remove(wake)

    return r


def bridge_router(cas, signer: Signer, settings: BucketSettings) -> APIRouter:
    """The file bridge on the CAS origin: a signed URL gives a file's bytes, read back from the
    CAS (no ``Authorization``: the client drops it on a redirect to another origin). Its ETag
    follows ``settings.bridge_etag``."""
    r = APIRouter()

    @r.get("/bridge/{path:path}")
    def bridge(path: str, sig: str, request: Request):
        payload = signer.open(sig)
        if payload is None:
            raise HTTPException(403, "expected a valid, unexpired signed URL")
        xet_hash = payload["h"]
        policy = settings.bridge_etag
        etag = f'"{xet_hash}"' if policy == "same" else f'"br-{xet_hash[:16]}"'
        if policy != "ignore" and request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag})
        data = cas.read_file(xet_hash)
        return Response(data, headers={"ETag": etag}, media_type="application/octet-stream")

    return r
