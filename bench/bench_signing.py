"""What signed versions cost per version (``deltasync.signing``; bench/results/signing.json).

Per version a signing publisher hashes every payload file it uploads with SHA-256 (besides the
xxh3-64 it always computes) and signs the manifest once; a replica with ``RUN_PUBLIC_KEY``
verifies the manifest once and hashes every payload file it downloads with SHA-256. Measured on
random bytes the size of a SmolLM2-135M delta (``--delta-mb``, a few MB) and anchor
(``--anchor-mb``: 134.5 M bf16 elements, 269 MB), and on a manifest of ``--versions`` versions
(one delta part each, an anchor of ``--anchor-parts`` parts every 10): the best of ``--repeats``.
Reported: SHA-256 and xxh3-64 seconds (one core), ``sign_manifest`` seconds (canonical JSON, a
parse-back, Ed25519) and ``verify_manifest`` seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
import xxhash
from report import parse_with_smoke, save, smoke_path

from deltasync.manifest import FileRef, Manifest, ModelFingerprint, Payload, VersionEntry
from deltasync.signing import RunKey, sign_manifest, verify_manifest


def best(fn, repeats: int) -> float:
    """The shortest of ``repeats`` timings of ``fn()``, seconds."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def manifest_of(versions: int, anchor_parts: int, rng) -> Manifest:
    """A manifest like a SmolLM2-135M run's: ``versions`` versions, each a one-part delta from
    the one before, an anchor of ``anchor_parts`` parts every 10 (sha256 filled in)."""

    def ref(kind: str, v: int, i: int) -> FileRef:
        h = rng.bytes(32).hex()
        folder = "anchors" if kind == "anchor" else "deltas"
        path = f"{folder}/v{v:010d}/part-{i:04d}-0123456789ab.safetensors"
        return FileRef(path=path, bytes=int(rng.integers(1, 1 << 28)), digest=h[:16], sha256=h)

    shapes = {f"model.layers.{i}.mlp.down_proj.weight": (576, 1536) for i in range(30)}
    entries = []
    for v in range(versions):
        anchor = v % 10 == 0
        entries.append(
            VersionEntry(
                version=v,
                step=v,
                created_at=time.time(),
                base_version=v - 1 if v else None,
                delta=Payload(files=[ref("delta", v, 0)]) if v else None,
                anchor=Payload(files=[ref("anchor", v, i) for i in range(anchor_parts)])
                if anchor or not v
                else None,
                changed=1_000_000,
                total=134_515_008,
                digest=rng.bytes(8).hex(),
                timings_s={"diff_s": 0.1, "encode_s": 0.2, "write_upload_s": 0.3},
            )
        )
    return Manifest(
        run_id="bench",
        writer_id="0123456789ab",
        model=ModelFingerprint.of(shapes),
        versions=entries,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--delta-mb", type=float, default=4.0)
    p.add_argument("--anchor-mb", type=float, default=269.0)
    p.add_argument("--versions", type=int, default=40)
    p.add_argument("--anchor-parts", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench/results/signing.json")
    smoke = dict(delta_mb=0.5, anchor_mb=8.0, versions=5, repeats=2, out=smoke_path("signing.json"))
    a = parse_with_smoke(p, smoke)
    rng = np.random.default_rng(0)
    res: dict = {}
    for name, mb in (("delta", a.delta_mb), ("anchor", a.anchor_mb)):
        data = rng.bytes(int(mb * 2**20))
        res[name] = dict(
            mb=mb,
            sha256_s=best(lambda d=data: hashlib.sha256(d).digest(), a.repeats),
            xxh3_s=best(lambda d=data: xxhash.xxh3_64_digest(d), a.repeats),
        )
        del data
    key = RunKey.generate()
    manifest = manifest_of(a.versions, a.anchor_parts, rng)
    signed = sign_manifest(manifest, key)
    res["manifest"] = dict(
        versions=a.versions,
        json_bytes=len(signed.to_json()),
        sign_s=best(lambda: sign_manifest(manifest, key), a.repeats),
        verify_s=best(lambda: verify_manifest(signed, key.public_key), a.repeats),
    )
    save(a.out, res)
    print("| payload | MB | SHA-256 s | xxh3-64 s | SHA-256 GB/s |\n|---|---|---|---|---|")
    for name in ("delta", "anchor"):
        r = res[name]
        gbs = r["mb"] / 1024 / r["sha256_s"]
        print(f"| {name} | {r['mb']:g} | {r['sha256_s']:.4f} | {r['xxh3_s']:.4f} | {gbs:.2f} |")
    m = res["manifest"]
    print(
        f"manifest of {m['versions']} versions ({m['json_bytes'] / 1024:.0f} KiB): "
        f"sign {m['sign_s'] * 1e3:.2f} ms, verify {m['verify_s'] * 1e3:.2f} ms"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
