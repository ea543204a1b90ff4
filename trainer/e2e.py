"""``make e2e``: the whole system on one machine, with faults, and a report.

Trainer (TRL AsyncGRPO, the local model) + the Wordle Space + TWO vLLM replicas + the dashboard, on
a file bucket, for enough steps to cross several anchors:

- replica ``local-0`` serves the trainer's rollouts from the start, through the fleet router;
- replica ``local-1`` starts late (after ``late_at`` steps), catches up from an anchor, joins the
  fleet by its heartbeat and serves rollouts too, is killed with SIGKILL at the first step from
  ``kill_at`` on where it has served rollouts (a crash: no clean shutdown; its requests in flight
  go to ``local-0`` and training goes on), and is restarted two steps later, after which it
  re-anchors, rejoins and serves again. Training goes on past the planned steps until the
  restarted replica has served and each replica has served at least 10% of the rollout requests
  (up to a ceiling in seconds: a replica's start takes a time, not a number of steps);
  ``make e2e`` fails when any of this did not happen while training ran;
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
from trainer.local import children, log_policy, ports, replica_poll
from trainer.run import run
from trainer.stack import RunStack

log = logging.getLogger("trainer.e2e")
LATE = "local-1"
MIN_SHARE = 0.10  # the least share of the rollout requests each replica serves


class Faults(TrainerCallback):
    """Injects the replica faults while training runs, each once the one before has happened, and
    ends training once the plan is complete.

    The plan: at step ``late_at`` start the late replica; at the first step from ``kill_at`` on
    where it has served rollouts, SIGKILL it; two steps later restart it. Training runs at least
    ``steps`` steps and then stops at the first step where the restarted replica has served
    rollouts and every replica id has served at least ``min_share`` of all the rollout requests.
    The ceiling is ``ceiling_s`` seconds of training (or TrainConfig's ``max_steps``): a run that
    reaches it without completing the plan stops there, and :func:`_report` says which fault did
    not happen (``make e2e`` fails). It is in seconds because what the plan waits for, a vLLM
    replica starting (30 s alone on 2 cores, 85 s measured beside the rest of the test suite), and
    its share of the requests, take time, not steps: a faster step only means more of them.

    Args:
        stack: the run's :class:`~trainer.stack.RunStack` (the late replica is one of its
            children, so it is stopped with the stack).
        steps: the planned number of steps (the least the run trains).
        late_at, kill_at: steps (see above).
        min_share: the least share of the rollout requests each replica id must serve (0.1).
        ceiling_s: seconds of training after which it stops even if the plan is not complete.
    """

    def __init__(
        self,
        stack: RunStack,
        steps: int,
        late_at: int,
        kill_at: int,
        min_share: float,
        ceiling_s: float,
    ):
        self.stack = stack
        self.steps, self.late_at, self.kill_at, self.min_share = steps, late_at, kill_at, min_share
        self.ceiling_s = ceiling_s
        self._t_train: float | None = None
        self.replica: children.Child | None = None
        self.events: list[dict] = []
        self.killed_step: int | None = None
        self.urls: list[str] = []  # each start of the late replica (a restart gets a new port)

    def _event(self, what: str, step: int, **kw) -> None:
        self.events.append({"event": what, "step": step, "time": time.time(), **kw})
        log.info("e2e fault: %s at step %d %s", what, step, kw or "")

    def _start(self, step: int) -> None:
        self.replica = children.start_replica(
            self.stack.bucket,
            self.stack.model_path,
            self.stack.logs_dir,
            replica_id=LATE,
            extra_env=self.stack.replica_env(),  # an adapter run's replicas load adapters
        )
        self.stack.add_child(self.replica)
        self.urls.append(self.replica.url)
        self._event("start late replica" if self.killed_step is None else "restart", step)

    def held(self) -> int | None:
        """The version the late replica serves (None: not up, or not synced yet)."""
        try:
            return replica_poll.held_version(self.replica.url)
        except httpx.HTTPError:
            return None  # not up yet

    def served(self, urls: list[str] | None = None) -> int:
        """Rollout requests the fleet router sent the late replica (``urls``: those instances)."""
        rows = self.stack.pool.replica_rows()
        return sum(
            r["served"] for r in rows if r["replica_id"] == LATE and r["url"] in (urls or self.urls)
        )

    def shares(self) -> dict[str, float]:
        """Each replica id's share of the rollout requests served so far."""
        per_id: dict[str, int] = {}
        for r in self.stack.pool.replica_rows():
            per_id[r["replica_id"]] = per_id.get(r["replica_id"], 0) + r["served"]
        total = sum(per_id.values())
        return {rid: n / total for rid, n in per_id.items()} if total else {}

    def plan_complete(self) -> bool:
        """Killed in training, restarted, the restart served, each replica its share."""
        if self.killed_step is None or len(self.urls) < 2 or not self.served(self.urls[1:]):
            return False
        shares = self.shares()
        return len(shares) >= 2 and min(shares.values()) >= self.min_share

    def on_train_begin(self, args, state, control, **kwargs):
        self._t_train = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self.replica is None and step >= self.late_at:
            self._start(step)
        elif self.killed_step is None and step >= self.kill_at and self.served() > 0:
            held = self.held()  # killed while it serves rollouts, in training
            os.killpg(self.replica.proc.pid, signal.SIGKILL)  # a crash: no clean shutdown
            self.replica.proc.wait()
            self.killed_step = step
            self._event("kill (SIGKILL)", step, held_version=held, served=self.served())
        elif self.killed_step is not None and len(self.urls) == 1 and step >= self.killed_step + 2:
            self._start(step)
        if step >= self.steps and self.plan_complete():
            self._event("plan complete, training stops", step, shares=self.shares())
            control.should_training_stop = True
        elif step >= self.steps and time.monotonic() - self._t_train > self.ceiling_s:
            self._event("ceiling reached, training stops", step, shares=self.shares())
            control.should_training_stop = True
        return control


