"""A Xet CAS (content-addressed storage) server for the local Hub.

Implements the CAS HTTP API that the ``hf_xet`` client speaks (xet-core spec: api.md,
upload-protocol.md, download-protocol.md), storing xorbs and shards as files. Reconstructions
are answered from the file-info sections of stored shards (shard.md); the byte ranges of chunks
inside a xorb come from its chunk headers (xorb.md).

hf_xet 1.8 uploads with GET /v1/chunks/default/{chunk} (global dedup, answered 404),
POST /v1/xorb-grants/default/{xorb} (not served: its 404 makes it use POST /v1/xorbs/default/{xorb}),
POST /v2/shards (not served: it falls back to POST /v1/shards); it downloads with
GET /v2/reconstructions/{file} (V1 when forced) and ranged GETs of the fetch URLs.

Not implemented: global deduplication, xorb hash verification (the hash in the upload path is
trusted), multi-range reads of a fetch URL (each V2 entry holds one range, so none are asked).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import lz4.frame
from fastapi import APIRouter, HTTPException, Request, Response

_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_BOOKEND = b"\xff" * 32
_FLAG_VERIFICATION = 1 << 31
_FLAG_METADATA_EXT = 1 << 30
_ENTRY = 48  # every shard record (header, entry, verification, metadata ext) is 48 bytes


class Term(NamedTuple):
    """One reconstruction term (file-reconstruction.md): chunks [start, end) of a xorb."""

    xorb: str
    unpacked: int
    start: int
    end: int


class Chunk(NamedTuple):
    """One chunk of a stored xorb (xorb.md): header offset, serialized end, scheme, raw size."""

    offset: int
    end: int
    scheme: int
    size: int


def hash_to_str(raw: bytes) -> str:
    """Spec string form of a 32-byte hash (api.md): 4 little-endian u64, each as 16 hex digits."""
    return "".join(raw[i : i + 8][::-1].hex() for i in range(0, 32, 8))


def parse_chunks(data: bytes) -> list[Chunk]:
    """Chunk headers of a serialized xorb (xorb.md), stopping at the "XETBLOB" footer or the end.

    Raises ValueError if a header is malformed or a chunk runs past the end of ``data``.
    """
    chunks, pos = [], 0
    while pos < len(data) and not data.startswith(b"XETBLOB", pos):
        if pos + 8 > len(data) or data[pos] != 0:
            raise ValueError(f"bad chunk header at byte {pos}")
        comp = int.from_bytes(data[pos + 1 : pos + 4], "little")
        size = int.from_bytes(data[pos + 5 : pos + 8], "little")
        if data[pos + 4] > 2 or pos + 8 + comp > len(data):
            raise ValueError(f"bad chunk at byte {pos}")
        chunks.append(Chunk(pos, pos + 8 + comp, data[pos + 4], size))
        pos += 8 + comp
    return chunks


def decode_chunk(data: bytes, chunk: Chunk) -> bytes:
    """Uncompressed bytes of ``chunk`` (schemes per xorb.md: 0 none, 1 LZ4 frame, 2 BG4 + LZ4)."""
    body = data[chunk.offset + 8 : chunk.end]
    if chunk.scheme == 0:
        return body
    raw = lz4.frame.decompress(body)
    if chunk.scheme == 2:  # undo byte grouping: group i holds bytes i, i+4, i+8, ...
        out, pos = bytearray(len(raw)), 0
        for i in range(4):
            n = len(range(i, len(raw), 4))
            out[i::4] = raw[pos : pos + n]
            pos += n
        raw = bytes(out)
    if len(raw) != chunk.size:
        raise ValueError("chunk size mismatch")
    return raw


def parse_shard_files(data: bytes) -> dict[str, list[Term]]:
    """File hash -> terms, from the file-info section of a shard (shard.md); ValueError if malformed."""
    if len(data) < 48 or struct.unpack_from("<Q", data, 32)[0] != 2:
        raise ValueError("not a version 2 shard")
    files, pos = {}, 48
    while True:
        if pos + _ENTRY > len(data):
            raise ValueError("shard file-info section has no bookend")
        if data[pos : pos + 32] == _BOOKEND:
            return files
        flags, n = struct.unpack_from("<II", data, pos + 32)
        terms = []
        for i in range(n):
            at = pos + _ENTRY * (i + 1)
            if at + _ENTRY > len(data):
                raise ValueError("truncated shard")
            _, unpacked, start, end = struct.unpack_from("<IIII", data, at + 32)
            terms.append(Term(hash_to_str(data[at : at + 32]), unpacked, start, end))
        files[hash_to_str(data[pos : pos + 32])] = terms
        pos += _ENTRY * (1 + n * (2 if flags & _FLAG_VERIFICATION else 1))
        pos += _ENTRY if flags & _FLAG_METADATA_EXT else 0


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class CasStore:
    """Xorbs and shards on disk under root (files, so another process or a restart sees them).

    Layout: ``root/xorbs/<xorb hash>`` (serialized xorb as uploaded),
    ``root/shards/<sha256 of body>.shard`` (shard as uploaded) and ``root/owners/<file hash>``
    (the namespaces whose write tokens uploaded a shard describing that file, one a line: what a
    bucket may link, :meth:`uploaded_by`). Hashes are in spec string form.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self._lock = threading.Lock()
        self._files: dict[str, list[Term]] = {}
        self._seen_shards: set[str] = set()
        self._chunks: dict[str, list[Chunk]] = {}

    def _xorb_path(self, xorb_hash: str) -> Path:
        return self.root / "xorbs" / xorb_hash

    def has_xorb(self, xorb_hash: str) -> bool:
        """Whether a xorb with this hash (string form) is stored."""
        return self._xorb_path(xorb_hash).is_file()

    def put_xorb(self, xorb_hash: str, data: bytes) -> bool:
        """Store a serialized xorb (xorb.md); False if already stored. ValueError if malformed."""
        if self.has_xorb(xorb_hash):
            return False
        if not parse_chunks(data):
            raise ValueError("xorb has no chunks")
        _write_atomic(self._xorb_path(xorb_hash), data)
        return True

    def put_shard(self, data: bytes, namespace: str | None = None) -> bool:
        """Store an uploaded shard (shard.md); False if already stored. ``namespace``: the
        owner of the bucket whose Xet write token uploaded it, recorded for each file the shard
        describes (also when the shard was stored already).

        Raises ValueError if malformed, or if a term names a xorb not stored or chunks that
        it does not hold (or whose sizes add up to another unpacked length).
        """
        path = self.root / "shards" / f"{hashlib.sha256(data).hexdigest()}.shard"
        files = parse_shard_files(data)
        if path.is_file():
            self._record_owner(files, namespace)
            return False
        for term in (t for terms in files.values() for t in terms):
            try:
                chunks = self.xorb_chunks(term.xorb)[term.start : term.end]
            except KeyError:
                raise ValueError(f"shard references unknown xorb {term.xorb}") from None
            if len(chunks) != term.end - term.start or sum(c.size for c in chunks) != term.unpacked:
                raise ValueError(f"shard term does not match xorb {term.xorb}")
        _write_atomic(path, data)
        self._record_owner(files, namespace)
        return True

    def _record_owner(self, files: dict, namespace: str | None) -> None:
        if not namespace:
            return
        with self._lock:
            for file_hash in files:
                path = self.root / "owners" / file_hash
                known = path.read_text().split() if path.is_file() else []
                if namespace not in known:
                    _write_atomic(path, "".join(f"{n}\n" for n in [*known, namespace]).encode())

    def uploaded_by(self, file_hash: str) -> set[str]:
        """The namespaces whose write tokens uploaded a shard describing ``file_hash``."""
        if not _HASH_RE.match(file_hash):
            return set()
        path = self.root / "owners" / file_hash
        return set(path.read_text().split()) if path.is_file() else set()

    def terms(self, file_hash: str) -> list[Term]:
        """Reconstruction terms of a file (string-form hash); KeyError if no stored shard has it."""
        with self._lock:
            shard_dir = self.root / "shards"
            for path in sorted(shard_dir.glob("*.shard")) if shard_dir.is_dir() else []:
                if path.name not in self._seen_shards:
                    self._files.update(parse_shard_files(path.read_bytes()))
                    self._seen_shards.add(path.name)
            return self._files[file_hash]

    def xorb_chunks(self, xorb_hash: str) -> list[Chunk]:
        """Chunk table of a stored xorb; KeyError if not stored."""
        with self._lock:
            if xorb_hash not in self._chunks:
                if not self.has_xorb(xorb_hash):
                    raise KeyError(xorb_hash)
                self._chunks[xorb_hash] = parse_chunks(self._xorb_path(xorb_hash).read_bytes())
            return self._chunks[xorb_hash]

    def read_xorb_range(self, xorb_hash: str, first: int, last: int) -> tuple[bytes, int]:
        """(Bytes [first, last] of a stored xorb, clipped to its end; its size); KeyError if unknown."""
        try:
            with open(self._xorb_path(xorb_hash), "rb") as f:
                f.seek(first)
                return f.read(max(0, last + 1 - first)), os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            raise KeyError(xorb_hash) from None

    def plan(self, file_hash: str, first: int, last: int) -> tuple[int, list[tuple]]:
        """Whole chunks covering bytes [first, last] of a file (download-protocol.md).

        Returns (offset of ``first`` into the first kept chunk, terms), each term trimmed to the
        chunks overlapping the range: (xorb, chunk start, chunk end (exclusive), unpacked bytes,
        first and last (inclusive) byte of those chunks in the xorb). KeyError if unknown.
        """
        offset, out, pos = None, [], 0
        for term in self.terms(file_hash):
            chunks, kept = self.xorb_chunks(term.xorb), []
            for i in range(term.start, term.end):
                if pos <= last and pos + chunks[i].size > first:
                    offset = first - pos if offset is None else offset
                    kept.append(i)
                pos += chunks[i].size
            if kept:
                lo, hi = kept[0], kept[-1] + 1
                size = sum(c.size for c in chunks[lo:hi])
                out.append((term.xorb, lo, hi, size, chunks[lo].offset, chunks[hi - 1].end - 1))
        return offset or 0, out

    def has_file(self, file_hash: str) -> bool:
        """Whether some stored shard describes this file hash (string form)."""
        try:
            self.terms(file_hash)
            return True
        except KeyError:
            return False

    def file_size(self, file_hash: str) -> int:
        """Unpacked size of the file in bytes; KeyError if unknown."""
        return sum(t.unpacked for t in self.terms(file_hash))

    def read_file(self, file_hash: str) -> bytes:
        """The file's bytes, reconstructed from its terms (file-reconstruction.md); KeyError if unknown."""
        out = bytearray()
        for term in self.terms(file_hash):
            data = self._xorb_path(term.xorb).read_bytes()
            for chunk in self.xorb_chunks(term.xorb)[term.start : term.end]:
                out += decode_chunk(data, chunk)
        return bytes(out)


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _parse_range(header: str | None, size: int) -> tuple[int, int]:
    """(first, last) byte of a ``bytes=a-b`` / ``bytes=a-`` header (RFC 9110), clipped to ``size``.

    No header: the whole object. Raises HTTPException 400 if unparsable, 416 if a >= size.
    """
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", (header or "").strip())
    if header and not m:
        raise HTTPException(400, f"unsupported Range header {header!r}")
    first, last = (int(m[1]), int(m[2] or size - 1)) if m else (0, size - 1)
    if m and (first >= size or last < first):
        raise HTTPException(416, "requested range not satisfiable")
    return first, min(last, size - 1)


