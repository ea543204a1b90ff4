"""Scale simulation: many replica processes follow one bucket (`make bench`; bench/results/scale.json).

A real ``DeltaPublisher`` writes a synthetic bf16 model (np.uint16 bits, Normal(0, 0.02) weights) to a
``file://`` bucket: one anchor, then ``--versions`` deltas, one every ``--publish-interval-s``, each
moving ~``--density`` of the elements by +-1 ulp, drawn from the smallest-magnitude fifth of the
elements (where an RL step at a small learning rate flips bf16 bits). N replica PROCESSES
(multiprocessing, spawn) each run the real replica path on a CPU dict: ``deltasync.follow.Follower``
reads the manifest every ``--poll-interval-s``, plans, fetches, verifies and applies into
``HeldWeights``.
No vLLM, no torch.

Measured per (model size, N replicas), over the delta phase only (the start-up anchor load is left
out):
  - lag_s: publish (manifest commit, ``created_at``) to applied, per replica and version, p50/p95
  - bucket reads per replica per version: manifest reads (polls) and payload reads, with bytes,
    counted by a ``Store`` subclass around the same file:// bucket
  - CPU seconds per applied version in a replica (fetch + verify + apply, the process's CPU time)
    and CPU seconds per idle poll

Everything runs on this machine, so with more replicas than cores the figures measure CPU
contention of the replicas, not the bucket; docs/SCALE.md says what limits scaling where.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import shutil
import sys
import tempfile
import time

import numpy as np
from report import parse_with_smoke, save, smoke_path

from deltasync import codec
from deltasync.follow import Follower
from deltasync.manifest import MANIFEST_PATH
from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.store import Store

ROW_ELEMS = 1024  # columns of every synthetic tensor
TENSOR_ELEMS = 1 << 20  # elements per synthetic tensor (the last one may be smaller)


class CountingStore(Store):
    """A Store that counts reads (calls and bytes), split into manifest reads and payload reads."""

    def __init__(self, uri: str, **kw):
        super().__init__(uri, **kw)
        self.reset()

    def reset(self) -> None:
        self.manifest_reads = self.manifest_bytes = 0
        self.payload_reads = self.payload_bytes = 0
        self.other_calls = 0  # exists / ls

    def read_bytes(self, path: str) -> bytes:
        data = super().read_bytes(path)
        if path == MANIFEST_PATH:
            self.manifest_reads += 1
            self.manifest_bytes += len(data)
        else:
            self.payload_reads += 1
            self.payload_bytes += len(data)
        return data

    def exists(self, path: str) -> bool:
        self.other_calls += 1
        return super().exists(path)

    def ls(self, prefix: str) -> list[str]:
        self.other_calls += 1
        return super().ls(prefix)


# --------------------------------------------------------------------------------- the model
def synthetic_model(n_elems: int, seed: int) -> dict[str, np.ndarray]:
    """{name: uint16 bf16 bits of shape (rows, 1024)} with ~n_elems elements, Normal(0, 0.02)."""
    rng = np.random.default_rng(seed)
    out, left, i = {}, n_elems, 0
    while left > 0:
        rows = max(1, min(TENSOR_ELEMS, left) // ROW_ELEMS)
        f32 = (rng.standard_normal((rows, ROW_ELEMS), dtype=np.float32) * 0.02).view(np.uint32)
        out[f"layers.{i}.weight"] = ((f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16).astype(np.uint16)
        left -= rows * ROW_ELEMS
        i += 1
    return out


class Stepper:
    """Moves ~``density`` of the elements by +-1 ulp per step, drawn from the smallest-magnitude
    fifth of each tensor (fixed candidate set, so the same elements keep moving, as under RL)."""

    def __init__(self, model: dict[str, np.ndarray], density: float, seed: int):
        self.rng = np.random.default_rng(seed + 1)
        self.density = density
        self.candidates = {}
        for name, bits in model.items():
            mag = bits.reshape(-1) & 0x7FFF
            k = max(1, mag.size // 5)
            self.candidates[name] = np.argpartition(mag, k)[:k]

    def step(self, model: dict[str, np.ndarray]) -> int:
        """Apply one step in place; returns the number of elements changed."""
        n = 0
        for name, bits in model.items():
            flat = bits.reshape(-1)
            cand = self.candidates[name]
            m = max(1, int(self.density * flat.size))
            idx = self.rng.choice(cand, size=min(m, cand.size), replace=False)
            mag = flat[idx] & 0x7FFF
            up = self.rng.random(idx.size) < 0.5
            up |= mag == 0  # never step below zero magnitude
            up &= mag < 0x7F7F  # nor into inf/nan
            new_mag = np.where(up, mag + 1, mag - 1).astype(np.uint16)
            flat[idx] = (flat[idx] & 0x8000) | new_mag
            n += idx.size
        return n


# ------------------------------------------------------------------------------- one replica
def warm_up_codec() -> None:
    """Load the codec's numba kernels (JIT cache) before measuring, as a long-lived replica has,
    on a delta drawn like the benchmark's."""
    base = synthetic_model(TENSOR_ELEMS // 4, seed=1)
    new = {n: a.copy() for n, a in base.items()}
    Stepper(new, 0.01, seed=1).step(new)
    for name, bits in base.items():
        codec.decode(codec.encode(codec.diff(bits, new[name]), bits, 3), bits)


def replica_main(rid: int, uri: str, poll_s: float, final, stop, ready_q, result_q, deadline):
    """Replica process: load the anchor, signal ready, then follow the bucket (the replicas'
    ``Follower`` loop, polling every ``poll_s``) until it holds the final version (``final.value``,
    -1 until known), ``stop`` is set, or ``deadline`` (unix s, a bound of last resort) passes."""
    warm_up_codec()
    store = CountingStore(uri, create=False)
    follower = Follower(store, poll_interval_s=poll_s, max_poll_interval_s=poll_s, fetch_threads=2)
    held = follower.held
    while held.version is None and time.time() < deadline and not stop.is_set():
        if follower.poll() is None:
            time.sleep(poll_s)
    ready_q.put(rid)
    store.reset()
    records, polls, idle_cpu_s, apply_cpu_s, applied = [], 0, 0.0, 0.0, 0
    time.sleep(poll_s * np.random.default_rng(rid).random())  # random phase
    cpu0 = time.process_time()
    for pulled in follower.follow(stop):
        cpu = time.process_time() - cpu0  # this poll's CPU (the waits cost none)
        polls += 1
        if pulled is not None:
            apply_cpu_s += cpu
            applied += len(pulled.steps)
            for step, nbytes in zip(pulled.steps, pulled.sizes, strict=True):
                records.append(
                    dict(
                        version=step.version,
                        kind=step.kind,
                        bytes=nbytes,
                        published_at=step.created_at,
                        applied_at=time.time(),
                    )
                )
        else:
            idle_cpu_s += cpu
        done = final.value >= 0 and held.version is not None and held.version >= final.value
        if done or time.time() >= deadline:
            break
        cpu0 = time.process_time()
    follower.close()
    result_q.put(
        dict(
            rid=rid,
            held_version=held.version,
            records=records,
            polls=polls,
            applied=applied,
            apply_cpu_s=apply_cpu_s,
            idle_cpu_s=idle_cpu_s,
            manifest_reads=store.manifest_reads,
            manifest_bytes=store.manifest_bytes,
            payload_reads=store.payload_reads,
            payload_bytes=store.payload_bytes,
            other_calls=store.other_calls,
        )
    )


# ------------------------------------------------------------------------------ one scenario
def run_case(n_elems: int, n_replicas: int, args) -> dict:
    """Publish ``args.versions`` deltas to a fresh bucket followed by ``n_replicas`` processes."""
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="deltasync-scale-")
    uri = "file://" + tmp
    model = synthetic_model(n_elems, args.seed)
    stepper = Stepper(model, args.density, args.seed)
    cfg = PublisherConfig(anchor_every=10_000, encode_threads=2)  # one anchor, then deltas
    pub = DeltaPublisher(uri, run_id="scale", config=cfg)
    final = ctx.Value("i", -1)
    ready_q, result_q = ctx.Queue(), ctx.Queue()
    stop = ctx.Event()
    deadline = time.time() + 3 * args.case_timeout_s  # replicas' own bound; the parent stops them
    procs = []
    try:
        pub.publish(model.items(), step=0)
        pub.flush()
        for rid in range(n_replicas):
            p = ctx.Process(
                target=replica_main,
                args=(rid, uri, args.poll_interval_s, final, stop, ready_q, result_q, deadline),
                daemon=True,
            )
            p.start()
            procs.append(p)
        t_start = time.time()
        ready_by = t_start + args.case_timeout_s
        for _ in range(n_replicas):
            try:
                ready_q.get(timeout=max(1.0, ready_by - time.time()))
            except queue.Empty as e:
                raise RuntimeError(
                    f"not all {n_replicas} replicas loaded the anchor within --case-timeout-s "
                    f"{args.case_timeout_s}; raise it or lower --replicas/--sizes"
                ) from e
        startup_s = time.time() - t_start
        changed = []
        for v in range(1, args.versions + 1):
            t0 = time.monotonic()
            changed.append(stepper.step(model))
            pub.publish(model.items(), step=v)
            time.sleep(max(0.0, args.publish_interval_s - (time.monotonic() - t0)))
        pub.flush()
        final.value = pub.latest_committed
        results = collect(result_q, procs, stop, time.time() + args.case_timeout_s)
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()  # only when an error above left it running
                p.join()
        pub.close()
        entries = list(pub.published)
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(n_elems, n_replicas, args, results, entries, changed, startup_s)


