"""The publisher's snapshot: the diff on the tensors' own device equals the host diff bit for bit;
coalescing composes changes; changes found elsewhere (``publish_changes``) give the same bucket;
the replica decodes tensors on several threads, all or nothing. Tests marked ``gpu`` run the
device path on a CUDA GPU."""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync import codec, deltafile
from deltasync.errors import DeltaCorruptError, ModelMismatchError
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.snapshot import Snapshot, compose, diff_on_device
from deltasync.store import open_store
from deltasync.subscriber import DeltaSubscriber, HeldWeights

SPECIAL = np.array([0x7FC0, 0x7FC1, 0xFFC3, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001], np.uint16)


def random_pair(rng, n, density):
    """Two bf16 bit arrays that differ at about ``density`` of n positions, specials included."""
    base = rng.integers(0, 2**16, n, dtype=np.uint16)
    base[: len(SPECIAL)] = SPECIAL
    new = base.copy()
    where = rng.random(n) < density
    new[where] = rng.integers(0, 2**16, int(where.sum()), dtype=np.uint16)
    new[1] = 0x7FC0  # one NaN payload becomes another: a change in bits
    new[5] = 0x0000  # -0.0 becomes +0.0: a change in bits
    return base, new


def as_torch(bits: np.ndarray, device="cpu") -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).to(device)


def assert_same_change(a: codec.TensorChange, b: codec.TensorChange):
    assert a.idx.dtype == b.idx.dtype == np.int64
    assert a.old_bits.dtype == b.old_bits.dtype == np.uint16
    assert np.array_equal(a.idx, b.idx)
    assert np.array_equal(a.old_bits, b.old_bits)
    assert np.array_equal(a.new_bits, b.new_bits)


def check_device_diff(device):
    rng = np.random.default_rng(7)
    for n, density in [(1, 1.0), (1000, 0.0), (4099, 0.01), (70_000, 0.3)]:
        base, new = random_pair(rng, n, density) if n > 8 else (SPECIAL[:n], SPECIAL[:n][::-1])
        held = as_torch(base, device).view(torch.int16).reshape(-1).clone()
        got = diff_on_device(held, as_torch(new, device).reshape(-1))
        assert_same_change(got, codec.diff(base, new))
        # the held bits advanced to the new ones
        assert np.array_equal(held.cpu().numpy().view(np.uint16), new)
    # a float32 master is cast with round-to-nearest-even on the device, as on the host
    master = torch.randn(513, 7, generator=torch.Generator().manual_seed(1))
    held = torch.zeros(513 * 7, dtype=torch.int16, device=device)
    from deltasync.bf16 import to_bf16_bits

    got = diff_on_device(held, master.to(device))
    want = codec.diff(np.zeros(513 * 7, np.uint16), to_bf16_bits(master).reshape(-1))
    assert_same_change(got, want)


def test_device_diff_equals_host_diff_on_cpu_torch():
    check_device_diff("cpu")


@pytest.mark.gpu
def test_device_diff_equals_host_diff_on_cuda():
    check_device_diff("cuda")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 300), st.floats(0, 1), st.floats(0, 1))
def test_compose_equals_the_direct_diff(seed, n, d1, d2):
    rng = np.random.default_rng(seed)
    a, b = random_pair(rng, n, d1) if n > 8 else (SPECIAL[:n], SPECIAL[:n][::-1])
    c = b.copy()
    where = rng.random(n) < d2
    c[where] = a[where] if seed % 2 else rng.integers(0, 2**16, int(where.sum()), np.uint16)
    assert_same_change(compose(codec.diff(a, b), codec.diff(b, c)), codec.diff(a, c))


class Model:
    """float32 master weights stepped by small updates, as torch tensors on one device."""

    def __init__(self, device="cpu", seed=0):
        g = torch.Generator().manual_seed(seed)
        shapes = {"embed.weight": (96, 32), "layers.0.q.weight": (32, 32), "norm.weight": (32,)}
        self.w = {n: (torch.randn(s, generator=g) * 0.02).to(device) for n, s in shapes.items()}
        self.g = g

    def step(self):
        for w in self.w.values():
            w += 3e-4 * torch.randn(w.shape, generator=self.g).to(w.device)

    def named(self):
        return list(self.w.items())

    def bits(self):
        from deltasync.bf16 import to_bf16_bits

        return {n: to_bf16_bits(w).copy() for n, w in self.w.items()}


