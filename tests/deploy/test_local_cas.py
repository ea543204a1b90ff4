"""The local Xet CAS server (tools/local_hub/cas.py) against the real hf_xet client.

A uvicorn server on 127.0.0.1 mounts ``cas_router`` at ``/cas``; files are uploaded with a write
token and downloaded back with a read token through hf_xet's ``XetSession`` (the process-wide
session huggingface_hub uses), and compared bit for bit.
"""

from __future__ import annotations

import math
import os
import random
import struct
import threading
import time

import httpx
import pytest

hf_xet = pytest.importorskip("hf_xet")
pytest.importorskip("lz4")

import uvicorn  # noqa: E402
from fastapi import FastAPI, HTTPException, Request  # noqa: E402

from tools.local_hub.cas import CasStore, cas_router, decode_chunk, hash_to_str, parse_chunks  # noqa: E402

_rng = random.Random(1234)
BIG = _rng.randbytes(3_000_000)
FILES = {
    "small": b"hello xet\n",
    "big": BIG,
    "similar": BIG[:2_000_000] + b"a different middle" + BIG[2_100_000:],
    "text": b"".join(b"line %d of a compressible file\n" % i for i in range(40_000)),
    "floats": struct.pack("<200000f", *(math.sin(i / 1000) for i in range(200_000))),
    "empty": b"",
}


