"""The bucket's wire JSON, pinned: ``manifest.json`` and the safetensors metadata of an anchor part
and a delta part, for a fixed two-tensor model published twice (an anchor, then a delta).

Any change to a field name, a type, an encoding or the order of keys fails here: a change to
the wire format is a protocol change (docs/PROTOCOL.md) and gets new golden files on purpose
(``DELTASYNC_UPDATE_GOLDEN=1 pytest tests/core/test_wire_golden.py``). Fields that vary from run
to run (times, the writer id, also where payload file names carry it, timings, payload file
digests: safetensors orders its metadata map differently on each write) are replaced by
placeholders before the comparison; keys are sorted.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.publisher import DeltaPublisher
from deltasync.store import Store

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("DELTASYNC_UPDATE_GOLDEN") == "1"


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((4, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    b = np.array([0x3F80, 0x4000, 0x0000, 0xBF80], np.uint16)  # 1, 2, 0, -1 in bf16
    return {"layer.weight": w, "layer.bias": b}


def _publish(root: Path) -> Store:
    store = Store(str(root))
    model = _model()
    with DeltaPublisher(store, run_id="golden-run") as pub:
        pub.publish(list(model.items()), step=0)
        pub.flush()
        model["layer.weight"][1, 2] ^= 1  # one ulp: a sparse delta
        model["layer.bias"][3] += 1
        pub.publish(list(model.items()), step=1)
    return store


def _header(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def _normalized_manifest(store: Store) -> dict:
    m = json.loads(Manifest.from_json(store.read_bytes(MANIFEST_PATH)).to_json())
    writer, m["writer_id"] = m["writer_id"], "<writer>"
    m["updated_at"] = 0.0
    for v in m["versions"]:
        v["created_at"] = 0.0
        v["timings_s"] = {}
        for kind in ("anchor", "delta"):
            for f in (v[kind] or {}).get("files", []):
                # safetensors writes its metadata map in no fixed order, so a file's bytes (and
                # digest) vary between writes of the same content; its size does not
                f["digest"] = "<xxh3-64 of the file>"
                f["path"] = f["path"].replace(f"-{writer}.", "-<writer>.")
    return m


def _check(name: str, value: dict) -> None:
    path = GOLDEN / name
    text = json.dumps(value, indent=1, sort_keys=True) + "\n"
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), (
        f"{name}: the wire JSON changed; if that is intended, it is a protocol change: update "
        "docs/PROTOCOL.md and run DELTASYNC_UPDATE_GOLDEN=1 pytest tests/core/test_wire_golden.py"
    )


def test_manifest_json_is_pinned(tmp_path):
    _check("manifest.json", _normalized_manifest(_publish(tmp_path / "bucket")))


def test_safetensors_metadata_of_anchor_and_delta_parts_is_pinned(tmp_path):
    store = _publish(tmp_path / "bucket")
    manifest = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    anchor, delta = manifest.versions[0].anchor, manifest.versions[1].delta
    _check("anchor-part-header.json", _header(store.read_bytes(anchor.files[0].path)))
    _check("delta-part-header.json", _header(store.read_bytes(delta.files[0].path)))


def test_the_golden_manifest_still_parses():
    """Readers of this version accept what the golden file pins (not only what they write)."""
    text = (GOLDEN / "manifest.json").read_text().replace("-<writer>.", "-5f0c9e2a71b4.")
    m = Manifest.model_validate_json(text)
    assert [v.version for v in m.versions] == [0, 1] and m.versions[1].base_version == 0
