"""What lag does to learning, and what each off-policy correction recovers: the lag x mode table
(docs/BENCHMARKS.md section 12 (catch-up against lag), "The lag x mode learning table").

Each cell is one local run from the same cached warm start (the model `make train` builds), the
same seed and the same GRPO settings, differing only in
  - the forced lag: each local replica pulls every ``k`` versions (``--replica-sync-every k``;
    k = 1 is today's local run, whose samples are ~2 versions old), and
  - the off-policy mode (``--off-policy off|tis|decoupled``; ``trainer.loop.off_policy``).
Every run rebuilds the generating policy (``--off-policy-stats true``), so each pays the same
recomputation and logs the same ``offpolicy/*`` statistics; ``off`` leaves TRL's loss as it is.
``--max-staleness 12`` keeps every sample of the k = 8 runs. Held-out: the 512 evaluation seeds
before and after, paired per game (``summary.json``'s ``eval_paired``).

    .venv/bin/python bench/bench_lag_modes.py --run      # the runs (~8 min each on 2 cores)
    .venv/bin/python bench/bench_lag_modes.py --run --repeat 8:off:2,8:decoupled:2   # + repeats
    .venv/bin/python bench/bench_lag_modes.py            # the table from runs/lag-*/
    .venv/bin/python bench/bench_lag_modes.py --smoke    # one cell, 2 steps, in a temp folder

Runs already finished (``runs/lag-s<k>-<mode>/summary.json``) are not run again. ``--smoke`` runs
one cell (k = 1, ``decoupled``) for ``SMOKE_STEPS`` steps with ``SMOKE_FLAGS`` (a small warm start
and evaluation) in a temporary runs folder, with its own warm-start cache there, and writes its
table's figures under bench/results/smoke/.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from report import parse_with_smoke, save, smoke_path

ROOT = Path(__file__).resolve().parents[1]
LAGS = (1, 4, 8)
MODES = ("off", "tis", "decoupled")
STEPS = 30
EPISODES = 512
# --smoke: one cell, two steps, a small warm start, 4 held-out games before and after
SMOKE_CELLS = [(1, "decoupled", 1)]
SMOKE_STEPS = 2
SMOKE_EPISODES = 4
SMOKE_FLAGS = ["--warm-start-games", "100", "--warm-start-epochs", "1", "--token-budget", "4096"]


def run_id(lag: int, mode: str, repeat: int = 1) -> str:
    """The run's id (and folder under ``runs/``) for one cell and repeat."""
    return f"lag-s{lag}-{mode}" + (f"-r{repeat}" if repeat > 1 else "")


def command(
    lag: int, mode: str, repeat: int = 1, steps: int = STEPS, episodes: int = EPISODES
) -> list[str]:
    """The trainer command of one cell (a repeat runs the same command under another id)."""
    cmd = [sys.executable, "-m", "trainer", "--run-id", run_id(lag, mode, repeat)]
    cmd += ["--max-steps", str(steps), "--eval-episodes", str(episodes), "--eval-every", "0"]
    cmd += ["--dashboard", "false", "--max-staleness", "12"]
    cmd += ["--off-policy", mode, "--off-policy-stats", "true"]
    return cmd + (["--replica-sync-every", str(lag)] if lag > 1 else [])


def run_all(runs: Path, cells: list[tuple[int, str, int]], smoke: bool = False) -> None:
    """Run the cells ``(lag, mode, repeat)`` not yet finished, one after another (each takes
    both cores), with their run folders under ``runs``; ``smoke``: ``SMOKE_STEPS`` steps,
    ``SMOKE_EPISODES`` held-out games and ``SMOKE_FLAGS``, and a failed run's log tail printed."""
    for lag, mode, repeat in cells:
        if (runs / run_id(lag, mode, repeat) / "summary.json").exists():
            continue
        runs.mkdir(parents=True, exist_ok=True)
        size = (SMOKE_STEPS, SMOKE_EPISODES) if smoke else (STEPS, EPISODES)
        cmd = command(lag, mode, repeat, *size) + (SMOKE_FLAGS if smoke else [])
        cmd += ["--runs-root", str(runs)]
        log = runs / f"{run_id(lag, mode, repeat)}.out"
        with open(log, "w") as out:
            try:
                subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=out, check=True)
            except subprocess.CalledProcessError:
                if smoke:  # its folder is a temporary one: show why here
                    print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
                raise


def finished(runs: Path) -> list[tuple[int, str, int]]:
    """The cells ``(lag, mode, repeat)`` with a summary under ``runs``, in table order."""
    out = []
    for lag in LAGS:
        for mode in MODES:
            repeat = 1
            while (runs / run_id(lag, mode, repeat) / "summary.json").exists():
                out.append((lag, mode, repeat))
                repeat += 1
    return out


