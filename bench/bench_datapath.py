"""The data path's own costs, outside the codec (`make bench`; bench/results/datapath.json).

A synthetic bf16 model (``--tensors`` x ``--side`` x ``--side``, np.uint16 bits; 20 x 4096 x 4096
= 335 M elements, 671 MB) is published as one anchor and ``--deltas`` deltas at ~1% density, on a
folder and on ``memory://`` (a store with no local path: payloads take the remote branch, as on
hf://).
Reported:
  - publisher: ``write_upload_s`` per version from the manifest's timings (part files written,
    hashed and handed to the store in one batch), anchor and median delta;
  - replica: one anchor part parsed (``deltafile.read_part``), and a fresh replica loading the
    anchor (``DeltaSubscriber.sync``): wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid

import numpy as np
from report import parse_with_smoke, save, smoke_path

from deltasync import deltafile
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.subscriber import DeltaSubscriber, HeldWeights


def publish(uri: str, weights: dict, deltas: int, rng) -> dict:
    """Publish an anchor and ``deltas`` deltas; the write+upload seconds of each."""
    with DeltaPublisher(uri, config=PublisherConfig(encode_threads=2, anchor_every=10**6)) as pub:
        for step in range(deltas + 1):
            if step:
                for a in weights.values():
                    flat = a.reshape(-1)
                    flat[rng.choice(flat.size, flat.size // 100, replace=False)] += 1
            pub.publish(weights.items(), step=step)
            pub.flush()
        t = [pub.manifest.entry(v).timings_s["write_upload_s"] for v in range(deltas + 1)]
    return dict(anchor_write_upload_s=t[0], delta_write_upload_s_median=statistics.median(t[1:]))


def load(uri: str) -> dict:
    """A fresh replica's anchor load, and the parse of the anchor's first part."""
    sub = DeltaSubscriber(uri)
    manifest = sub.read_manifest()
    data = sub.store.read_bytes(manifest.versions[0].anchor.files[0].path)
    t0 = time.perf_counter()
    deltafile.read_part(data)
    parse_s = time.perf_counter() - t0
    held = HeldWeights()
    t0, c0 = time.perf_counter(), time.process_time()
    sub.sync(held, target=0)
    out = dict(
        part_mb=len(data) / 2**20,
        read_part_s=parse_s,
        anchor_load_wall_s=time.perf_counter() - t0,
        anchor_load_cpu_s=time.process_time() - c0,
    )
    sub.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tensors", type=int, default=20)
    p.add_argument("--deltas", type=int, default=5)
    p.add_argument("--side", type=int, default=4096, help="rows and columns of each tensor")
    p.add_argument("--out", default="bench/results/datapath.json")
    smoke = dict(tensors=2, deltas=2, side=512, out=smoke_path("datapath.json"))
    a = parse_with_smoke(p, smoke)
    rng = np.random.default_rng(0)
    weights = {
        f"layers.{i}.w": rng.integers(0x3C00, 0x3D00, (a.side, a.side), dtype=np.uint16)
        for i in range(a.tensors)
    }
    folder = tempfile.mkdtemp(prefix="deltasync-datapath-") + "/bucket"
    res = {"elements": sum(w.size for w in weights.values())}
    for name, uri in (("folder", folder), ("memory", f"memory://datapath-{uuid.uuid4().hex[:8]}")):
        res[name] = publish(uri, {n: w.copy() for n, w in weights.items()}, a.deltas, rng)
    res["replica"] = load(folder)
    save(a.out, res)
    print("| where | anchor write+upload s | delta write+upload s (median) |\n|---|---|---|")
    for name in ("folder", "memory"):
        r = res[name]
        print(
            f"| {name} | {r['anchor_write_upload_s']:.3f} | {r['delta_write_upload_s_median']:.4f} |"
        )
    r = res["replica"]
    print(
        f"replica: read_part of a {r['part_mb']:.0f} MiB anchor part {r['read_part_s'] * 1e3:.1f} ms; "
        f"anchor load {r['anchor_load_wall_s']:.2f} s wall, {r['anchor_load_cpu_s']:.2f} s CPU"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
