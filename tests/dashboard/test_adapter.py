"""The dashboard's data layer on an adapter run (``adapter_bucket``: a LoRA adapter published with
the real ``DeltaPublisher(adapter=...)``, followed by LoRA-style replicas): its versions, bytes,
syncs and lag are the adapter's, the run view names the run ("LoRA adapter r=4, alpha 8 ...",
"adapter version"), and public lines never show the base model's local path. A full-weight run
reads as before; a run root that changes kind is named for the run it now holds."""

from __future__ import annotations

import shutil

import pytest

from dashboard.data import BucketReader
from dashboard.view import describe_adapter, public_adapter, public_base_model
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import read_heartbeats
from deltasync.store import Store

from .conftest import ADAPTER_SHAPES, BASE_DIR, LORA_RANK, lora_adapter


def _manifest(uri: str) -> Manifest:
    return Manifest.from_json(Store(uri).read_bytes(MANIFEST_PATH))


def test_adapter_run_figures_are_the_adapters(adapter_bucket, tmp_path):
    uri, _ = adapter_bucket
    manifest, heartbeats = _manifest(uri), read_heartbeats(Store(uri))
    assert set(manifest.model.shapes()) == set(ADAPTER_SHAPES)  # only the adapter is published
    now = max(hb.updated_at for hb in heartbeats.values()) + 1.0
    view = BucketReader(uri).read(now=now)

    assert view.state == "ok", view.message
    assert view.adapter == manifest.adapter and view.adapter.kind == "lora"
    assert view.trainer_version == manifest.latest.version == 5
    # bytes per adapter version: the manifest's payloads, anchors marked
    payloads = view.frame("payloads")
    want = {(v.version, "delta", v.delta.bytes) for v in manifest.versions if v.delta}
    want |= {(v.version, "anchor", v.anchor.bytes) for v in manifest.versions if v.anchor}
    assert set(zip(payloads.version, payloads.kind, payloads.bytes, strict=True)) == want
    assert {"anchor", "delta"} == set(payloads.kind)
    density = view.frame("density").set_index("version")
    total = sum(a * b for a, b in ADAPTER_SHAPES.values())
    assert (density.total == total).all()
    # the replicas' syncs as a LoRA replica reports them: no pause, apply = the adapter load
    syncs = view.frame("syncs")
    records = [(rid, r) for rid, hb in heartbeats.items() for r in hb.recent]
    assert len(syncs) == len(records) > 0
    assert set(syncs.apply_path) == {"lora"} and (syncs.paused_s == 0).all()
    by_key = {(row.replica, row.version): row for row in syncs.itertuples()}
    for rid, r in records:
        assert by_key[(rid, r.version)].apply_s == pytest.approx(r.apply_s)
    # held adapter version and lag, as for weights
    status = view.frame("status").set_index("replica")
    for rid, hb in heartbeats.items():
        assert status.loc[rid, "held_version"] == hb.held_version
        assert status.loc[rid, "lag_versions"] == manifest.latest.version - hb.held_version
        assert status.loc[rid, "apply_path"] == "lora"
    lag = view.frame("lag")
    assert lag[(lag.replica == "r1") & (lag.source == "sync")].lag_versions.max() >= 1

    # named as an adapter run; the public lines leave out the base model's local path
    digest8 = manifest.adapter.base_digest[:8]
    path = str(tmp_path / BASE_DIR)
    assert view.public == "6 adapter version(s) in the manifest"
    public = view.markdown(public=True)
    assert "trainer adapter version **5**" in public
    assert f"LoRA adapter r={LORA_RANK}, alpha 8 (base {digest8})" in public
    assert "qwen3-base" not in public and str(tmp_path) not in public
    private = view.markdown()
    assert f"LoRA adapter r={LORA_RANK}, alpha 8 on `{path}` (base {digest8})" in private
    api = public_adapter(view.adapter)
    assert (api["r"], api["lora_alpha"], api["base_model"]) == (LORA_RANK, 8, None)
    assert api["target_modules"] == ["q_proj", "up_proj"]
    assert str(tmp_path) not in repr(api)  # nor the PEFT config's base_model_name_or_path


def test_full_weight_run_reads_as_before(recorded_bucket):
    uri, _ = recorded_bucket
    view = BucketReader(uri).read()
    assert view.adapter is None and public_adapter(view.adapter) is None
    assert view.public == "8 version(s) in the manifest"
    for text in (view.markdown(public=True), view.markdown()):
        assert "trainer version **7**" in text
        assert "adapter" not in text.lower()


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("tiny-qwen3", True),
        ("meta-llama/Llama-3.2-1B-Instruct", True),
        ("/srv/models/qwen3", False),
        ("~/models/qwen3", False),
        ("./qwen3", False),
        ("../qwen3", False),
        ("models/../etc", False),
        ("a/b/c", False),
        ("C:\\models\\qwen3", False),
        ("file:///srv/qwen3", False),
        ("", False),
    ],
)
def test_public_pages_show_a_model_name_never_a_path(name, shown):
    assert public_base_model(name) == (name if shown else None)
    adapter = lora_adapter(name)
    public = describe_adapter(adapter, public=True)
    assert (f" on `{name}` " in public) == shown
    assert public.startswith(f"LoRA adapter r={LORA_RANK}, alpha 8")
    assert public.endswith(f"(base {adapter.base_digest[:8]})")


def test_a_run_root_that_changes_kind_is_named_for_its_run(tmp_path, recorded_bucket, run_recorder):
    """The same reader, its run root replaced by an adapter run and then by a full-weight run
    again: each poll names the run the root holds now (the history starts over)."""
    full_uri, _ = recorded_bucket
    adapter_uri = str(tmp_path / "adapter-run")
    rec = run_recorder(adapter_uri, adapter=lora_adapter("Qwen/Qwen3-0.6B"), run_id="lora-2")
    for _ in range(2):
        rec.step()
    rec.close()
    root = tmp_path / "root"
    shutil.copytree(full_uri, root)
    reader = BucketReader(str(root))
    assert reader.read().adapter is None
    shutil.rmtree(root)
    shutil.copytree(adapter_uri, root)
    view = reader.read()
    assert view.run_id == "lora-2" and view.adapter is not None
    assert view.frame("payloads").version.tolist() == [0, 1]  # the full run's versions are gone
    assert "LoRA adapter r=4, alpha 8 on `Qwen/Qwen3-0.6B`" in view.markdown(public=True)
    shutil.rmtree(root)
    shutil.copytree(full_uri, root)
    view = reader.read()
    assert view.adapter is None and "trainer version **7**" in view.markdown(public=True)
