"""``deltasync.history.VersionHistory``: a trainer that follows its own bucket can rebuild each of
the last ``keep`` versions bit for bit (the weights that generated a stale sample), with anchors
among them, from one held copy and the old bits of what each delta changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltasync.bf16 import digest, to_bf16_bits
from deltasync.errors import VersionNotKeptError
from deltasync.history import VersionHistory
from deltasync.manifest import model_digest
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.subscriber import DeltaSubscriber

SHAPES = {"embed.weight": (64, 16), "layer.0.weight": (16, 16), "layer.0.bias": (16,)}


def _step(params: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """A stand-in for an optimizer step: a few elements of each tensor move by a few bf16 ulps."""
    with torch.no_grad():
        for p in params.values():
            flat = p.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 20),), generator=gen)
            flat[idx] += 0.05 * torch.randn(idx.shape, generator=gen)


def _bits(params: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: to_bf16_bits(p).copy() for n, p in params.items()}


@pytest.fixture()
def run(tmp_path):
    """A publisher on a local bucket (an anchor every 4 versions) and ``publish()``: one step,
    one version; returns ``(store uri, publish, published bits by version)``."""
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    uri = str(tmp_path / "bucket")
    pub = DeltaPublisher(uri, run_id="h", config=PublisherConfig(anchor_every=4))
    published: dict[int, dict[str, np.ndarray]] = {}

    def publish() -> int:
        if published:
            _step(params, gen)
        v = pub.publish(params.items(), step=len(published))
        pub.flush()  # each version committed before the next
        published[v] = _bits(params)
        return v

    yield uri, publish, published
    pub.close()


def _manifest_digest(uri: str, version: int) -> str:
    sub = DeltaSubscriber(uri)
    try:
        return sub.read_manifest().entry(version).digest
    finally:
        sub.close()


def test_each_kept_version_is_rebuilt_bit_for_bit(run):
    uri, publish, published = run
    history = VersionHistory(DeltaSubscriber(uri), keep=3)
    for _ in range(10):  # v0..v9, some of them anchors (each also a delta but v0)
        publish()
        history.update()
    assert history.versions() == [6, 7, 8, 9]  # the newest and the 3 before it
    newest = {n: t.copy() for n, t in history.held.tensors.items()}
    for v in history.versions():
        rebuilt = history.weights_at(v)
        for name, bits in published[v].items():
            assert np.array_equal(rebuilt[name], bits), (v, name)  # bit for bit
        assert model_digest({n: digest(t) for n, t in rebuilt.items()}) == _manifest_digest(uri, v)
    for name, bits in newest.items():  # rebuilding leaves the held newest version untouched
        assert np.array_equal(history.held.tensors[name], bits)
    assert 0 < history.nbytes() < sum(b.nbytes for b in newest.values()) * 3
    with pytest.raises(VersionNotKeptError, match="can rebuild \\[6, 7, 8, 9\\]"):
        history.weights_at(5)
    with pytest.raises(VersionNotKeptError):
        history.weights_at(10)  # not published yet


def test_a_history_that_joins_late_keeps_only_what_deltas_reached(run):
    uri, publish, published = run
    for _ in range(6):  # v0..v5
        publish()
    sub = DeltaSubscriber(uri)
    anchor = max(v.version for v in sub.read_manifest().versions if v.anchor is not None)
    history = VersionHistory(sub, keep=4)
    assert history.update() == 5  # the newest anchor, then the deltas after it
    assert anchor < 5 and history.versions() == list(range(anchor, 6))
    publish()
    publish()  # v6, v7 followed by delta
    history.update()
    assert history.versions() == list(range(max(anchor, 3), 8))
    for v in history.versions():
        rebuilt = history.weights_at(v)
        assert all(np.array_equal(rebuilt[n], b) for n, b in published[v].items())
    with pytest.raises(ValueError, match="keep"):
        VersionHistory(DeltaSubscriber(uri), keep=-1)


def test_a_damaged_delta_is_refused_and_the_history_starts_over_from_the_anchor(tmp_path):
    """The publisher's delta of an anchored version is damaged in the bucket (as ``make e2e``
    does): the update refuses it and forgets what it held; the next update takes the anchor."""
    from deltasync.errors import DeltaCorruptError

    gen = torch.Generator().manual_seed(1)
    params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    uri = str(tmp_path / "bucket")
    pub = DeltaPublisher(uri, run_id="h", config=PublisherConfig(anchor_every=3))
    store = pub.store

    def damage(entry):
        if entry.version == 3:  # an anchor and a delta
            path = entry.delta.files[0].path
            data = bytearray(store.read_bytes(path))
            data[len(data) // 2] ^= 0xFF
            store.write_bytes(path, bytes(data))

    pub.before_commit = damage
    history = VersionHistory(DeltaSubscriber(uri), keep=3)
    for v in range(4):
        if v:
            _step(params, gen)
        pub.publish(params.items(), step=v)
        pub.flush()
        if v < 3:
            history.update()
    assert history.versions() == [0, 1, 2]
    with pytest.raises(DeltaCorruptError):
        history.update()
    assert history.versions() == []  # forgotten: a step may have half-applied
    assert history.update() == 3  # through v3's anchor
    assert np.array_equal(history.weights_at(3)["layer.0.bias"], _bits(params)["layer.0.bias"])
    pub.close()
