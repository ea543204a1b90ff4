"""Manifest payload paths must match the protocol's pattern: a manifest naming any other file
(``..``, absolute, backslashes, other folders, another version's folder) is a corrupt manifest,
refused before any file is opened."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from deltasync.errors import ManifestError
from deltasync.manifest import (
    MANIFEST_PATH,
    FileRef,
    Manifest,
    anchor_dir,
    delta_dir,
    part_name,
)
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.store import Store
from deltasync.subscriber import DeltaSubscriber

BAD_PATHS = [
    "../../../etc/hostname",
    "/etc/hostname",
    "anchors/v0000000000/../../../etc/hostname",
    "anchors/v0000000000/part-0000.safetensors/..",
    "anchors\\v0000000000\\part-0000.safetensors",
    "anchors/v0000000000//part-0000.safetensors",
    "./anchors/v0000000000/part-0000.safetensors",
    "",
    "manifest.json",
    "writer.json",
    "replicas/r0.json",
    "anchors/v0000000000/part-0000.safetensors\n",
    "anchors/v0000000000/part-0000.bin",
    "anchors/v0/part-0000.safetensors",
    "other/v0000000000/part-0000.safetensors",
    "hf://buckets/x/y/anchors/v0000000000/part-0000.safetensors",
    "anchors/v0000000000/part-0000.safetensors?x=1",
    "anchors/v0000000000/part-0000%2e.safetensors",
    "ANCHORS/v0000000000/part-0000.safetensors",
]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_file_ref_refuses_paths_outside_the_protocol(path):
    with pytest.raises(ValidationError, match="protocol's pattern"):
        FileRef(path=path, bytes=1, digest="0" * 16)


@pytest.mark.parametrize(
    "path",
    [
        f"{anchor_dir(0)}/{part_name(0)}",
        f"{delta_dir(7)}/{part_name(12)}",
        f"{delta_dir(12_345_678_901)}/{part_name(10_000)}",
    ],
)
def test_file_ref_accepts_what_the_publisher_writes(path):
    assert FileRef(path=path, bytes=1, digest="0" * 16).path == path


def _published(bucket: str, trainer) -> bytes:
    pub = DeltaPublisher(bucket, "run", config=PublisherConfig(anchor_every=2))
    for i in range(2):
        trainer.step()
        pub.publish(trainer.named(), step=i)
        pub.flush()
    pub.close()
    return Store(bucket).read_bytes(MANIFEST_PATH)


def _rewrite_first_path(data: bytes, new_path: str) -> bytes:
    doc = json.loads(data)
    entry = doc["versions"][-1]
    payload = entry["delta"] or entry["anchor"]
    payload["files"][0]["path"] = new_path
    return json.dumps(doc).encode()


@pytest.mark.parametrize("bad", ["../../../etc/hostname", "/etc/hostname", ""])
def test_subscriber_reports_a_manifest_with_a_bad_path_as_corrupt(bucket, trainer, bad):
    data = _published(bucket, trainer)
    assert Manifest.from_json(data).latest is not None  # the genuine manifest is valid
    store = Store(bucket)
    store.write_bytes(MANIFEST_PATH, _rewrite_first_path(data, bad))
    with pytest.raises(ManifestError, match="protocol's pattern"):
        DeltaSubscriber(bucket).read_manifest()


def test_a_file_under_another_versions_folder_is_refused(bucket, trainer):
    data = _published(bucket, trainer)
    latest = Manifest.from_json(data).latest
    kind = "delta" if latest.delta is not None else "anchor"
    other = (delta_dir if kind == "delta" else anchor_dir)(latest.version + 1)
    store = Store(bucket)
    store.write_bytes(MANIFEST_PATH, _rewrite_first_path(data, f"{other}/{part_name(0)}"))
    with pytest.raises(ManifestError, match="is not under"):
        DeltaSubscriber(bucket).read_manifest()
