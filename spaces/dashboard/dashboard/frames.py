"""The dashboard's frames: the columns of every table and plot, and how a :class:`BucketReader`'s
history becomes them (``FramesFromHistory``, the reader's base class). They reach the page in a
:class:`~dashboard.view.RunView`. Imports neither torch nor gradio."""

from __future__ import annotations

import bisect

import pandas as pd

from deltasync.manifest import VersionEntry
from deltasync.status import EvalResult, SyncRecord, TaskFigure, lag_s, lag_versions

BYTES_PER_MB = 1e6  # "MB" in the frames and plots is 10^6 bytes

# Columns of every frame, in order (rows are built as tuples in this order), so empty frames
# still have them: plots and tests rely on this.
COLUMNS: dict[str, list[str]] = {
    # held version of each replica and the trainer's newest version over time (series: "trainer"
    # or a replica id)
    "versions": "time version series".split(),
    # lag per replica over time; source: "sync" (just before / at each apply) or "heartbeat"
    "lag": "time replica lag_versions lag_s source".split(),
    # one row per payload (a version with an anchor and a delta has two): kind "delta" | "anchor"
    "payloads": "version step kind mb bytes files time".split(),
    # one row per version; marker: "delta", "anchor" or "anchor+delta" (anchor markers)
    "density": "version step density density_pct changed total coalesced marker time".split(),
    # one row per sync record; lag_s here is publish -> apply of ``version`` (SyncRecord.lag_s)
    "syncs": (
        "time replica version from_version kind steps mb bytes fetch_s decode_s paused_s apply_s "
        "lag_s apply_path"
    ).split(),
    # the same syncs in long form: phase "fetch" | "decode" | "apply" | "paused"
    "sync_phases": "time replica version phase seconds".split(),
    # one row per trainer step; kl and games: TRL's KL and the step's training games;
    # dropped_episodes: the step's episodes the environment failed (NaN in files written before
    # it was counted); publish_every: the publisher's cadence at the step, syncs between
    # publishes (NaN where no cadence ran, and in files written before it was recorded). Then one
    # column per figure the task declares for its steps (``step_figures``), named as declared.
    "training": (
        "step time version reward loss staleness_mean stale_fraction diff_s encode_s upload_s mb "
        "density kl games dropped_episodes publish_every"
    ).split(),
    # reward per step in long form for one plot: series "train" (the trainer's mean reward) and
    # one series per evaluation, "eval <label> ±SE" (three points at its step: mean - SE, mean,
    # mean + SE, drawn as a vertical error bar)
    "reward": "step reward series".split(),
    # one row per evaluation (TrainerMetrics.evals), then one column per figure the task
    # declares for its evaluations (``eval_figures``; NaN where an evaluation lacks it)
    "evals": "label step version episodes reward_mean reward_se time".split(),
    # the learning curve in long form: one row per evaluation and series (its mean reward,
    # series "reward", and each headline figure the task declares for evaluations, series: the
    # figure's label; label: the evaluation's), and one per trainer step and headline figure of
    # the training games (series "<figure label> (train)", label "training")
    "curve": "step value series label".split(),
    # the task's figures as the run declares them (TrainerMetrics.figures), in declared order;
    # better: "higher", "lower" or "" (neither)
    "figures": "name label unit better steps evals headline counts".split(),
    # the staleness histogram in long form: staleness (versions, as text) -> sample count
    "staleness": "step staleness count".split(),
    # one row per replica heartbeat currently in the bucket
    "status": (
        "replica health status held_version trainer_version lag_versions lag_s heartbeat_age_s "
        "errors last_error apply_path url fleet_state inflight served served_per_s failed"
    ).split(),
}

# The learning curve's series of each evaluation's mean reward; a figure's series is its label,
# and its training games' series its label with TRAIN_SUFFIX.
REWARD_SERIES = "reward"
TRAIN_SUFFIX = " (train)"