def cas_router(
    store: CasStore,
    authorize: Callable[[str | None, bool], None],
    base_url: Callable[[Request], str],
) -> APIRouter:
    """FastAPI router with the CAS API of api.md, plus ``GET /v1/xorb-bytes/{hash}?sig=...``.

    ``authorize(token, write)`` must raise HTTPException (401/403) to refuse; it gets write=True
    for xorb and shard uploads, write=False otherwise; what it returns for a shard upload (the
    namespace the token writes for, or None) is recorded as the uploader of the shard's files
    (:meth:`CasStore.uploaded_by`). hf_xet sends no Authorization header to
    the fetch URLs handed out in reconstructions, so those are presigned (HMAC of the xorb hash
    with a key made per router) like the real service's; unsigned ones go through ``authorize``.
    ``base_url(request)`` is the absolute URL prefix under which the router is mounted.
    """
    router = APIRouter()
    key = secrets.token_bytes(32)

    def sign(xorb_hash: str) -> str:
        return hmac.new(key, xorb_hash.encode(), "sha256").hexdigest()

    def check_hash(value: str) -> str:
        if not _HASH_RE.match(value):
            raise HTTPException(400, f"malformed hash {value!r}")
        return value

    def reconstruction(request: Request, file_id: str, v2: bool) -> dict:
        authorize(_bearer(request), False)
        try:
            size = store.file_size(check_hash(file_id))
        except KeyError:
            raise HTTPException(404, "file not found") from None
        offset, terms = store.plan(file_id, *_parse_range(request.headers.get("range"), size))
        out_terms, fetch = [], {}
        for xorb, lo, hi, unpacked, byte_first, byte_last in terms:
            cr, br = {"start": lo, "end": hi}, {"start": byte_first, "end": byte_last}
            out_terms.append({"hash": xorb, "unpacked_length": unpacked, "range": cr})
            url = f"{base_url(request)}/v1/xorb-bytes/{xorb}?sig={sign(xorb)}"
            entry = (
                {"url": url, "ranges": [{"chunks": cr, "bytes": br}]}
                if v2
                else {"range": cr, "url": url, "url_range": br}
            )
            if entry not in fetch.setdefault(xorb, []):
                fetch[xorb].append(entry)
        return {
            "offset_into_first_range": offset,
            "terms": out_terms,
            ("xorbs" if v2 else "fetch_info"): fetch,
        }

    @router.get("/v1/reconstructions/{file_id}")
    def reconstruction_v1(request: Request, file_id: str) -> dict:
        """QueryReconstructionResponse (api.md, download-protocol.md); 400, 404, 416 on errors."""
        return reconstruction(request, file_id, v2=False)

    @router.get("/v2/reconstructions/{file_id}")
    def reconstruction_v2(request: Request, file_id: str) -> dict:
        """QueryReconstructionResponseV2 (xet-core api_changes/update_260316): what hf_xet asks first."""
        return reconstruction(request, file_id, v2=True)

    @router.get("/v1/chunks/{prefix}/{chunk_hash}")
    def query_chunk(request: Request, prefix: str, chunk_hash: str) -> Response:
        """Global dedup query (api.md): always 404, i.e. the chunk is not tracked."""
        authorize(_bearer(request), False)
        check_hash(chunk_hash)
        raise HTTPException(404, "chunk not tracked by global deduplication")

    @router.post("/v1/xorbs/{prefix}/{xorb_hash}")
    async def upload_xorb(request: Request, prefix: str, xorb_hash: str) -> dict:
        """Store a serialized xorb (api.md): ``{"was_inserted": bool}``; 400 if malformed."""
        authorize(_bearer(request), True)
        check_hash(xorb_hash)
        try:
            return {"was_inserted": store.put_xorb(xorb_hash, await request.body())}
        except ValueError as e:
            raise HTTPException(400, str(e)) from None

    @router.post("/v1/shards")
    async def upload_shard(request: Request) -> dict:
        """Register a shard (api.md): ``{"result": 1}`` if new, 0 if known; 400 if invalid."""
        namespace = authorize(_bearer(request), True)
        try:
            return {"result": int(store.put_shard(await request.body(), namespace))}
        except ValueError as e:
            raise HTTPException(400, str(e)) from None

    @router.get("/v1/xorb-bytes/{xorb_hash}")
    def xorb_bytes(request: Request, xorb_hash: str, sig: str = "") -> Response:
        """Bytes of a stored xorb: 206 with the ``Range`` asked (one range), 200 whole without one."""
        if not hmac.compare_digest(sig, sign(check_hash(xorb_hash))):
            authorize(_bearer(request), False)
        try:
            _, size = store.read_xorb_range(xorb_hash, 0, -1)
        except KeyError:
            raise HTTPException(404, "xorb not found") from None
        first, last = _parse_range(request.headers.get("range"), size)
        body, _ = store.read_xorb_range(xorb_hash, first, last)
        if request.headers.get("range") is None:
            return Response(body, media_type="application/octet-stream")
        headers = {"Content-Range": f"bytes {first}-{last}/{size}"}
        return Response(body, 206, headers, media_type="application/octet-stream")

    return router