def corrupt_one_delta(ctx: RunStack, from_version: int, record: dict) -> None:
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


def run_e2e(
    steps: int = 16,
    anchor_every: int = 4,
    late_at: int = 2,
    kill_at: int = 5,
    runs_root: str = "runs",
    run_id: str = "e2e",
    timeout_s: float = 600,
    min_share: float = MIN_SHARE,
    ceiling_s: float = 480,
    **train_overrides,
) -> dict:
    """Run the scenario; returns the report (also written to ``<run_dir>/e2e.json``).

    Training runs at least ``steps`` steps and at most ``ceiling_s`` seconds (and 50 x ``steps``
    steps): it stops once every fault has happened in training and each replica served
    ``min_share`` of the rollout requests (:class:`Faults`). ``train_overrides`` replace :class:`~trainer.config.TrainConfig`
    fields (e.g. a smaller warm start or fewer evaluation games for the test).

    Raises:
        AssertionError: an end condition does not hold (replicas not on the final version, digest
            mismatch, a fault that did not happen while training ran, a replica under its share).
    """
    flags = dict(
        run_id=run_id,
        runs_root=runs_root,
        max_steps=steps * 50,  # a bound only: Faults ends training (plan complete or ceiling_s)
        anchor_every=anchor_every,
        num_generations=4,
        per_device_train_batch_size=8,
        token_budget=3072,
        dashboard=True,
        dashboard_port=ports.free_port(),
        eval_episodes=16,
        eval_every=0,
        fleet_health_interval_s=1.0,
    )
    cfg = TrainConfig.from_flags(**(flags | train_overrides))
    faults: dict = {}
    corrupted: dict = {}

    def make_faults(stack):
        faults["cb"] = Faults(stack, steps, late_at, kill_at, min_share, ceiling_s)
        return faults["cb"]

    def before_stop(stack: RunStack, summary: dict) -> None:
        final = summary["final_version"]
        cb: Faults = faults["cb"]
        deadline = time.monotonic() + timeout_s
        while cb.replica is not None and time.monotonic() < deadline and cb.held() != final:
            time.sleep(1)
        dash = httpx.get(f"http://127.0.0.1:{cfg.local.dashboard_port}/", timeout=10).status_code
        restarted = cb.urls[1:]  # rollouts the late replica served after its restart
        served = sum(f["served"] for f in summary["fleet"] if f["url"] in restarted)
        summary["e2e"] = {
            "faults": cb.events,
            "corrupted": corrupted,
            "dashboard_http": dash,
            "served_after_restart": served,
            "request_shares": {k: round(v, 3) for k, v in cb.shares().items()},
            "plan_complete": cb.plan_complete(),
            "ceiling_s": cb.ceiling_s,
        }

    summary = run(
        cfg,
        callbacks=[make_faults],
        publisher_hook=lambda ctx: corrupt_one_delta(ctx, anchor_every, corrupted),
        before_stop=before_stop,
    )
    report = _report(cfg, summary, steps, min_share)
    with open(os.path.join(cfg.run.run_dir, "e2e.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def _report(cfg: TrainConfig, summary: dict, steps: int, min_share: float) -> dict:
    from deltasync.store import Store

    store = Store(cfg.run.bucket_uri())
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
                    if e["event"].startswith("kill") and rid == LATE
                ),
                None,
            ),
        }
    final = manifest.latest.version
    for r in replicas.values():
        # a replica checks every tensor's digest before it applies a version, so holding the final
        # version whose model digest equals the trainer's means its weights are the trainer's
        r["weights_equal_trainer"] = (
            r["held_version"] == final and manifest.latest.digest == summary["trainer_model_digest"]
        )
    report = {
        "steps_planned": steps,
        "steps_ceiling": cfg.grpo.max_steps,
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
    problems += _fault_problems(report, steps, min_share)
    if not report["corrupted"]:
        problems.append("no delta was corrupted (no anchor+delta version after the threshold)")
    elif not any(r["errors"] for r in replicas.values()):
        problems.append("no replica reported the corrupted delta")
    if problems:
        raise AssertionError("; ".join(problems) + f"\nreport: {json.dumps(report, indent=1)}")
    return report


def _fault_problems(report: dict, steps: int, min_share: float) -> list[str]:
    """What of the fault plan did not happen while training ran (empty: all of it)."""
    events = [e["event"] for e in report["faults"]]
    problems = []
    if report["steps"] < steps:
        problems.append(f"training stopped at step {report['steps']}, before the planned {steps}")
    if "kill (SIGKILL)" not in events:
        problems.append(
            f"{LATE} was never killed: it served no rollout by step {report['steps']} (the ceiling)"
        )
    elif "restart" not in events:
        problems.append(f"{LATE} was killed but not restarted while training ran")
    elif not report["served_after_restart"]:
        problems.append(f"the restarted {LATE} served no rollout before training ended")
    shares = report["request_shares"]
    for rid in report["replicas"]:
        if shares.get(rid, 0.0) < min_share:
            problems.append(
                f"replica {rid} served {shares.get(rid, 0.0):.0%} of the rollout requests, "
                f"expected at least {min_share:.0%}"
            )
    return problems


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.e2e", description=__doc__)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--anchor-every", type=int, default=4)
    p.add_argument("--late-at", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=5)
    p.add_argument("--min-share", type=float, default=MIN_SHARE)
    p.add_argument("--runs-root", default="runs")
    p.add_argument("--run-id", default="e2e")
    p.add_argument(
        "--adapter",
        default=os.environ.get("ADAPTER") or None,
        choices=["lora"],
        help="train a LoRA adapter instead of full weights (ADAPTER=lora): the same journey",
    )
    p.add_argument(
        "--model",
        default=os.environ.get("MODEL") or None,
        help="the model to start from (MODEL=; default: the warm-started local one, tiny)",
    )
    a = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log_policy.quiet_libraries()
    overrides = {k: v for k, v in (("adapter", a.adapter), ("model", a.model)) if v is not None}
    report = run_e2e(
        a.steps,
        a.anchor_every,
        a.late_at,
        a.kill_at,
        a.runs_root,
        a.run_id,
        min_share=a.min_share,
        **overrides,
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