# Columns holding text (nominal in plots); "time" is datetime; every other column is numeric.
TEXT_COLUMNS = frozenset(
    {
        "series",
        "replica",
        "source",
        "kind",
        "marker",
        "phase",
        "staleness",
        "health",
        "status",
        "last_error",
        "apply_path",
        "url",
        "fleet_state",
        "label",
        "name",
        "unit",
        "better",
    }
)


def empty_frame(name: str) -> pd.DataFrame:
    """An empty frame with the columns (and dtypes) of ``COLUMNS[name]``."""
    return _frame(name, [])


def _frame(name: str, rows: list[tuple], extra: list[str] = ()) -> pd.DataFrame:
    """Rows (tuples in ``COLUMNS[name]`` order, then ``extra``: the task's figures, numbers) -> a
    frame with stable dtypes, empty or not (Gradio plots pick their axis types from the dtypes:
    datetime -> temporal, numbers -> quantitative, text -> nominal)."""
    df = pd.DataFrame(rows, columns=COLUMNS[name] + list(extra))
    for col in df.columns:
        if col == "time":
            df[col] = pd.to_datetime(df[col].astype("float64"), unit="s")
        elif col in TEXT_COLUMNS and col not in extra:
            df[col] = df[col].astype(object)
        elif df[col].dtype == object:  # empty, or None where not measured
            df[col] = pd.to_numeric(df[col]).astype("float64")
    return df