def bucket_bytes(uri) -> dict:
    """Every payload file of a run, parsed (safetensors orders its metadata keys freely), by
    its path without the writer's id, and the manifest's versions without times."""
    store = open_store(uri)
    m = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    files = {}
    for p in store.ls(""):
        if p.startswith(("anchors/", "deltas/")):
            part = deltafile.read_part(store.read_bytes(p))
            same_in_every_run = p.replace(f"-{m.writer_id}.", ".")
            files[same_in_every_run] = (part.kind, part.version, part.base_version) + tuple(
                (n, t.shape, t.digest, t.changed, t.data.tobytes())
                for n, t in sorted(part.tensors.items())
            )
    versions = [
        (v.version, v.base_version, v.digest, v.changed, bool(v.anchor), v.coalesced)
        for v in m.versions
    ]
    return {"files": files, "versions": versions}


class SlowBucket:
    """A ``before_commit`` hook: while :meth:`hold` is on, each commit waits at its commit point
    until :meth:`release`, so versions published meanwhile queue behind it (and fold together)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._held = False
        self.reached: list[int] = []  # versions whose commit reached the commit point

    def __call__(self, entry) -> None:
        with self._cv:
            self.reached.append(entry.version)
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: not self._held, timeout=60):
                raise TimeoutError(f"v{entry.version}'s commit was held 60 s; no release()")

    def hold(self) -> None:
        with self._cv:
            self._held = True

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    def wait_reached(self, version: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: version in self.reached, timeout=60), self.reached

    @property
    def held(self) -> bool:
        return self._held


def publish_run(uri, models_steps, diff_on, coalesce_at=()):
    """Publish versions 0..5, flushing after each except those in ``coalesce_at``: the first
    version of a run of those commits held (a slow bucket), so the ones after it queue, and each
    one still queued when the next is published folds into it."""
    cfg = PublisherConfig(anchor_every=3, diff_on=diff_on, encode_threads=2)
    model = models_steps
    bucket = SlowBucket()
    with DeltaPublisher(uri, run_id="r", config=cfg) as pub:
        pub.before_commit = bucket
        pub.publish(model.named(), step=0)
        pub.flush()
        for i in range(1, 6):
            model.step()
            if i in coalesce_at and not bucket.held:
                bucket.hold()
                bucket.wait_reached(pub.publish(model.named(), step=i))  # committing, held
            else:
                pub.publish(model.named(), step=i)
            if i not in coalesce_at:
                bucket.release()
                pub.flush()
    return bucket_bytes(uri)


def check_same_bucket_as_host(tmp_path, device):
    host = publish_run(f"{tmp_path}/host", Model("cpu"), "host")
    dev = publish_run(f"{tmp_path}/dev", Model(device), "device" if device == "cpu" else "auto")
    assert dev == host  # identical payload bytes and manifest digests
    sub, held = DeltaSubscriber(f"{tmp_path}/dev"), HeldWeights()
    sub.sync(held)
    ref = Model("cpu")
    for _ in range(5):
        ref.step()
    assert all(np.array_equal(held.tensors[n], b) for n, b in ref.bits().items())


def test_publisher_diffing_with_torch_writes_the_same_bucket(tmp_path):
    check_same_bucket_as_host(tmp_path, "cpu")


@pytest.mark.gpu
def test_publisher_diffing_on_cuda_writes_the_same_bucket(tmp_path):
    check_same_bucket_as_host(tmp_path, "cuda")


def test_publish_changes_gives_the_bucket_publish_gives(tmp_path):
    """Changes diffed outside the publisher (as the ranks of a sharded trainer do) and passed to
    publish_changes commit the same versions, byte for byte."""
    want = publish_run(f"{tmp_path}/whole", Model(), "host")
    model = Model()
    prev = model.bits()
    cfg = PublisherConfig(anchor_every=3, diff_on="host", encode_threads=2)
    with DeltaPublisher(f"{tmp_path}/changes", run_id="r", config=cfg) as pub:
        with pytest.raises(ModelMismatchError, match="before publish"):
            pub.publish_changes({}, step=0)
        pub.publish(model.named(), step=0)
        pub.flush()
        for i in range(1, 6):
            model.step()
            now = model.bits()
            changes = {n: codec.diff(prev[n], now[n]) for n in now}
            with pytest.raises(ModelMismatchError, match="not in the model"):
                pub.publish_changes({"nope": changes["norm.weight"]}, step=i)
            stale = {"norm.weight": codec.diff(now["norm.weight"], now["norm.weight"] ^ 1)}
            with pytest.raises(ValueError, match="another base"):
                pub.publish_changes(stale, step=i)
            pub.publish_changes({n: c for n, c in changes.items() if c.n_changed}, step=i)
            pub.flush()
            prev = now
    assert bucket_bytes(f"{tmp_path}/changes") == want


def test_coalesced_versions_compose(tmp_path):
    """Versions folded together before encoding (uploads behind) still land bit-exact, the
    same on the host and on the device path."""
    host = publish_run(f"{tmp_path}/h", Model(), "host", coalesce_at=(1, 2, 4))
    dev = publish_run(f"{tmp_path}/d", Model(), "device", coalesce_at=(1, 2, 4))
    ref = Model()
    for _ in range(5):
        ref.step()
    for uri in (f"{tmp_path}/h", f"{tmp_path}/d"):
        held = HeldWeights()
        DeltaSubscriber(uri).sync(held)
        assert all(np.array_equal(held.tensors[n], b) for n, b in ref.bits().items())
    # v2 was queued behind v1's held commit and folded into v3 (v5 queued behind v4 with none
    # after it to fold into); the device path folds the same versions into the same bytes
    for run in (host, dev):
        assert [(v[0], v[5]) for v in run["versions"]] == [(0, 0), (1, 0), (3, 1), (4, 0), (5, 0)]
    assert dev == host


def test_snapshot_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="diff_on"):
        Snapshot("gpu")


def test_parallel_decode_is_all_or_nothing(tmp_path):
    """Tensors decode on several threads; the result equals one thread's, and a damaged tensor
    anywhere in a version leaves every held tensor as it was."""
    uri = f"{tmp_path}/b"
    shapes = {f"layers.{i}.w": (64, 48) for i in range(12)}
    model = Model()
    model.w = {n: torch.randn(s) * 0.02 for n, s in shapes.items()}
    with DeltaPublisher(uri, config=PublisherConfig(anchor_every=100)) as pub:
        pub.publish(model.named(), step=0)
        for i in range(3):
            model.step()
            pub.publish(model.named(), step=i + 1)
            pub.flush()
    one, many = HeldWeights(), HeldWeights()
    DeltaSubscriber(uri, decode_threads=1).sync(one)
    sub = DeltaSubscriber(uri, decode_threads=4)
    manifest = sub.read_manifest()
    plan = sub.plan(None, manifest)
    for step in plan.steps[:-1]:
        sub.decode_into(sub.fetch(step), many, manifest)
    before = {n: a.copy() for n, a in many.tensors.items()}
    last = sub.fetch(plan.steps[-1])
    victim = sorted(last.tensors)[-1]
    good = last.tensors[victim]
    last.tensors[victim] = type(good)(**{**vars(good), "digest": "0" * 16})
    with pytest.raises(DeltaCorruptError, match=victim):
        sub.decode_into(last, many, manifest)
    assert all(np.array_equal(before[n], a) for n, a in many.tensors.items())
    last.tensors[victim] = good
    sub.decode_into(last, many, manifest)
    assert many.version == one.version == 3
    assert all(np.array_equal(one.tensors[n], a) for n, a in many.tensors.items())