def collect(result_q, procs, stop, done_by: float) -> list[dict]:
    """One result per replica. After ``done_by`` (unix s) the stragglers are told to stop and
    report what they have (summarize() then raises on them).

    Raises:
        RuntimeError: a replica process died without a result (its traceback is on stderr).
    """
    results: list[dict] = []
    while len(results) < len(procs):
        try:
            results.append(result_q.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        if time.time() > done_by:
            stop.set()
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"{len(dead)} replica processes failed (exit codes {dead})")

    return results


def summarize(n_elems, n_replicas, args, results, entries, changed, startup_s) -> dict:
    lags = np.array(
        [r["applied_at"] - r["published_at"] for res in results for r in res["records"]]
    )
    versions = args.versions
    behind = [res["rid"] for res in results if res["held_version"] != entries[-1].version]
    if behind:
        raise RuntimeError(
            f"{len(behind)} of {n_replicas} replicas did not reach v{entries[-1].version} within "
            f"--case-timeout-s {args.case_timeout_s}; raise it or lower --replicas/--sizes"
        )

    def per_rv(key):  # per replica per version
        return float(np.mean([res[key] for res in results])) / versions

    deltas = [e for e in entries if e.delta is not None]
    return dict(
        model_elems=n_elems,
        replicas=n_replicas,
        versions=versions,
        changed_per_version=float(np.mean(changed)),
        delta_bytes_mean=float(np.mean([e.delta.bytes for e in deltas])),
        publish_encode_s_mean=float(np.mean([e.timings_s.get("encode_s", 0) for e in deltas])),
        publish_diff_s_mean=float(np.mean([e.timings_s.get("diff_s", 0) for e in deltas])),
        startup_s=startup_s,
        lag_s_p50=float(np.percentile(lags, 50)),
        lag_s_p95=float(np.percentile(lags, 95)),
        lag_s_max=float(lags.max()),
        manifest_reads_per_replica_version=per_rv("manifest_reads"),
        manifest_bytes_per_replica_version=per_rv("manifest_bytes"),
        payload_reads_per_replica_version=per_rv("payload_reads"),
        payload_bytes_per_replica_version=per_rv("payload_bytes"),
        bucket_bytes_per_version=per_rv("payload_bytes") * n_replicas
        + per_rv("manifest_bytes") * n_replicas,
        cpu_s_per_apply=float(
            sum(r["apply_cpu_s"] for r in results) / max(1, sum(r["applied"] for r in results))
        ),
        cpu_s_per_idle_poll=float(
            sum(r["idle_cpu_s"] for r in results)
            / max(1, sum(r["polls"] - r["applied"] for r in results))
        ),
    )


