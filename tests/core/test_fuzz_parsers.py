"""Fuzzing every parser a reader runs on downloaded bytes: a delta blob (``codec.decode``), a
payload part (``deltafile.read_part``), ``manifest.json`` (``Manifest.from_json``) and replica
heartbeats (``status.read_heartbeats``).

Inputs start from valid bytes the project's own encoder and publisher produced, then get bytes
flipped, set, inserted, deleted, truncated or overwritten with boundary integers (where length
and count fields live), or are rebuilt with their structure changed: a blob's class table with
other counts, modes and parameters; JSON trees (part headers, the parts' ``tensors`` metadata,
manifests, heartbeats) with a node replaced by arbitrary JSON (huge ints, NaN, wrong types), a
key dropped, or a key added. Each parser must return a result or raise only its declared error
(``DeltaCorruptError``, ``ManifestError``; a heartbeat that does not parse is skipped with a
warning that names its file, the others still returned), and stay within a memory budget
measured with tracemalloc (which sees numpy's and the numba kernels' allocations): a decode
within a small multiple of the tensor's own bytes, the other parsers within a small multiple of
their input. Named cases pin malformations that used to escape as AttributeError, TypeError or
KeyError (a ``tensors`` entry that is not an object, non-int counts, missing keys) or as a bare
pydantic error (manifests), and the hostile 314-byte blob that claimed 400k coded elements in
each of 256 classes (the decoder allocated 781 MiB before refusing it).
"""

from __future__ import annotations

import functools
import json
import logging
import struct
import tracemalloc
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync import codec, deltafile, kernels
from deltasync.bf16 import from_order_key, order_key
from deltasync.errors import DeltaCorruptError, ManifestError
from deltasync.manifest import MANIFEST_PATH, AdapterInfo, Manifest
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.status import ReplicaHeartbeat, SyncRecord, read_heartbeats, write_heartbeat
from deltasync.store import Store

