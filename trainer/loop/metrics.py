"""Trainer metrics in the bucket (``metrics/trainer.json``, ``deltasync.status.TrainerMetrics``),
rewritten after every logged step so that a dashboard anywhere can read them, plus one dense log
line per step (written above the progress bar).

While the store fails, training goes on and the publisher waits the outage out
(``DeltaPublisher.outage``): each step's line then says ``store=down <s>s pending=<versions>``
(and ``store=back after <=<s>s`` at the first step after it), and ``logs/steps.jsonl`` carries
``publish/store_down_s`` and ``publish/pending``; the publisher logs one line when the outage
starts and one when it ends. ``StepMetrics`` has no field for it: the bucket's file shows the
committed version standing still."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time

from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from deltasync.errors import StoreError
from deltasync.status import (
    TRAINER_METRICS_PATH,
    EvalResult,
    FleetMember,
    StepMetrics,
    TaskFigure,
    TrainerMetrics,
    flat_figures,
)
from deltasync.store import Store

log = logging.getLogger("trainer.loop.metrics")


class DroppedEpisodesError(RuntimeError):
    """Too many episodes failed by the environment (no reward) for too many steps in a row: the
    run stops rather than train on what is left."""


def _num(logs: dict, *keys) -> float | None:
    for k in keys:
        v = logs.get(k)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None


def process_memory() -> dict[str, float]:
    """This process's memory in GB (1e9 bytes), as ``steps.jsonl`` records it each step:
    ``mem/rss_gb`` resident now (``/proc/self/statm``; left out where there is no ``/proc``) and
    ``mem/peak_rss_gb`` the peak so far (``getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    import resource

    out = {}
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        out["mem/rss_gb"] = round(pages * os.sysconf("SC_PAGE_SIZE") / 1e9, 3)
    except (OSError, ValueError, IndexError):
        pass
    out["mem/peak_rss_gb"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3
    )
    return out


class BucketMetricsCallback(TrainerCallback):
    """Collects reward, loss, staleness, the training games and their consistent share, step time
    and publish costs per step and writes them, and the evaluations, to the bucket.

    Args:
        store: the run's store.
        run_id: the run.
        publisher: the DeltaPublisher (its committed entries give bytes, density, timings).
        tagger: the ReplicaVersionTagger (staleness histogram, replica version, the training
            games of each step and their consistent share), or None; ``run()`` sets it once TRL's
            trainer exists (the metrics come first: the evaluations record into them).
        keep: newest steps kept in the file.
        log_path: a local JSON-lines file that receives every logged dict in full (TRL's
            ``perf/*``, ``sample/*``, ``rollout/*`` counters, and the trainer's ``mem/*``:
            :func:`process_memory`), one line per step; None: none.
        min_write_interval_s: on remote stores (hf://, s3://) the file is rewritten at most this
            often (each write costs Hub API calls, shared by the whole fleet); locally after
            every step. Evaluations and the end of training always write.
        fleet: ``f() -> list[dict]``: the fleet's per-replica rows
            (``trainer.fleet.pool.ReplicaPool.replica_rows``), or None.
        step_figures: ``f(counts, games) -> dict``: the task's figures of a step's training
            games (``Task.step_figures``: e.g. Wordle's valid share), or None: none.
        figures: the task's declared figures (``Task.figures``), written once into the file
            (``TrainerMetrics.figures``); the step line shows the declared step figures in this
            order under their labels. A figure the task returns undeclared is recorded all the
            same, with one warning per name.
        max_dropped_fraction: a step whose dropped episodes (the environment failed them:
            ``GameTally.dropped``) are more than this share of its episodes is failing; 1: never.
        max_dropped_steps: after this many failing steps in a row ``on_log`` raises
            :class:`DroppedEpisodesError` (once the metrics are written), which stops the run.

    The file is written on a thread of its own, newest content first (a write waiting behind a
    slow one is replaced by the next): a Hub outage stalls one write for as long as the client's
    retries last (hf_xet's, bounded to ``deltasync.hub_store.XET_RETRY_MAX_DURATION``, and
    huggingface_hub's: docs/BENCHMARKS.md section 13, the user's journey), and the training
    step must not wait for it. A failed write logs one line; the next write carries
    the newer metrics. Evaluations and the end of training wait until their write is done.
    """

    def __init__(
        self,
        store: Store,
        run_id: str,
        publisher,
        tagger=None,
        keep: int = 1000,
        min_write_interval_s: float = 30.0,
        log_path: str | None = None,
        fleet=None,
        step_figures=None,
        figures: tuple[TaskFigure, ...] = (),
        max_dropped_fraction: float = 1.0,
        max_dropped_steps: int = 3,
    ):
        self.max_dropped_fraction = max_dropped_fraction
        self.max_dropped_steps = max_dropped_steps
        self._dropping: list[str] = []  # the failing steps in a row, "step N: d of n"
        self.log_path = log_path
        self.step_figures = step_figures
        self.store = store
        remote = str(store.uri).startswith(("hf://", "s3://"))
        self.min_write_interval_s = min_write_interval_s if remote else 0.0
        self._written_at = float("-inf")
        self._pending: bytes | None = None  # the newest content not yet handed to the store
        self._writing = False
        self._cv = threading.Condition()
        self._writer: threading.Thread | None = None
        self.publisher = publisher
        self.tagger = tagger
        self.keep = keep
        self.figures = tuple(figures)
        self._undeclared: set[tuple[str, str]] = set()  # (figure, where) warned about
        self.metrics = TrainerMetrics(run_id=run_id, figures=list(self.figures))
        self.fleet = fleet
        self.step_s: list[float] = []
        self._step_t0: float | None = None
        self._outage = None  # the publisher's outage at the last logged step

    @classmethod
    def for_run(cls, stack, publisher, task) -> BucketMetricsCallback:
        """The metrics of a run: into its bucket, every step also in ``logs/steps.jsonl``, with
        its fleet's rows and its task's figures of the training games."""
        return cls(
            stack.store,
            stack.cfg.run.run_id,
            publisher,
            log_path=os.path.join(stack.logs_dir, "steps.jsonl"),
            fleet=stack.pool.replica_rows,
            step_figures=task.step_figures,
            figures=task.figures,
            max_dropped_fraction=stack.cfg.grpo.max_dropped_fraction,
            max_dropped_steps=stack.cfg.grpo.max_dropped_steps,
        )

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_t0 is not None:
            self.step_s.append(time.perf_counter() - self._step_t0)

    def step_s_median(self) -> float | None:
        """Median seconds per optimizer step (sample wait + forward/backward + publish diff)."""
        return round(statistics.median(self.step_s), 3) if self.step_s else None

    def summary(self) -> dict:
        """The metrics' part of the run's summary: the step time's median, the stale share, the
        task's declared figures (``figures``: name, label, unit, ...) and the mean of each figure
        over the training steps that measured it (``train_figures``, declared ones first, in
        their order)."""
        return {
            "step_s_median": self.step_s_median(),
            "stale_fraction": self.stale_fraction(),
            "figures": [f.model_dump() for f in self.figures],
            "train_figures": self.train_figures(),
        }

    def train_figures(self) -> dict[str, float]:
        """The mean of each figure over the steps kept that measured it (counts such as
        ``"invalid_reasons/<code>"``: summed), declared figures first in declared order."""
        values: dict[str, list[float]] = {}
        for s in self.metrics.steps:
            for name, v in s.figures.items():
                values.setdefault(name, []).append(v)
        order = {f.name: i for i, f in enumerate(self.figures)}
        out = {}
        for name in sorted(values, key=lambda n: (order.get(n.split("/")[0], len(order)), n)):
            vs = values[name]
            out[name] = round(sum(vs) if "/" in name else statistics.fmean(vs), 4)
        return out

    def _recorded(self, values: dict, where: str, known=frozenset()) -> dict[str, float]:
        """The task's figures ``values`` as recorded (``flat_figures``: None is "not measured"),
        warning once per name that the task did not declare for ``where`` ("steps" or "evals")
        or whose value is neither a number nor named counts (that one cannot be recorded);
        ``known``: keys that are not figures."""
        values = {k: v for k, v in values.items() if k not in known}
        declared = {f.name for f in self.figures if getattr(f, where)}
        kind = "evaluations" if where == "evals" else "training steps"
        for name, v in values.items():
            odd = v is not None and (isinstance(v, bool) or not isinstance(v, (int, float, dict)))
            if (name in declared and not odd) or (name, where) in self._undeclared:
                continue
            self._undeclared.add((name, where))
            if odd:
                log.warning(
                    "the task's %s reported figure %r as %r: expected a number or named counts "
                    "{code: n}; not recorded",
                    kind,
                    name,
                    v,
                )
                continue
            log.warning(
                "the task's %s reported figure %r (%r), which its Task.figures does not declare "
                "for %s: recorded in the bucket's metrics all the same, but the step line and the "
                "dashboard show declared figures only; declare it (deltasync.status.TaskFigure)",
                kind,
                name,
                v,
                where,
            )
        return flat_figures(values)

    def stale_fraction(self) -> float | None:
        """Samples discarded as stale / samples generated (consumed by the trainer or left in the
        queue at the end), from the staleness histogram of every consumed sample."""
        if self.tagger is None:
            return None
        consumed = sum(self.tagger.staleness.values())
        dropped = self.tagger.dropped
        generated = consumed + self.tagger.left_in_queue()
        return round(dropped / generated, 4) if generated else None

    def add_eval(self, label: str, step: int, version: int | None, block: dict) -> None:
        """Record an evaluation block (``Task.run_evaluation``'s) and write the metrics."""
        own = ("episodes", "reward_mean", "reward_se")
        figures = self._recorded(block, "evals", known=frozenset((*own, "per_seed", "draws")))
        self.metrics.evals.append(
            EvalResult(
                label=label,
                step=step,
                version=version,
                figures=figures,
                **{k: block[k] for k in own},
            )
        )
        self._write()
        self.flush()

    def flush(self) -> None:
        """Wait until every metrics content handed over so far is written (or failed)."""
        with self._cv:
            while self._pending is not None or self._writing:
                self._cv.wait()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    self._cv.wait()
                payload, self._pending, self._writing = self._pending, None, True
            try:
                self.store.write_bytes(TRAINER_METRICS_PATH, payload)
            except StoreError as e:  # the next write carries newer metrics; training goes on
                log.warning("metrics not written (the next step's write retries): %s", e)
            finally:
                with self._cv:
                    self._writing = False
                    self._cv.notify_all()

    def _write(self, force: bool = True) -> None:
        now = time.monotonic()
        if not force and now - self._written_at < self.min_write_interval_s:
            return
        self._written_at = now
        self.metrics.updated_at = time.time()
        if self.fleet is not None:
            self.metrics.fleet = [
                FleetMember(**{k: r[k] for k in FleetMember.model_fields}) for r in self.fleet()
            ]
        payload = self.metrics.model_dump_json().encode()
        with self._cv:
            self._pending = payload
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name="metrics-writer", daemon=True
                )
                self._writer.start()
            self._cv.notify_all()

    def on_train_end(self, args, state, control, **kwargs):
        self._write()
        self.flush()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs and "reward" not in logs:
            return
        entry = self.publisher.published[-1] if self.publisher.published else None
        games = self.tagger.take_games() if self.tagger else None
        step_s = self.step_s[-1] if self.step_s else None
        tokens = _num(logs, "batch/forwarded_tokens_per_step")
        figures = {}
        if games is not None and self.step_figures is not None:
            figures = self._recorded(self.step_figures(dict(games.counts), games.games), "steps")
        outage = getattr(self.publisher, "outage", None)  # deltasync.publisher.PublishOutage
        store = (
            {
                "publish/store_down_s": round(outage.duration_s(), 1),
                "publish/pending": outage.pending,
            }
            if outage is not None
            else {}
        )
        if self.log_path is not None:
            played = {f"games/{k}": v for k, v in figures.items()}
            with open(self.log_path, "a") as f:
                mem = process_memory()  # the trainer's: a run that grows shows it step by step
                f.write(
                    json.dumps({"step": state.global_step, **logs, **played, **store, **mem}) + "\n"
                )
        m = StepMetrics(
            step=state.global_step,
            version=entry.version if entry else None,
            reward=_num(logs, "reward", "rewards/mean"),
            loss=_num(logs, "loss"),
            staleness={str(k): v for k, v in sorted(self.tagger.staleness.items())}
            if self.tagger
            else {},
            diff_s=entry.timings_s.get("diff_s") if entry else None,
            encode_s=entry.timings_s.get("encode_s") if entry else None,
            upload_s=entry.timings_s.get("write_upload_s") if entry else None,
            bytes=(entry.delta.bytes if entry and entry.delta else None),
            density=entry.density if entry and entry.delta else None,
            stale_fraction=self.stale_fraction(),
            turns_mean=_num(logs, "rollout/turns_mean"),
            games=games.games if games else None,
            figures=figures,
            kl=_num(logs, "kl"),
            clipped=_num(logs, "clip_ratio/region_mean"),
            tokens_per_s=round(tokens / step_s, 1) if tokens and step_s else None,
            dropped_episodes=games.dropped if games else None,
            publish_every=getattr(getattr(self.publisher, "cadence", None), "k", None),
        )
        self.metrics.steps = (self.metrics.steps + [m])[-self.keep :]
        self._write(force=False)
        rv = self.tagger.replica_version if self.tagger else None
        msg = (
            f"step {m.step} reward={_fmt(m.reward)} turns={_fmt(m.turns_mean, 2)}"
            f"{self._figures_note(m.figures)} games={m.games} "
            f"loss={_fmt(m.loss)} kl={_fmt(m.kl, 4)} step_s={_fmt(step_s, 1)} "
            f"v{m.version} replica=v{rv} stale={_fmt(m.stale_fraction, 2)} "
            f"bytes={m.bytes} density={_fmt(m.density, 5)}"
        )
        if m.publish_every is not None:  # the publisher's cadence: syncs between publishes
            msg += f" every={m.publish_every}"
        if m.dropped_episodes:
            msg += f" dropped={m.dropped_episodes}/{m.dropped_episodes + (m.games or 0)}"
        msg += self._store_note(outage)
        tqdm.write(msg)  # above the progress bar; the bar's own per-log dict is silenced
        log.debug(msg)
        self._check_dropped(m)

    def _figures_note(self, figures: dict[str, float]) -> str:
        """The step line's task figures: each declared step figure with a single value, in
        declared order, as ``label=value`` (spaces in the label as ``_``; a share to 2 digits,
        another number to 3 significant ones; None where the step did not measure it)."""
        out = ""
        for f in self.figures:
            if not f.steps or f.counts:
                continue  # named counts ("<name>/<code>") are in the bucket and steps.jsonl
            v = figures.get(f.name)
            text = None if v is None else (f"{v:.2f}" if f.unit == "share" else f"{v:.3g}")
            out += f" {f.label.replace(' ', '_')}={text}"
        return out

    def _check_dropped(self, m: StepMetrics) -> None:
        """Count a step whose dropped share is over ``max_dropped_fraction``; after
        ``max_dropped_steps`` of them in a row, write the metrics and raise.

        Raises:
            DroppedEpisodesError: names the steps, their dropped and total episodes, the
                settings and what to check.
        """
        dropped = m.dropped_episodes or 0
        total = dropped + (m.games or 0)
        if total == 0:
            return  # no episode taken this step: the streak neither grows nor ends
        if dropped / total <= self.max_dropped_fraction:
            self._dropping = []
            return
        self._dropping.append(f"step {m.step}: {dropped} of {total}")
        if len(self._dropping) < self.max_dropped_steps:
            return
        self._write()
        self.flush()
        raise DroppedEpisodesError(
            f"expected at most {self.max_dropped_fraction:g} of a step's episodes dropped, found "
            f"more for {len(self._dropping)} steps in a row ({'; '.join(self._dropping)}): the "
            "environment failed them (no reward; the log says why, e.g. 'Wordle server "
            "unreachable'). Check that ENV_URL answers (and its key, WORDLE_API_KEY, if it has "
            "one), or raise --max-dropped-fraction / --max-dropped-steps"
        )

    def _store_note(self, outage) -> str:
        """The step line's note on a store outage: while it lasts, and once after it ended."""
        before, self._outage = self._outage, outage
        if outage is not None:
            return f" store=down {outage.duration_s():.0f}s pending={outage.pending}"
        if before is not None:
            return f" store=back after <={before.duration_s():.0f}s"
        return ""


class _QuietProgress(ProgressCallback):
    """transformers' progress bar without its per-step dump of the whole log dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return


def quiet_progress(trainer) -> None:
    """Keep the trainer's tqdm bar but drop its per-step log dump (our one dense line replaces
    it), through the public ``remove_callback`` / ``add_callback``."""
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_QuietProgress())


def _fmt(x, digits=3):
    return None if x is None else f"{x:.{digits}f}"
