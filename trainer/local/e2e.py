"""``make e2e``: the whole system on one machine, with faults, and a report.

Trainer (TRL AsyncGRPO, tiny model) + the Wordle Space + TWO vLLM replicas + the dashboard, on a
file bucket, for enough steps to cross several anchors:

- replica ``local-0`` serves the trainer's rollouts from the start, through the fleet router;
- replica ``local-1`` starts late (after ``late_at`` steps), catches up from an anchor, joins the
  fleet by its heartbeat and serves rollouts too, is killed with SIGKILL once it has applied a
  version (a crash: no clean shutdown; its requests in flight go to ``local-0`` and training goes
  on), and is restarted two steps later, after which it re-anchors, rejoins and serves again;
- one delta (of a version that also carries an anchor) is corrupted in the bucket after upload and
  before its manifest commit: every replica refuses it (file digest mismatch), reports the error,
  and recovers from that version's anchor.

At the end both replicas hold the final version, which is bit for bit the trainer's final bf16
weights (the bucket's model digest equals the trainer's; each replica verified every tensor's
digest before applying). The report gives steps, versions, bytes per step, density, paused
windows, publish-to-applied lag per replica (p50/p95) and the staleness distribution.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import time

import httpx
from transformers import TrainerCallback

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import read_heartbeats
from trainer.config import TrainConfig
from trainer.local import processes
from trainer.run import RunContext, run

log = logging.getLogger("trainer.local.e2eNone")
LATE = "local-1"


class Faults(TrainerCallback):
    """Starts the late replica, kills it, restarts it, at step boundaries."""

    def __init__(self, ctx: RunContext, late_at: int, kill_at: int):
        self.ctx = ctx
        self.late_at = late_at
        self.kill_at = kill_at
        self.replica: processes.Child | None = None
        self.events: list[dict] = []
        self.killed_step: int | None = None
        self.urls: list[str] = []  # each start of the late replica (a restart gets a new port)

    def _event(self, what: str, step: int, **kw) -> None:
        self.events.append({"event": what, "step": step, "time": time.time(), **kw})
        log.info("e2e fault: %s at step %d %s", what, step, kw or "")

    def _start(self, step: int) -> None:
        self.replica = processes.start_replica(
            self.ctx.store_uri, self.ctx.model_path, self.ctx.logs_dir, replica_id=LATE
        )
        self.ctx.children.append(self.replica)
        self.urls.append(self.replica.url)
        self._event("start late replica" if self.killed_step is None else "restart", step)

    def _held(self) -> int | None:
        try:
            return processes.held_version(self.replica.url)
        except httpx.HTTPError:
            return None  # not up yet

    def _served(self) -> int:
        """Rollout requests the fleet router sent the late replica so far."""
        pool = self.ctx.fleet
        return sum(r["served"] for r in pool.snapshot() if r["replica_id"] == LATE) if pool else 0

    def _kill(self, step: int, held: int, during_training: bool = True) -> None:
        os.killpg(self.replica.proc.pid, signal.SIGKILL)  # a crash: no clean shutdown
        self.replica.proc.wait()
        self.killed_step = step
        self._event("kill (SIGKILL)", step, held_version=held, during_training=during_training)

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self.replica is None and step >= self.late_at:
            self._start(step)
        elif self.killed_step is None and step >= self.kill_at:
            held = self._held()
            if held is not None and self._served() > 0:  # killed while it serves rollouts
                self._kill(step, held)
        elif self.killed_step is not None and step == self.killed_step + 2:
            self._start(step)

    def finish(self, step: int, timeout_s: float) -> None:
        """After training: complete the phases the run was too short for (on a slow machine the
        late replica may still be loading at the last step), so every fault happens."""
        if self.replica is None:
            self._start(step)
        deadline = time.monotonic() + timeout_s
        if self.killed_step is None:
            while self._held() is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the late replica never synced: {self.replica.tail()}")
                time.sleep(1)
            self._kill(step, self._held(), during_training=False)
        if self.replica.proc.poll() is not None:
            self._start(step)


def corrupt_one_delta(ctx: RunContext, from_version: int, record: dict) -> None:
    """Flip a byte of the delta of the first version >= ``from_version`` that also carries an
    anchor, after its upload and before its manifest commit (a damaged object in the bucket)."""

    def corrupt(entry) -> None:
        if (
            "version" not in record
            and entry.version >= from_version
            and entry.delta
            and entry.anchor
        ):
            path = entry.delta.files[0].path
            data = bytearray(ctx.store.read_bytes(path))
            data[len(data) // 2] ^= 0xFF
            ctx.store.write_bytes(path, bytes(data))
            record.update(version=entry.version, path=path)
            log.info(
                "e2e fault: corrupted %s (v%d) before its manifest commit", path, entry.version
            )

    ctx.publisher.before_commit = corrupt


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def run_e2e(steps: int = 16, anchor_every: int = 4, late_at: int = 2, kill_at: int = 5,
            runs_root: str = "runs", run_id: str = "e2e", timeout_s: float = 600,
            **train_overrides) -> dict:  # fmt: skip
    """Run the scenario; returns the report (also written to ``<run_dir>/e2e.json``).

    ``train_overrides`` replace :class:`~trainer.config.TrainConfig` fields (e.g. a smaller warm
    start or fewer evaluation games for the test).

    Raises:
        AssertionError: an end condition does not hold (replicas not on the final version, digest
            mismatch, a fault that did not happen).
    """
    cfg = TrainConfig(
        run_id=run_id, runs_root=runs_root, max_steps=steps, anchor_every=anchor_every,
        num_generations=4, per_device_train_batch_size=8, token_budget=3072,
        dashboard=True, dashboard_port=processes.free_port(), eval_episodes=16,
        eval_every=0, fleet_health_interval_s=1.0,
    )  # fmt: skip
    for k, v in train_overrides.items():
        setattr(cfg, k, v)
    faults: dict = {}
    corrupted: dict = {}

    def make_faults(ctx):
        faults["cb"] = Faults(ctx, late_at, kill_at)
        return faults["cb"]

    def before_stop(ctx: RunContext, summary: dict) -> None:
        final = summary["final_version"]
        cb: Faults = faults["cb"]
        cb.finish(summary["steps"], timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and cb._held() != final:
            time.sleep(1)
        dash = httpx.get(f"http://127.0.0.1:{cfg.dashboard_port}/", timeout=10).status_code
        restarted = cb.urls[1:]  # rollouts the late replica served after its restart
        served = sum(f["served"] for f in summary["fleet"] if f["url"] in restarted)
        summary["e2e"] = {"faults": cb.events, "corrupted": corrupted, "dashboard_http": dash,
                          "served_after_restart": served}  # fmt: skip

    summary = run(
        cfg,
        callbacks=[make_faults],
        publisher_hook=lambda ctx: corrupt_one_delta(ctx, anchor_every, corrupted),
        before_stop=before_stop,
    )
    report = _report(cfg, summary)
    with open(os.path.join(cfg.run_dir, "e2e.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def _report(cfg: TrainConfig, summary: dict) -> dict:
    from deltasync.store import Store

    store = Store(cfg.store_uri())
    manifest = Manifest.from_json(store.read_bytes(MANIFEST_PATH))
    beats = read_heartbeats(store)
    deltas = [v for v in manifest.versions if v.delta is not None]
    replicas = {}
    for rid, hb in sorted(beats.items()):
        recs = hb.recent
        replicas[rid] = {
            "held_version": hb.held_version,
            "errors": hb.errors,
            "last_error": (hb.last_error or "")[:160],
            "syncs": len(recs),
            "lag_s_p50": _pct([r.lag_s for r in recs], 0.5),
            "lag_s_p95": _pct([r.lag_s for r in recs], 0.95),
            "paused_s_p50": _pct([r.paused_s for r in recs], 0.5),
            "paused_s_max": _pct([r.paused_s for r in recs], 1.0),
            "apply_s_p50": _pct([r.apply_s for r in recs], 0.5),
            "kinds": sorted({r.kind for r in recs}),
            # rollout requests the fleet router sent it (every instance under this id: the
            # killed late replica comes back on a new port)
            "requests_served": sum(f["served"] for f in summary["fleet"] if f["replica_id"] == rid),
            "requests_failed": sum(f["failed"] for f in summary["fleet"] if f["replica_id"] == rid),
            "killed_at_step": next(
                (
                    e["step"]
                    for e in summary["e2e"]["faults"]
                    if e["event"].startswith("kill") and e["during_training"] and rid == LATE
                ),
                None,
            ),  # fmt: skip
        }
    final = manifest.latest.version
    for r in replicas.values():
        # a replica checks every tensor's digest before it applies a version, so holding the final
        # version whose model digest equals the trainer's means its weights are the trainer's
        r["weights_equal_trainer"] = (
            r["held_version"] == final and manifest.latest.digest == summary["trainer_model_digest"]
        )
    report = {
        "steps_planned": cfg.max_steps,
        "steps": summary["steps"],
        "max_request_s": summary["max_request_s"],
        "versions": [v.version for v in manifest.versions],
        "anchors": summary["anchors"],
        "final_version": final,
        "bucket_digest_equals_trainer": manifest.latest.digest == summary["trainer_model_digest"],
        "delta_bytes_per_step_mean": round(statistics.fmean([v.delta.bytes for v in deltas]), 1),
        "density_mean": round(statistics.fmean([v.density for v in deltas]), 6),
        "bytes_per_changed_mean": summary["bytes_per_changed_mean"],
        "replicas": replicas,
        "staleness": summary["staleness"],
        "staleness_dropped": summary["staleness_dropped"],
        "wall_s": summary["wall_s"],
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "stale_fraction": summary["stale_fraction"],
        "turns_mean": summary["turns_mean"],
        **summary["e2e"],
    }
    problems = []
    if not report["bucket_digest_equals_trainer"]:
        problems.append("the bucket's final version differs from the trainer's weights")
    for rid, r in replicas.items():
        if r["held_version"] != final:
            problems.append(f"replica {rid} holds v{r['held_version']}, not the final v{final}")
    if report["steps"] != cfg.max_steps:
        problems.append(f"training stopped at step {report['steps']} of {cfg.max_steps}")
    late = replicas.get(LATE, {})
    if late.get("killed_at_step") is not None and not late.get("requests_served"):
        problems.append(f"{LATE} was killed in training without having served a rollout")
    if not report["corrupted"]:
        problems.append("no delta was corrupted (no anchor+delta version after the threshold)")
    elif not any(r["errors"] for r in replicas.values()):
        problems.append("no replica reported the corrupted delta")
    if problems:
        raise AssertionError("; ".join(problems) + f"\nreport: {json.dumps(report, indent=1)}")
    return report


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.local.e2eNone", description=__doc__)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--anchor-every", type=int, default=4)
    p.add_argument("--late-at", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=5)
    p.add_argument("--runs-root", default="runs")
    p.add_argument("--run-id", default="e2e")
    a = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    processes.quiet_libraries()
    report = run_e2e(a.steps, a.anchor_every, a.late_at, a.kill_at, a.runs_root, a.run_id)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