FUZZ = settings(
    max_examples=500,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
KIB = 1024


# --- the valid inputs: made by the project's own encoder and publisher ------------------------
@functools.cache
def blobs() -> list[tuple[np.ndarray, bytes]]:
    """(base bits, blob) pairs: sizes 1 to 3000, densities from one change to every element (the
    unchanged-ranks mode), ulp steps and arbitrary new bits (escaped values)."""
    out = []
    rng = np.random.default_rng(54)
    for n, density, arbitrary in [
        (1, 1.0, True),
        (37, 0.1, False),
        (500, 0.02, False),
        (500, 0.9, True),
        (3000, 0.005, False),
        (3000, 0.3, True),
        (3000, 1.0, False),
    ]:
        base = from_order_key(rng.integers(0x8000 - 400, 0x8000 + 400, n).astype(np.uint16))
        base[::97] = rng.integers(0, 2**16, base[::97].shape)  # other exponent classes too
        step = from_order_key(order_key(base) + np.uint16(1))  # one ulp up
        repl = rng.integers(0, 2**16, n).astype(np.uint16) if arbitrary else step
        new = np.where(rng.random(n) < density, repl, base).astype(np.uint16)
        new[0] = base[0] ^ 1  # at least one change
        out.append((base, codec.encode(codec.diff(base, new), base)))
    return out


@functools.cache
def published() -> dict[str, bytes]:
    """A run published into memory (anchors every 2 versions, two parts per payload): the
    manifest, an anchor part and a delta part, as bytes."""
    rng = np.random.default_rng(7)
    master = {
        "embed.weight": rng.standard_normal((24, 16)) * 0.02,
        "layer.0.q.weight": rng.standard_normal((16, 16)) * 0.02,
        "norm": rng.standard_normal(16),
    }

    def named():
        return [
            (n, (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
            for n, w in master.items()
        ]

    uri = f"memory://fuzz-parsers-{uuid.uuid4().hex[:8]}"
    cfg = PublisherConfig(anchor_every=2, part_bytes=600)
    with DeltaPublisher(uri, config=cfg, run_id="fuzz") as pub:
        for step in range(4):
            for n in master:
                master[n] = master[n] + 3e-3 * rng.standard_normal(master[n].shape)
            pub.publish(named(), step=step)
            pub.flush()
    store = Store(uri)
    data = store.read_bytes(MANIFEST_PATH)
    manifest = Manifest.from_json(data)
    return {
        "manifest": data,
        "anchor": store.read_bytes(manifest.entry(2).anchor.files[0].path),
        "delta": store.read_bytes(manifest.entry(3).delta.files[0].path),
    }


@functools.cache
def manifests() -> list[bytes]:
    """The published manifest, and the same run as an adapter run (``adapter`` set)."""
    m = Manifest.from_json(published()["manifest"])
    peft = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    m.adapter = AdapterInfo(kind="lora", peft_config=peft, base_model="m", base_digest="0" * 16)
    return [published()["manifest"], m.to_json()]


@functools.cache
def heartbeat() -> bytes:
    """A replica's heartbeat with two sync records, as ``write_heartbeat`` writes it."""
    rec = SyncRecord(
        version=3,
        from_version=1,
        kind="chain",
        steps=2,
        bytes=1234,
        fetch_s=0.01,
        decode_s=0.002,
        paused_s=0.001,
        apply_s=0.0005,
        published_at=1.7e9,
        applied_at=1.7e9 + 1,
        apply_path="cpu-dict",
    )
    hb = ReplicaHeartbeat.empty(
        "fuzzed", status="ok", held_version=3, newest_seen=3, url="http://127.0.0.1:8000"
    )
    hb.recent = [rec, rec.model_copy(update={"kind": "delta", "steps": 1})]
    return hb.model_dump_json().encode()


def published_manifest_with(**fields) -> bytes:
    """A minimal manifest (one anchor version) with ``fields`` of its version entry replaced,
    numbers written as given (a str is written bare: ``"1e999"``)."""
    entry = {
        "version": 0,
        "created_at": 1.0,
        "anchor": {
            "files": [
                {"path": "anchors/v0000000000/part-0000.safetensors", "bytes": 1, "digest": "0"}
            ]
        },
        "changed": 0,
        "total": 1,
        "digest": "0",
    }
    entry.update(fields)
    text = json.dumps(
        {
            "schema": "deltasync.manifest/1",
            "run_id": "r",
            "writer_id": "w",
            "model": {"tensors": [{"name": "x", "shape": [1]}], "digest": "0"},
            "versions": [entry],
        }
    )
    for value in fields.values():
        if isinstance(value, str):
            text = text.replace(json.dumps(value), value)
    return text.encode()


# --- mutations --------------------------------------------------------------------------------
BOUNDARY_INTS = [0, 1, 2, 127, 255, 256, 2**16 - 1, 2**31, 2**32 - 1, 400_000, 2**63, 2**64 - 1]


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    """``valid`` with 1 to 4 byte-level edits, half of them within its first 64 bytes (where the
    blob header, the safetensors header length and the JSON's first keys are)."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        size = len(data)
        hi = max(size - 1, 0)
        pos = draw(st.integers(0, min(hi, 63)) | st.integers(0, hi))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "int"]))
        if op == "flip" and size:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and size:
            data[pos] = draw(st.sampled_from([0, 0xFF, 0x7F, 0x80]) | st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
        elif op == "int":  # a length or count field overwritten with a boundary value
            width = draw(st.sampled_from([1, 2, 4, 8]))
            value = draw(st.sampled_from(BOUNDARY_INTS)) % (1 << (8 * width))
            data[pos : pos + width] = value.to_bytes(width, "little")
    return bytes(data)


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 1, 2**31, 2**62, 2**63, 2**64, 10**30, -(10**30)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["", "-1", "1e9", "99999999999999999999", " 7", "+3", "anchor", "delta"])
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
KNOWN_KEYS = [
    "shape", "digest", "changed", "dtype", "data_offsets", "__metadata__", "tensors", "format",
    "kind", "version", "base_version", "part", "parts", "encoding", "run_id", "versions",
    "files", "bytes", "path", "anchor", "delta", "adapter", "replica_id", "recent", "lag_s",
    "updated_at", "gpu_temp_c",
]  # fmt: skip


def mutate_json(draw, tree):
    """``tree`` (a parsed JSON value) with one node replaced by arbitrary JSON, or one of its
    keys or items dropped, or a key or item added; the node is found by a random walk down."""
    if isinstance(tree, dict | list) and tree and draw(st.integers(0, 3)) > 0:
        key = draw(st.sampled_from(sorted(tree) if isinstance(tree, dict) else range(len(tree))))
        tree[key] = mutate_json(draw, tree[key])
        return tree
    action = draw(st.sampled_from(["replace", "drop", "add"]))
    if action == "replace" or not isinstance(tree, dict | list):
        return draw(JSON_VALUES)
    if action == "drop" and tree:
        del tree[
            draw(st.sampled_from(sorted(tree) if isinstance(tree, dict) else range(len(tree))))
        ]
    elif isinstance(tree, dict):
        tree[draw(st.sampled_from(KNOWN_KEYS) | st.text(max_size=8))] = draw(JSON_VALUES)
    else:
        tree.append(draw(JSON_VALUES))
    return tree


def dumps(tree) -> bytes:
    return json.dumps(tree, allow_nan=True).encode()  # NaN/Infinity tokens too: hostile writers


@st.composite
def restructured_json(draw, valid: bytes) -> bytes:
    """A JSON document (manifest, heartbeat) with its tree changed by :func:`mutate_json`."""
    return dumps(mutate_json(draw, json.loads(valid)))


@st.composite
def restructured_part(draw) -> bytes:
    """A published part whose safetensors header or ``tensors`` metadata has a node changed
    (the length prefix kept consistent, or, sometimes, not)."""
    data = published()[draw(st.sampled_from(["anchor", "delta"]))]
    (hlen,) = struct.unpack_from("<Q", data)
    header, body = json.loads(data[8 : 8 + hlen]), data[8 + hlen :]
    if draw(st.booleans()):
        info = mutate_json(draw, json.loads(header["__metadata__"]["tensors"]))
        header["__metadata__"]["tensors"] = json.dumps(info, allow_nan=True)
    else:
        header = mutate_json(draw, header)
    raw = dumps(header)
    length = len(raw) + draw(st.sampled_from([0, 0, 0, -1, 1, 2**40]))
    return struct.pack("<Q", max(length, 0)) + raw + body


@st.composite
def restructured_blob(draw) -> tuple[np.ndarray, bytes]:
    """A blob whose header or class table says other things: counts from 0 to 2**64-1 (near the
    tensor's size, or the 400k of the hostile blob), other modes, k and classes, rows added or
    dropped, another Rice stream, a frame with or without its content size."""
    base, blob = draw(st.sampled_from(blobs()))
    n = base.size
    n_rows, rice_n = codec._HEADER.unpack_from(blob)
    rice = blob[codec._HEADER.size : codec._HEADER.size + rice_n]
    body = zstandard.ZstdDecompressor().decompress(blob[codec._HEADER.size + rice_n :])
    table = np.frombuffer(body, codec._TABLE, count=n_rows).copy()
    rest = body[table.nbytes :]
    counts = st.sampled_from([0, 1, n - 1, n, n + 1, 2 * n, 400_000, 2**63, 2**64 - 1])
    for _ in range(draw(st.integers(1, 3))):
        edit = draw(st.sampled_from(["field", "field", "add", "drop", "rice", "rows"]))
        if edit == "field" and len(table):
            row = draw(st.integers(0, len(table) - 1))
            name = draw(st.sampled_from(["cls", "mode", "k", "n_coded", "n_changed"]))
            wide = name in ("n_coded", "n_changed")
            value = draw(counts | st.integers(0, 2**64 - 1)) if wide else draw(st.integers(0, 255))
            table[name][row] = value
        elif edit == "add":
            extra = np.zeros(draw(st.integers(1, 256)), codec._TABLE)
            extra["cls"] = np.arange(len(extra)) % 256
            extra["mode"] = draw(st.sampled_from([1, 2]))
            extra["n_coded"] = draw(counts)
            table = np.concatenate([table, extra])
        elif edit == "drop" and len(table):
            table = np.delete(table, draw(st.integers(0, len(table) - 1)))
        elif edit == "rice":
            rice = draw(st.binary(max_size=64))
        elif edit == "rows":
            n_rows = draw(st.integers(0, 300))
        if edit != "rows":
            n_rows = len(table)
    frame = zstandard.ZstdCompressor(write_content_size=draw(st.booleans())).compress(
        table.tobytes() + rest
    )
    return base, codec._HEADER.pack(n_rows % 2**32, len(rice)) + rice + frame


# --- the checks: a result, or the declared error, within the memory budget --------------------
@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """The inputs built and the decoder's first calls made (its thread pool started) before
    anything is measured."""
    blobs(), published(), manifests()
    for threads in (1, 3, 3):
        codec.decode(blobs()[-1][1], blobs()[-1][0], threads=threads)


@contextmanager
def peak() -> Iterator[list[int]]:
    """``[bytes]``: the most memory traced above the level at entry, filled in at exit (tracing
    runs only inside, so that generating the examples is not slowed by it)."""
    tracing = tracemalloc.is_tracing()
    if tracing:
        tracemalloc.reset_peak()
    else:
        tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    out = [0]
    try:
        yield out
    finally:
        out[0] = tracemalloc.get_traced_memory()[1] - start
        if not tracing:
            tracemalloc.stop()


def decode_budget(base: np.ndarray) -> int:
    """A valid blob decodes within ~40x the tensor's bytes plus ~40 KiB of per-class tables; the
    rest is room for one-time work (a first call on a new error path)."""
    return 64 * base.nbytes + 1024 * KIB


def check_decode(blob: bytes, base: np.ndarray, threads: int = 1) -> tuple[str, int]:
    """(outcome, peak bytes) of decoding ``blob`` against ``base``."""
    with peak() as used:
        try:
            idx, new = codec.decode(blob, base, threads=threads)
            outcome = "decoded"
        except DeltaCorruptError:
            outcome = "DeltaCorruptError"
    assert used[0] <= decode_budget(base), f"decode used {used[0]} bytes for {base.nbytes}"
    if outcome == "decoded":
        assert idx.dtype == np.int64 and new.dtype == np.uint16 and len(idx) == len(new)
        assert np.all(np.diff(idx) > 0) and (len(idx) == 0 or 0 <= idx[0] <= idx[-1] < base.size)
    return outcome, used[0]


def check_part(data: bytes) -> tuple[str, int]:
    with peak() as used:
        try:
            part = deltafile.read_part(data)
            outcome = "parsed"
        except DeltaCorruptError:
            outcome = "DeltaCorruptError"
    assert used[0] <= 64 * len(data) + 256 * KIB, f"read_part used {used[0]} for {len(data)}"
    if outcome == "parsed":
        assert part.kind in ("anchor", "delta") and 0 <= part.part < part.parts
        for t in part.tensors.values():
            assert all(isinstance(s, int) and s >= 0 for s in t.shape)
            assert isinstance(t.digest, str) and 0 <= t.changed
            assert t.data.dtype == (np.uint16 if part.kind == "anchor" else np.uint8)
    return outcome, used[0]


def check_manifest(data: bytes) -> tuple[str, int]:
    with peak() as used:
        try:
            Manifest.from_json(data)
            outcome = "parsed"
        except ManifestError:
            outcome = "ManifestError"
    assert used[0] <= 64 * len(data) + 1024 * KIB, f"from_json used {used[0]} for {len(data)}"
    return outcome, used[0]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@functools.cache
def heartbeat_store() -> Store:
    """A bucket holding a good heartbeat (``good``) next to the one being fuzzed."""
    store = Store(f"memory://fuzz-heartbeats-{uuid.uuid4().hex[:8]}")
    write_heartbeat(store, ReplicaHeartbeat.empty("good", status="ok"))
    return store


def check_heartbeats(data: bytes) -> tuple[str, int]:
    """Write ``data`` as ``replicas/fuzzed.json`` next to a good heartbeat and read them all:
    the good one always comes back; the fuzzed one comes back when it validates, and is
    otherwise skipped with a log record naming its file and the error."""
    store = heartbeat_store()
    store.write_bytes("replicas/fuzzed.json", data)
    try:
        hb = ReplicaHeartbeat.model_validate_json(data)
    except ValueError:
        hb = None
    logger, records = logging.getLogger("deltasync.status"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)  # a repeated skip is logged at DEBUG (WARNING once)
    try:
        with peak() as used:
            out = read_heartbeats(store)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert used[0] <= 64 * len(data) + 1024 * KIB, f"read_heartbeats used {used[0]}"
    skips = [m for m in records.messages if "replicas/fuzzed.json" in m and "skipped" in m]
    assert "good" in out
    if hb is None:
        assert len(skips) == 1 and set(out) == {"good"}
        return "skipped", used[0]
    assert not skips and hb.replica_id in out
    return "parsed", used[0]


# --- the fuzz tests ---------------------------------------------------------------------------
@settings(FUZZ, max_examples=700)
@given(data=st.data(), threads=st.sampled_from([1, 1, 3]))
def test_decode_of_a_mutated_blob_returns_or_raises_delta_corrupt(data, threads):
    base, blob = data.draw(st.sampled_from(blobs()))
    check_decode(data.draw(mutated(blob)), base, threads)


@settings(FUZZ, max_examples=700)
@given(case=restructured_blob())
def test_decode_of_a_blob_with_other_counts_returns_or_raises_delta_corrupt(case):
    base, blob = case
    check_decode(blob, base)


@settings(FUZZ, max_examples=700)
@given(data=st.data())
def test_read_part_of_mutated_bytes_returns_or_raises_delta_corrupt(data):
    valid = published()[data.draw(st.sampled_from(["anchor", "delta"]))]
    check_part(data.draw(mutated(valid)))


@settings(FUZZ, max_examples=700)
@given(part=restructured_part())
def test_read_part_of_malformed_metadata_raises_delta_corrupt(part):
    check_part(part)


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_manifest_of_mutated_bytes_parses_or_raises_manifest_error(data):
    check_manifest(data.draw(mutated(data.draw(st.sampled_from(manifests())))))


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_manifest_of_another_structure_parses_or_raises_manifest_error(data):
    check_manifest(data.draw(restructured_json(data.draw(st.sampled_from(manifests())))))


@settings(FUZZ, max_examples=350)
@given(data=st.data())
def test_a_mutated_heartbeat_is_read_or_skipped_and_the_others_returned(data):
    check_heartbeats(data.draw(mutated(heartbeat())))


@settings(FUZZ, max_examples=350)
@given(data=st.data())
def test_a_heartbeat_of_another_structure_is_read_or_skipped(data):
    check_heartbeats(data.draw(restructured_json(heartbeat())))


# --- named malformations: each one raised AttributeError, TypeError or KeyError before ---------
def _meta_edit(edit):
    """A delta part's bytes with ``edit(metadata)`` applied to its ``__metadata__``."""

    def make() -> bytes:
        data = published()["delta"]
        (hlen,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8 : 8 + hlen])
        edit(header["__metadata__"])
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + data[8 + hlen :]

    return make


def _tensors_edit(edit):
    def apply(meta):
        info = json.loads(meta["tensors"])
        for name in info:
            edit(info, name)
        meta["tensors"] = json.dumps(info)

    return _meta_edit(apply)


@pytest.mark.parametrize(
    "make",
    [
        _tensors_edit(lambda info, n: info.update({n: 7})),  # an entry that is not an object
        _tensors_edit(lambda info, n: info[n].pop("shape")),
        _tensors_edit(lambda info, n: info[n].update(shape=[-3, 4])),
        _tensors_edit(lambda info, n: info[n].update(shape=[2**40, 2**40])),
        _tensors_edit(lambda info, n: info[n].update(shape=[1] * 100)),
        _tensors_edit(lambda info, n: info[n].update(shape="16")),
        _tensors_edit(lambda info, n: info[n].update(changed=1.5)),
        _tensors_edit(lambda info, n: info[n].update(changed="3")),
        _tensors_edit(lambda info, n: info[n].pop("digest")),
        _meta_edit(lambda meta: meta.update(tensors="[" * 100_000)),
        _meta_edit(lambda meta: meta.update(tensors="[1, 2]")),
        _meta_edit(lambda meta: meta.update(version=7)),
        _meta_edit(lambda meta: meta.update(version="-1")),
        _meta_edit(lambda meta: meta.update(part="2", parts="2")),
        _meta_edit(lambda meta: meta.clear() or meta.update(format="deltasync/1")),
    ],
)
def test_each_malformed_part_raises_delta_corrupt(make):
    with pytest.raises(DeltaCorruptError):
        deltafile.read_part(make())


@pytest.mark.parametrize(
    "data",
    [
        b"[]",
        b"\xff\xfe",
        b"{" * 50_000,
        b'{"schema": "deltasync.manifest/1"}',
        published_manifest_with(version=2**70),
        published_manifest_with(created_at="1e999"),
    ],
)
def test_each_malformed_manifest_raises_manifest_error_that_is_a_value_error(data):
    with pytest.raises(ManifestError) as caught:
        Manifest.from_json(data)
    assert isinstance(caught.value, ValueError)  # callers that catch ValueError still do


# --- the hostile blob of issue 54, and the kernel's own guard ---------------------------------
def hostile_blob(n_coded: int = 400_000) -> bytes:
    """Every one of the 256 classes in the unchanged-ranks mode with ``n_coded`` coded ranks
    (no changes), and no Rice stream at all: 314 bytes (zstandard 0.25, level 19)."""
    table = np.zeros(256, codec._TABLE)
    table["cls"] = np.arange(256)
    table["mode"] = codec.MODE_UNCHANGED
    table["n_coded"] = n_coded
    frame = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(table.tobytes())
    return codec._HEADER.pack(256, 0) + frame


def test_the_hostile_blob_is_refused_before_anything_is_sized_by_it():
    """A 314-byte blob claiming 400k coded elements in each of 256 classes (102.4M in all) of a
    400k-element tensor: refused naming both counts, using less than the tensor's own 0.8 MB
    (before the count checks the decoder allocated 781 MiB of gaps, then refused it)."""
    base = np.full(400_000, 0x3F80, np.uint16)
    blob = hostile_blob()
    assert len(blob) < 400
    with peak() as used, pytest.raises(DeltaCorruptError, match="102400000 elements.*400000"):
        codec.decode(blob, base)
    assert used[0] < base.nbytes
    # within the tensor's count, but more positions than the (empty) Rice stream can hold
    one = np.zeros(1, codec._TABLE)
    one[0] = (127, codec.MODE_UNCHANGED, 0, 399_999, 1)
    frame = zstandard.ZstdCompressor().compress(one.tobytes() + b"\0")
    with peak() as used, pytest.raises(DeltaCorruptError, match="399999 position bits"):
        codec.decode(codec._HEADER.pack(1, 0) + frame, base)
    assert used[0] < base.nbytes


@pytest.mark.parametrize("counts", [[400_000] * 256, [-1], [2**62, 2**62]])
def test_the_rice_decoder_refuses_counts_its_stream_cannot_hold_before_allocating(counts):
    counts = np.array(counts, np.int64)
    with peak() as used:
        stream = np.frombuffer(bytes(3), np.uint8)  # read-only, as the codec passes it
        gaps, status = kernels.rice_decode(stream, counts, np.zeros(len(counts), np.uint8))
    assert status == 1 and gaps.size == 0 and used[0] < 64 * KIB
