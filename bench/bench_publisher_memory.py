"""The publishing process's memory over versions (`make bench`): where the full-weight trainer's
growth comes from (docs/BENCHMARKS.md section 11, "Both again on the current recipe").

A DeltaPublisher on a local bucket publishes ``--versions`` versions of a model shaped like
SmolLM2-135M (an embedding and 30 layers of 576-wide projections, fp32, ~148 M elements), with
``--changed`` of its elements moved each version, as an optimizer step moves them. Each arm runs
in its own process, since glibc reads its malloc settings at start: ``default`` and
``mmap-1MiB`` (``MALLOC_MMAP_THRESHOLD_=1048576``, which turns off glibc's dynamic mmap
threshold, so large freed blocks go back to the system). Reported: the process's resident memory
(``/proc/self/statm``, GB) after each version. Results: bench/results/publisher_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from report import parse_with_smoke, save, smoke_path

ARMS = {"default": {}, "mmap-1MiB": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def publish_versions(layers: int, versions: int, changed: float) -> list[float]:
    """One arm, in this process: the resident GB after each published version."""
    import torch

    from deltasync.publisher import DeltaPublisher

    torch.manual_seed(0)
    shapes = [(49152, 576)] + [(576, 576)] * 4 * layers + [(1536, 576)] * 3 * layers
    params = {f"p{i}": torch.randn(s) * 0.02 for i, s in enumerate(shapes)}
    out = []
    with tempfile.TemporaryDirectory() as bucket:
        pub = DeltaPublisher(bucket, run_id="memory")
        for v in range(versions):
            with torch.no_grad():
                for p in params.values():
                    moved = torch.rand(p.shape) < changed
                    p[moved] += torch.randn(int(moved.sum())) * 1e-3
            pub.publish(params.items(), step=v)
            pub.flush()
            out.append(round(rss_gb(), 3))
        pub.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--versions", type=int, default=12)
    p.add_argument("--changed", type=float, default=0.05, help="share of elements moved a version")
    p.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)  # a child's own arm
    p.add_argument("--out", default="bench/results/publisher_memory.json")
    a = parse_with_smoke(p, dict(layers=1, versions=3, out=smoke_path("publisher_memory.json")))
    if a.arm:
        print(json.dumps(publish_versions(a.layers, a.versions, a.changed)))
        return
    results = {"layers": a.layers, "versions": a.versions, "changed": a.changed, "rss_gb": {}}
    for arm, env in ARMS.items():
        argv = [sys.executable, __file__, "--arm", arm, "--layers", str(a.layers)]
        argv += ["--versions", str(a.versions), "--changed", str(a.changed)]
        done = subprocess.run(
            argv, env={**os.environ, **env}, capture_output=True, text=True, check=True
        )
        rss = json.loads(done.stdout.strip().splitlines()[-1])
        results["rss_gb"][arm] = rss
        print(f"{arm:10s} resident GB by version: {' '.join(f'{x:.2f}' for x in rss)}")
    save(a.out, results)


if __name__ == "__main__":
    main()