def table(rows: list[dict]) -> str:
    head = (
        "| elements | replicas | delta KB | lag p50 s | lag p95 s | lag max s | manifest reads"
        " /replica/version | payload reads /replica/version | payload KB /replica/version"
        " | bucket MB /version (all replicas) | CPU s /apply | CPU ms /idle poll |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['model_elems'] / 1e6:.0f} M | {r['replicas']} | "
            f"{r['delta_bytes_mean'] / 1e3:.0f} | {r['lag_s_p50']:.2f} | {r['lag_s_p95']:.2f} | "
            f"{r['lag_s_max']:.2f} | {r['manifest_reads_per_replica_version']:.1f} | "
            f"{r['payload_reads_per_replica_version']:.2f} | "
            f"{r['payload_bytes_per_replica_version'] / 1e3:.0f} | "
            f"{r['bucket_bytes_per_version'] / 1e6:.2f} | {r['cpu_s_per_apply']:.3f} | "
            f"{1e3 * r['cpu_s_per_idle_poll']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 20e6], help="model elements")
    p.add_argument("--versions", type=int, default=6, help="deltas published per case")
    p.add_argument("--density", type=float, default=0.01, help="changed fraction per version")
    p.add_argument("--publish-interval-s", type=float, default=1.5)
    p.add_argument("--poll-interval-s", type=float, default=0.5)
    p.add_argument("--case-timeout-s", type=float, default=120.0, help="per (size, N) case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/scale.json")
    smoke = dict(replicas=[1, 2], sizes=[2e5], versions=2, publish_interval_s=0.3)
    smoke |= dict(poll_interval_s=0.1, case_timeout_s=60.0, out=smoke_path("scale.json"))
    args = parse_with_smoke(p, smoke, argv)
    if args.versions < 1 or args.poll_interval_s <= 0 or min(args.replicas) < 1:
        p.error("expected --versions >= 1, --poll-interval-s > 0 and --replicas >= 1")
    t0, load_start = time.time(), os.getloadavg()[0]
    warm_up_codec()  # compile the numba kernels once here, so the replicas load them from cache
    rows = []
    for size in args.sizes:
        for n in args.replicas:
            r = run_case(int(size), n, args)
            rows.append(r)
            print(
                f"{r['model_elems'] / 1e6:.0f}M elements x {n} replicas: lag p50 "
                f"{r['lag_s_p50']:.2f}s p95 {r['lag_s_p95']:.2f}s, "
                f"CPU {r['cpu_s_per_apply']:.3f}s/apply (start-up {r['startup_s']:.1f}s)",
                flush=True,
            )
    meta = dict(
        command=" ".join(
            ["python bench/bench_scale.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        cpus=os.cpu_count(),
        platform=platform.platform(),
        python=platform.python_version(),
        wall_s=time.time() - t0,
        loadavg_1min_start=load_start,
        loadavg_1min_end=os.getloadavg()[0],
        **{k: v for k, v in vars(args).items() if k != "out"},
    )
    save(args.out, dict(meta=meta, results=rows))
    print(table(rows))
    print(f"wrote {args.out} in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