def steps_of(folder: Path) -> list[dict]:
    """The trainer's step records (``logs/steps.jsonl``)."""
    with open(folder / "logs" / "steps.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def mean(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def cell(folder: Path) -> dict:
    """One run's row: staleness, held-out figures, the correction's statistics, cost."""
    s = json.loads((folder / "summary.json").read_text())
    steps = [r for r in steps_of(folder) if "loss" in r]
    stale = {int(k): v for k, v in s["staleness"].items()}
    n = sum(stale.values())
    drift: dict[int, list[float]] = {}
    for r in steps:
        for key, value in r.items():
            if key.startswith("offpolicy/kl_drift_lag"):
                lag = int(key.removeprefix("offpolicy/kl_drift_lag"))
                tokens = r[f"offpolicy/tokens_lag{lag}"]
                acc = drift.setdefault(lag, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + value * tokens, acc[1] + tokens
    return {
        "staleness_mean": sum(k * v for k, v in stale.items()) / n,
        "staleness_max": max(stale),
        "staleness": stale,
        "dropped": s["staleness_dropped"],
        "gain": s["eval_paired"]["reward_diff"],
        "gain_se": s["eval_paired"]["reward_diff_se"],
        "win_before": s["eval_before"]["win_rate"],
        "win_after": s["eval_after"]["win_rate"],
        "consistent_after": s["eval_after"]["consistent_rate"],
        "train_s_per_step": s["train_s"] / s["steps"],
        "recompute_s": mean(r.get("offpolicy/seconds") for r in steps),
        "weight_mean": mean(r.get("offpolicy/weight_mean") for r in steps),
        "weight_min": min(
            (r["offpolicy/weight_min"] for r in steps if "offpolicy/weight_min" in r),
            default=float("nan"),
        ),
        "truncated": mean(r.get("offpolicy/truncated") for r in steps),
        "kl_mismatch": mean(r.get("offpolicy/kl_mismatch") for r in steps),
        "kl_drift_by_lag": {k: t / c for k, (t, c) in sorted(drift.items()) if c},
        "trl_kl": mean(r.get("kl") for r in steps),
        "clipped": mean(r.get("clip_ratio/region_mean") for r in steps),
        "bit_exact": s["replica_bit_exact"],
    }


def table(runs: Path) -> str:
    """The markdown tables of every finished cell."""
    rows, drift_rows = [], []
    for lag, mode, repeat in finished(runs):
        c = cell(runs / run_id(lag, mode, repeat))
        name = mode + (f" (repeat {repeat})" if repeat > 1 else "")
        rows.append(
            f"| {lag} | {name} | {c['staleness_mean']:.2f} (max {c['staleness_max']}) | "
            f"{c['gain']:+.3f} +- {c['gain_se']:.3f} | {c['win_before']:.3f} -> "
            f"{c['win_after']:.3f} | {c['consistent_after']:.3f} | {c['train_s_per_step']:.1f} | "
            f"{c['recompute_s']:.2f} | {c['trl_kl']:.4f} / {c['clipped']:.3f} | "
            f"{'yes' if c['bit_exact'] else 'NO'} |"
        )
        by_lag = ", ".join(f"{k}: {v:.4f}" for k, v in c["kl_drift_by_lag"].items())
        drift_rows.append(
            f"| {lag} | {name} | {c['weight_mean']:.4f} / {c['weight_min']:.3f} | "
            f"{c['truncated']:.3f} | {c['kl_mismatch']:.5f} | {by_lag} |"
        )
    head = (
        "| sync every | mode | staleness mean (max) | paired gain (512 games) | win before -> after "
        "| consistent after | training s/step | recomputation s/step | TRL kl / clipped share "
        "| bit-exact |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    head2 = (
        "| sync every | mode | weight mean / min | truncated | mismatch KL (k3/token) | drift KL "
        "(k3/token) by lag |\n|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(rows) + "\n\n" + head2 + "\n".join(drift_rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="run the cells not yet finished")
    parser.add_argument(
        "--repeat", default="", help="also run repeats: 'LAG:MODE:N,...' (e.g. 8:off:2)"
    )
    parser.add_argument("--runs", default=str(ROOT / "runs"), help="the runs' folder")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lag_modes.json"))
    args = parse_with_smoke(parser, {"runs": None, "out": smoke_path("lag_modes.json")})
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="bench-lag-modes-") as tmp:
            runs = Path(args.runs or tmp)
            run_all(runs, SMOKE_CELLS, smoke=True)
            if finished(runs) != SMOKE_CELLS:
                raise SystemExit(
                    f"--smoke: expected {SMOKE_CELLS} finished, found {finished(runs)}"
                )
            report(runs, args.out)
        return
    runs = Path(args.runs)
    if args.run:
        cells = [(lag, mode, 1) for lag in LAGS for mode in MODES]
        for item in filter(None, args.repeat.split(",")):
            lag, mode, n = item.split(":")
            cells += [(int(lag), mode, r) for r in range(2, int(n) + 1)]
        run_all(runs, cells)
    report(runs, args.out)


def report(runs: Path, out: str) -> None:
    """Print the tables of the finished cells under ``runs`` and write their rows to ``out``."""
    print(table(runs))
    save(out, {run_id(*c): cell(runs / run_id(*c)) for c in finished(runs)})


if __name__ == "__main__":
    main()