def _authorize(token: str | None, write: bool) -> None:
    if token not in ("r", "w"):
        raise HTTPException(401, "bad or missing token")
    if write and token != "w":
        raise HTTPException(403, "read-only token")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL of the CAS, store, request log) for a uvicorn server on a free port."""
    store = CasStore(tmp_path_factory.mktemp("cas"))
    log: list[tuple[str, str]] = []
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next):
        log.append((request.method, request.url.path))
        return await call_next(request)

    app.include_router(
        cas_router(store, _authorize, lambda r: str(r.base_url).rstrip("/") + "/cas"), prefix="/cas"
    )
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started, "uvicorn did not start"
    port = srv.servers[0].sockets[0].getsockname()[1]
    old_cache = os.environ.get("HF_XET_CACHE")
    os.environ["HF_XET_CACHE"] = str(tmp_path_factory.mktemp("xet-cache"))
    yield f"http://127.0.0.1:{port}/cas", store, log
    if old_cache is None:
        os.environ.pop("HF_XET_CACHE", None)
    else:
        os.environ["HF_XET_CACHE"] = old_cache
    srv.should_exit = True
    thread.join(10)


def _session():
    from huggingface_hub.utils._xet import get_xet_session

    return get_xet_session()


def _upload(endpoint: str, files: dict[str, bytes]) -> dict[str, str]:
    """Name -> xet file hash of ``files``, uploaded in one commit through hf_xet with the write token."""
    expiry = int(time.time()) + 3600
    with _session().new_upload_commit(
        endpoint=endpoint, token="w", token_expiry_unix_secs=expiry
    ) as commit:
        handles = {
            name: commit.start_upload_bytes(data, sha256=hf_xet.SKIP_SHA256)
            for name, data in files.items()
        }
    infos = {name: handle.result().xet_info for name, handle in handles.items()}
    assert all(infos[name].file_size == len(files[name]) for name in files)
    return {name: info.hash for name, info in infos.items()}


@pytest.fixture(scope="module")
def uploaded(server) -> dict[str, str]:
    """Name -> xet file hash of FILES; SIMILAR goes in a second commit, so it dedups across xorbs."""
    endpoint, _, _ = server
    first = _upload(endpoint, {name: data for name, data in FILES.items() if name != "similar"})
    return {**first, **_upload(endpoint, {"similar": FILES["similar"]})}


@pytest.mark.parametrize(
    ("config", "api"),
    [
        (None, "v2"),
        ({"client.reconstruction_api_version": 1}, "v1"),
        ({"client.enable_multirange_fetching": True}, "v2"),
    ],
    ids=["default", "v1", "multirange"],
)
def test_upload_then_download_roundtrip(server, uploaded, tmp_path, config, api):
    endpoint, _, log = server
    del log[:]
    session = (
        _session() if config is None else hf_xet.XetSession(hf_xet.XetConfig().with_config(config))
    )
    expiry = int(time.time()) + 3600
    with session.new_file_download_group(
        endpoint=endpoint, token="r", token_expiry_unix_secs=expiry
    ) as group:
        for name, file_hash in uploaded.items():
            info = hf_xet.XetFileInfo(file_hash, len(FILES[name]))
            group.start_download_file(info, str(tmp_path / name))
    for name, data in FILES.items():
        assert (tmp_path / name).read_bytes() == data, name
    assert {p.split("/")[2] for _, p in log if "/reconstructions/" in p} == {api}


def test_store_reads_files(server, uploaded):
    _, store, _ = server
    for name, data in FILES.items():
        if not data and not store.has_file(uploaded[name]):
            continue  # the client may not describe the empty file in any shard
        assert store.has_file(uploaded[name])
        assert store.file_size(uploaded[name]) == len(data)
        assert store.read_file(uploaded[name]) == data, name
        assert CasStore(store.root).read_file(uploaded[name]) == data  # a restart sees it too
    assert not store.has_file("1" * 64)
    with pytest.raises(KeyError):
        store.read_file("1" * 64)


def test_similar_file_is_deduplicated(server, uploaded):
    _, store, _ = server
    big, similar = store.terms(uploaded["big"]), store.terms(uploaded["similar"])
    assert {t.xorb for t in similar} & {t.xorb for t in big}
    assert {t.xorb for t in similar} - {t.xorb for t in big}  # the new middle went into a new xorb


def test_reconstruction_ranges_and_errors(server, uploaded):
    endpoint, store, _ = server
    h = uploaded["big"]
    auth = {"Authorization": "Bearer r"}
    r = httpx.get(
        f"{endpoint}/v1/reconstructions/{h}", headers={**auth, "Range": "bytes=1000000-1000099"}
    )
    assert r.status_code == 200
    body = r.json()
    assert body["terms"] and 0 < body["offset_into_first_range"] < 1000000
    # Fetch the first term's bytes through its fetch URL, exactly as a client would.
    term = body["terms"][0]
    info = next(f for f in body["fetch_info"][term["hash"]] if f["range"] == term["range"])
    rng = info["url_range"]
    data = httpx.get(info["url"], headers={"Range": f"bytes={rng['start']}-{rng['end']}"})
    assert data.status_code == 206 and len(data.content) == rng["end"] - rng["start"] + 1
    assert httpx.get(info["url"].split("?")[0], headers={"Range": "bytes=0-7"}).status_code == 401
    r = httpx.get(
        f"{endpoint}/v1/reconstructions/{h}", headers={**auth, "Range": f"bytes={len(BIG)}-"}
    )
    assert r.status_code == 416
    assert httpx.get(f"{endpoint}/v1/reconstructions/{'1' * 64}", headers=auth).status_code == 404
    assert httpx.get(f"{endpoint}/v1/reconstructions/not-a-hash", headers=auth).status_code == 400
    empty = httpx.get(f"{endpoint}/v1/reconstructions/{uploaded['empty']}", headers=auth)
    assert empty.status_code == 200 and empty.json()["terms"] == []
    assert (
        httpx.get(f"{endpoint}/v1/chunks/default-merkledb/{'1' * 64}", headers=auth).status_code
        == 404
    )


def test_auth(server):
    endpoint, _, _ = server
    url = f"{endpoint}/v1/xorbs/default/{'1' * 64}"
    assert httpx.post(url, content=b"x", headers={"Authorization": "Bearer r"}).status_code == 403
    assert httpx.post(url, content=b"x").status_code == 401
    assert (
        httpx.post(
            f"{endpoint}/v1/shards", content=b"x", headers={"Authorization": "Bearer r"}
        ).status_code
        == 403
    )
    assert httpx.get(f"{endpoint}/v1/reconstructions/{'1' * 64}").status_code == 401
    assert (
        httpx.get(
            f"{endpoint}/v1/reconstructions/{'1' * 64}", headers={"Authorization": "Bearer x"}
        ).status_code
        == 401
    )


def test_hash_to_str():
    assert (
        hash_to_str(bytes(range(32)))
        == "07060504030201000f0e0d0c0b0a09081716151413121110" + "1f1e1d1c1b1a1918"
    )


def test_compression_schemes_seen(server, uploaded):
    _, store, _ = server
    xorbs = {t.xorb for h in uploaded.values() for t in store.terms(h)}
    assert {c.scheme for x in xorbs for c in store.xorb_chunks(x)} == {
        0,
        1,
        2,
    }  # none, LZ4, BG4-LZ4


def _fetch_range(endpoint: str, file_hash: str, start: int, end: int) -> bytes:
    """Bytes [start, end] of a file, following a V1 reconstruction as download-protocol.md says."""
    auth = {"Authorization": "Bearer r", "Range": f"bytes={start}-{end}"}
    body = (
        httpx.get(f"{endpoint}/v1/reconstructions/{file_hash}", headers=auth)
        .raise_for_status()
        .json()
    )
    out = bytearray()
    for term in body["terms"]:
        info = next(f for f in body["fetch_info"][term["hash"]] if f["range"] == term["range"])
        rng = info["url_range"]
        data = httpx.get(
            info["url"], headers={"Range": f"bytes={rng['start']}-{rng['end']}"}
        ).content
        part = b"".join(decode_chunk(data, c) for c in parse_chunks(data))
        assert len(part) == term["unpacked_length"]
        out += part
    return bytes(out[body["offset_into_first_range"] :][: end - start + 1])


@pytest.mark.parametrize("name", ["similar", "text", "floats", "small"])
def test_range_reconstructions(server, uploaded, name):
    endpoint, _, _ = server
    data = FILES[name]
    for start, end in [
        (0, len(data) - 1),
        (1, 2),
        (len(data) // 3, len(data) // 2),
        (len(data) - 5, len(data) + 99),
    ]:
        assert _fetch_range(endpoint, uploaded[name], start, end) == data[start : end + 1], (
            start,
            end,
        )


def test_reupload_and_bad_uploads(server, uploaded):
    endpoint, store, _ = server
    auth = {"Authorization": "Bearer w"}
    xorb = store.terms(uploaded["small"])[0].xorb
    body = (store.root / "xorbs" / xorb).read_bytes()
    r = httpx.post(f"{endpoint}/v1/xorbs/default/{xorb}", content=body, headers=auth)
    assert r.status_code == 200 and r.json() == {"was_inserted": False}
    assert (
        httpx.post(
            f"{endpoint}/v1/xorbs/default/{'1' * 64}", content=b"\x07junk", headers=auth
        ).status_code
        == 400
    )
    # A shard whose only file points at a xorb nobody uploaded (shard.md layout, no footer).
    header = b"\0" * 32 + struct.pack("<QQ", 2, 0)
    file_info = (
        b"\x11" * 32
        + struct.pack("<IIQ", 0, 1, 0)
        + b"\x22" * 32
        + struct.pack("<IIII", 0, 10, 0, 1)
    )
    shard = header + file_info + b"\xff" * 32 + b"\0" * 16 + b"\xff" * 32 + b"\0" * 16
    assert httpx.post(f"{endpoint}/v1/shards", content=shard, headers=auth).status_code == 400
    assert (
        httpx.post(f"{endpoint}/v1/shards", content=b"not a shard", headers=auth).status_code == 400
    )