class FramesFromHistory:
    """The frame builders of ``dashboard.data.BucketReader``, over the history it keeps
    (``_versions``, ``_syncs``, ``_samples``, ``_steps``, ``_evals``, ``_heartbeats``, ``_fleet``,
    ``_served_per_s``, ``_manifest``, ``stalled_after_s``)."""

    def _frames(self, now: float) -> dict[str, pd.DataFrame]:
        versions = [self._versions[k] for k in sorted(self._versions)]
        return {
            "versions": self._versions_frame(versions, now),
            "lag": self._lag_frame(versions),
            "payloads": _payloads_frame(versions),
            "density": _density_frame(versions),
            "syncs": self._syncs_frame(),
            "sync_phases": self._phases_frame(),
            "training": self._training_frame(),
            "reward": self._reward_frame(),
            "evals": self._evals_frame(),
            "curve": self._curve_frame(),
            "figures": self._figures_frame(),
            "staleness": self._staleness_frame(),
            "status": self._status_frame(now),
        }

    def _versions_frame(self, versions: list[VersionEntry], now: float) -> pd.DataFrame:
        rows = [(v.created_at, v.version, "trainer") for v in versions]
        if versions:  # the trainer still holds its newest version now
            rows.append((now, versions[-1].version, "trainer"))
        for rid in sorted(self._samples):
            points = {r.applied_at: r.version for r in self._syncs.get(rid, {}).values()}
            for t, hb in self._samples[rid].items():
                if hb.held_version is not None:
                    points[t] = hb.held_version
            rows += [(t, points[t], rid) for t in sorted(points)]
        return _frame("versions", rows)

    def _lag_frame(self, versions: list[VersionEntry]) -> pd.DataFrame:
        """Lag at each sync (just before: ``applied_at - paused_s`` on ``from_version``; at
        ``applied_at`` on ``version``) and at each heartbeat seen (as the replica reported it)."""
        times = [v.created_at for v in versions]

        def lag_at(t: float, held: int | None) -> tuple[int | None, float | None]:
            i = bisect.bisect_right(times, t)
            if i == 0 or held is None:
                return None, None
            newest = versions[i - 1]
            lv = lag_versions(newest.version, held)
            return lv, lag_s(newest.created_at if lv else None, now=t)

        rows = []
        for rid in sorted(self._samples):
            for rec in sorted(self._syncs.get(rid, {}).values(), key=lambda r: r.applied_at):
                before = (rec.applied_at - rec.paused_s, rec.from_version)
                for t, held in (before, (rec.applied_at, rec.version)):
                    lv, ls = lag_at(t, held)
                    if lv is not None:
                        rows.append((t, rid, lv, ls, "sync"))
            for t, hb in sorted(self._samples[rid].items()):
                if hb.lag_versions is not None:
                    rows.append((t, rid, hb.lag_versions, hb.lag_s, "heartbeat"))
        df = _frame("lag", rows)
        return df.sort_values(["replica", "time"], kind="stable").reset_index(drop=True)

    def _sync_records(self) -> list[tuple[str, SyncRecord]]:
        out = [(rid, r) for rid, recs in self._syncs.items() for r in recs.values()]
        return sorted(out, key=lambda x: (x[1].applied_at, x[0]))

    def _syncs_frame(self) -> pd.DataFrame:
        rows = [
            (
                r.applied_at,
                rid,
                r.version,
                r.from_version,
                r.kind,
                r.steps,
                r.bytes / BYTES_PER_MB,
                r.bytes,
                r.fetch_s,
                r.decode_s,
                r.paused_s,
                r.apply_s,
                r.lag_s,
                r.apply_path,
            )
            for rid, r in self._sync_records()
        ]
        return _frame("syncs", rows)

    def _phases_frame(self) -> pd.DataFrame:
        rows = [
            (r.applied_at, rid, r.version, phase, getattr(r, f"{phase}_s"))
            for rid, r in self._sync_records()
            for phase in ("fetch", "decode", "apply", "paused")
        ]
        return _frame("sync_phases", rows)

    def _declared(self, where: str, headline: bool = False) -> list[TaskFigure]:
        """The run's declared figures of ``where`` ("steps" or "evals") that have one value (not
        named counts), in declared order; ``headline``: the headline ones only."""
        return [
            f
            for f in self._figures
            if getattr(f, where) and not f.counts and (f.headline or not headline)
        ]

    def _figures_frame(self) -> pd.DataFrame:
        better = {True: "higher", False: "lower", None: ""}
        rows = [
            (
                f.name,
                f.label,
                f.unit,
                better[f.higher_is_better],
                f.steps,
                f.evals,
                f.headline,
                f.counts,
            )
            for f in self._figures
        ]
        return _frame("figures", rows)

    def _training_frame(self) -> pd.DataFrame:
        own = [f.name for f in self._declared("steps")]
        rows = []
        for k in sorted(self._steps):
            s = self._steps[k]
            n = sum(s.staleness.values())
            mean = sum(int(b) * c for b, c in s.staleness.items()) / n if n else None
            mb = None if s.bytes is None else s.bytes / BYTES_PER_MB
            rows.append(
                (
                    s.step,
                    s.time,
                    s.version,
                    s.reward,
                    s.loss,
                    mean,
                    s.stale_fraction,
                    s.diff_s,
                    s.encode_s,
                    s.upload_s,
                    mb,
                    s.density,
                    s.kl,
                    s.games,
                    s.dropped_episodes,
                    s.publish_every,
                    *(s.figures.get(name) for name in own),
                )
            )
        return _frame("training", rows, own)

    def _reward_frame(self) -> pd.DataFrame:
        rows = [
            (k, self._steps[k].reward, "train")
            for k in sorted(self._steps)
            if self._steps[k].reward is not None
        ]
        for ev in self._sorted_evals():
            series = f"eval {ev.label} ±SE"
            for y in (ev.reward_mean - ev.reward_se, ev.reward_mean, ev.reward_mean + ev.reward_se):
                rows.append((ev.step, y, series))
        return _frame("reward", rows)

    def _evals_frame(self) -> pd.DataFrame:
        cols = COLUMNS["evals"]
        own = [f.name for f in self._declared("evals")]
        rows = [
            (*(getattr(e, c) for c in cols), *(e.figures.get(name) for name in own))
            for e in self._sorted_evals()
        ]
        return _frame("evals", rows, own)

    def _curve_frame(self) -> pd.DataFrame:
        """The learning curve: each evaluation's mean reward and headline figures at its step (a
        figure an evaluation lacks is left out), then the training games' headline figures per
        step."""
        rows = []
        for e in self._sorted_evals():
            rows.append((e.step, e.reward_mean, REWARD_SERIES, e.label))
            rows += [
                (e.step, e.figures[f.name], f.label, e.label)
                for f in self._declared("evals", headline=True)
                if f.name in e.figures
            ]
        rows += [
            (k, s.figures[f.name], f.label + TRAIN_SUFFIX, "training")
            for f in self._declared("steps", headline=True)
            for k, s in sorted(self._steps.items())
            if f.name in s.figures
        ]
        return _frame("curve", rows)

    def _sorted_evals(self) -> list[EvalResult]:
        """The evaluations seen, by step (then label)."""
        return sorted(self._evals.values(), key=lambda e: (e.step, e.label))

    def _staleness_frame(self) -> pd.DataFrame:
        rows = [
            (k, b, c)
            for k in sorted(self._steps)
            for b, c in sorted(self._steps[k].staleness.items(), key=lambda bc: int(bc[0]))
        ]
        return _frame("staleness", rows)

    def _status_frame(self, now: float) -> pd.DataFrame:
        """One row per replica; lag is recomputed against the manifest's newest version at ``now``
        (a stalled replica's own heartbeat would understate it). health: "ok", "starting",
        "stopped", or flags "STALLED" (heartbeat older than ``stalled_after_s``) and "FAILING"
        (status error/recovering), joined by ", "."""
        latest = self._manifest.latest if self._manifest else None
        trainer_version = latest.version if latest else None
        rows = []
        for rid in sorted(self._heartbeats):
            hb = self._heartbeats[rid]
            age = now - hb.updated_at
            lv = lag_versions(trainer_version, hb.held_version)
            if lv is None:
                lv = hb.lag_versions
            ls = lag_s(latest.created_at if lv else None, now=now) if latest else hb.lag_s
            flags = []
            if age > self.stalled_after_s and hb.status != "stopped":
                flags.append("STALLED")
            if hb.status in ("error", "recovering"):
                flags.append("FAILING")
            quiet = hb.status if hb.status in ("starting", "stopped") else "ok"
            health = ", ".join(flags) or quiet
            # the trainer's router: fleet state and requests (none when it does not route here)
            fm = self._fleet.get(rid)
            rate = self._served_per_s.get(rid)
            fleet = (
                (
                    fm.state,
                    fm.inflight,
                    fm.served,
                    None if rate is None else round(rate, 2),
                    fm.failed,
                )
                if fm
                else ("", None, None, None, None)
            )
            rows.append(
                (
                    rid,
                    health,
                    hb.status,
                    hb.held_version,
                    trainer_version,
                    lv,
                    round(ls, 1),
                    round(age, 1),
                    hb.errors,
                    hb.last_error or "",
                    hb.apply_path,
                    hb.url or "",
                    *fleet,
                )
            )
        return _frame("status", rows)


def _payloads_frame(versions: list[VersionEntry]) -> pd.DataFrame:
    rows = [
        (v.version, v.step, kind, p.bytes / BYTES_PER_MB, p.bytes, len(p.files), v.created_at)
        for v in versions
        for kind, p in (("delta", v.delta), ("anchor", v.anchor))
        if p is not None
    ]
    return _frame("payloads", rows)


def _density_frame(versions: list[VersionEntry]) -> pd.DataFrame:
    rows = []
    for v in versions:
        marker = "delta" if v.anchor is None else ("anchor+delta" if v.delta else "anchor")
        rows.append(
            (
                v.version,
                v.step,
                v.density,
                100 * v.density,
                v.changed,
                v.total,
                v.coalesced,
                marker,
                v.created_at,
            )
        )
    return _frame("density", rows)
