"""``make eval RUN=<run_id> SEEDS=<first>:<count>``: a finished run's held-out games before (its
initial model) and after (its newest bucket version), each through a vLLM replica started here
(the run's task plays them: ``Task.run_evaluation``). Reads the run's ``summary.json``; writes
``runs/<run>/eval-<first>-<count>.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from trainer.local.children import start_env_server, start_replica
from trainer.local.log_policy import quiet_libraries
from trainer.local.replica_poll import wait_version
from trainer.settings import EvalSettings, GRPOSettings
from trainer.task.base import EvalRequest, load_task


def parse_seeds(spec: str) -> list[int]:
    """``"first:count"`` -> the seed list.

    Raises:
        ValueError: not two integers separated by ':' with count >= 2.
    """
    try:
        first, count = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(
            f"expected SEEDS as first:count (e.g. 900000:64), found {spec!r}"
        ) from None
    if count < 2:
        raise ValueError(f"expected at least 2 seeds (a standard error needs 2), found {count}")
    return list(range(first, first + count))


def main(argv: list[str] | None = None) -> None:
    """``make eval RUN=<run_id> SEEDS=<first>:<count>``: before (the run's initial model) and after
    (its newest bucket version), each through a replica started here. For an adapter run,
    "before" is the base model (a new adapter starts as a no-op: PEFT's lora_B is zero) and
    "after" a replica loading the run's newest adapter, requested by its adapter name."""
    p = argparse.ArgumentParser(prog="python -m trainer.eval_run", description=main.__doc__)
    p.add_argument("--run", default=os.environ.get("RUN") or "wordle-local")
    p.add_argument("--seeds", default=os.environ.get("SEEDS") or "900000:128")
    p.add_argument("--runs-root", default="runs")
    p.add_argument("--max-tokens", type=int, default=GRPOSettings.max_completion_length)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_libraries()
    seeds = parse_seeds(args.seeds)
    run_dir = os.path.join(args.runs_root, args.run)
    info_path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(info_path):
        raise SystemExit(
            f"expected a finished run at {run_dir} (summary.json), found none: run make train first"
        )
    with open(info_path) as f:
        info = json.load(f)
    model, bucket = info["initial_model"], info["bucket"]
    settings = info.get("settings", {})
    task = load_task(settings.get("run", {}).get("task", "wordle"))
    # the run's turns an episode (TRL's call cap), its default for a summary that lacks it
    max_turns = settings.get("grpo", {}).get(
        "max_tool_calling_iterations", GRPOSettings.max_tool_calling_iterations
    )
    logs = os.path.join(run_dir, "logs", "eval")
    out, children = {}, []
    try:
        env = start_env_server(task.server, logs)
        children.append(env)
        env.wait_healthy(120)
        empty = os.path.abspath(os.path.join(run_dir, "eval-empty-bucket"))
        os.makedirs(empty, exist_ok=True)
        for label, store in (("before", empty), ("after", bucket)):
            # "before": the initial model itself, from an empty bucket (served unsynced);
            # "after": a replica that follows the run's bucket to its newest version.
            extra = {"REQUIRE_SYNCED": "0"} if store == empty else info.get("replica_env", {})
            replica = start_replica(store, model, logs, f"eval-{label}", extra)
            name = info.get("adapter_name") if store != empty else None  # None: the served model
            children.append(replica)
            replica.wait_healthy(900)
            if store != empty:
                wait_version(replica.url, info["final_version"], 300)
            request = EvalRequest(
                replica.url, model, env.url, name, args.max_tokens, max_turns=max_turns
            )
            out[label] = task.run_evaluation(request, seeds, EvalSettings.temperature)
            replica.stop()
    finally:
        for c in reversed(children):
            c.stop()
    text = json.dumps(out, indent=1)
    print(text)
    with open(os.path.join(run_dir, f"eval-{seeds[0]}-{len(seeds)}.json"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
