"""The dashboard's Gradio app: live plots and a status table of one run's bucket.

``build_app(config)`` returns a ``gr.Blocks`` that polls the bucket through one shared
:class:`~dashboard.data.BucketReader` on a ``gr.Timer`` (every open page ticks, but the
bucket is read at most once per ``refresh_s / 2``, and less often while nothing changes:
``BucketReader.next_read_delay_s``; a tick that finds the same snapshot sends nothing). API routes
(``gradio_client``): ``/status`` (state, a public message and the status table as JSON) and
``/refresh`` (every output of the page).

Public pages show no bucket URI, local path or exception text: the state's public line (e.g.
"bucket unreadable: token lacks access") and each replica's error kind only. Uploads are capped
at 1 KB (the dashboard takes none).
"""

from __future__ import annotations

import logging
import math
import threading
import time

import gradio as gr
import pandas as pd

from .config import DashboardConfig
from .data import BucketReader, public_error
from .frames import Snapshot

log = logging.getLogger("dashboard")

FLAG_STYLE = "background-color: #fde2e1; color: #8a1c1c; font-weight: 600"
# Replicas take these in sorted order; fixed colors for the other categories.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
FIXED_COLORS = {
    "trainer": "#222222",
    "anchor": "#d62728",
    "delta": "#1f77b4",
    "anchor+delta": "#ff7f0e",
    "fetch": "#1f77b4",
    "decode": "#ff7f0e",
    "apply": "#2ca02c",
    "paused": "#d62728",
}
STALENESS_COLORS = ["#2ca02c", "#bcbd22", "#ff7f0e", "#d62728", "#8c564b", "#7f7f7f"]


class SharedReader:
    """One reader for every page: returns the last snapshot if it is younger than ``min_age_s``."""

    def __init__(self, reader: BucketReader, min_age_s: float):
        self.reader = reader
        self.min_age_s = min_age_s
        self._lock = threading.Lock()
        self._last: Snapshot | None = None
        self._last_mono = 0.0

    def snapshot(self) -> Snapshot:
        """A snapshot at most max(``min_age_s``, ``reader.next_read_delay_s()``) seconds old."""
        with self._lock:
            age = max(self.min_age_s, self.reader.next_read_delay_s())
            if self._last is None or time.monotonic() - self._last_mono >= age:
                self._last = self.reader.read()
                self._last_mono = time.monotonic()
            return self._last


def _jsonable(df: pd.DataFrame) -> list[dict]:
    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    return [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
        for r in rows
    ]


def status_payload(snap: Snapshot) -> dict:
    """The ``/status`` answer: state, public message, run, trainer version and one dict per
    replica (its error kind only: no paths, URIs or exception text)."""
    return {
        "state": snap.state,
        "message": snap.public,
        "run_id": snap.run_id,
        "trainer_version": snap.trainer_version,
        "read_at": snap.read_at,
        "warnings": len(snap.warnings),
        "replicas": _jsonable(public_status(snap.frame("status"))),
    }


def public_status(df: pd.DataFrame) -> pd.DataFrame:
    """The status table as public pages show it: ``last_error`` reduced to its kind."""
    out = df.copy()
    if len(out):
        out["last_error"] = [public_error(e) for e in out["last_error"]]
    return out


def _styled_status(df: pd.DataFrame):
    """The status table with flagged (STALLED/FAILING) rows highlighted."""
    if df.empty:
        return df

    def row_style(row):
        bad = "STALLED" in row["health"] or "FAILING" in row["health"]
        return [FLAG_STYLE if bad else ""] * len(row)

    whole = ["held_version", "trainer_version", "lag_versions", "errors"]
    return (
        df.style.apply(row_style, axis=1)
        .format(precision=1, na_rep="")
        .format("{:.0f}", subset=whole, na_rep="")
    )


def _color_of(category: str, replicas: list[str]) -> str:
    if category in FIXED_COLORS:
        return FIXED_COLORS[category]
    if category.isdigit():  # a staleness bucket
        return STALENESS_COLORS[min(int(category), len(STALENESS_COLORS) - 1)]
    i = replicas.index(category) if category in replicas else len(replicas)
    return PALETTE[i % len(PALETTE)]


def plot_update(df: pd.DataFrame, color: str | None, replicas: list[str], seen: dict):
    """A plot's new value, with a ``color_map`` of the categories present.

    Gradio's native plots fix their color domain when they build the chart, and rebuild only when
    a setting such as ``color_map`` changes, not on new data; a rebuild triggered together with
    new data may still see the previous data. So a category that appears later (a new replica,
    the first delta after an anchor, a staleness bucket) would stay invisible. The map therefore
    carries a generation key (``~gen``) that changes when the set of categories changes and once
    more on the next refresh, which rebuilds the chart on data that has them all; otherwise the
    map stays the same and new data only updates the chart. It also keeps each replica's color
    the same in every plot.

    Args:
        df: the plot's frame.
        color: the plot's color column (None: no color, the frame is returned as it is).
        replicas: every replica id, sorted (their palette order).
        seen: this page's state for this plot, updated in place: ``cats`` (the categories last
            sent), ``gen`` (the generation) and ``settle`` (rebuild once more next refresh).
    """
    if color is None:
        return df
    cats = sorted(str(c) for c in df[color].dropna().unique())
    if cats != seen.get("cats"):
        seen["cats"], seen["settle"] = cats, True
        seen["gen"] = seen.get("gen", 0) + 1
    elif seen.get("settle"):
        seen["settle"] = False
        seen["gen"] += 1
    cmap = {c: _color_of(c, replicas) for c in cats}
    cmap["~gen"] = str(seen["gen"])  # never a category: only makes the map differ
    return gr.update(value=df, color_map=cmap)


def build_app(config: DashboardConfig, reader: BucketReader | None = None) -> gr.Blocks:
    """The dashboard for ``config.bucket`` (``reader``: an existing BucketReader, for tests)."""
    reader = reader or BucketReader(config.bucket, stalled_after_s=config.stalled_after_s)
    shared = SharedReader(reader, min_age_s=config.refresh_s / 2)
    plot = {"height": 260, "x_title": "time (UTC)", "x_axis_format": "%H:%M:%S"}

    with gr.Blocks(title="deltasync dashboard") as demo:
        gr.Markdown("## deltasync: sync lag and training")
        summary = gr.Markdown("reading the bucket…", elem_id="summary")
        status = gr.Dataframe(
            label="Replicas (lag = trainer version − replica version; STALLED: heartbeat older "
            f"than {config.stalled_after_s:.0f} s)",
            interactive=False,
            elem_id="status-table",
            wrap=True,
        )
        with gr.Row():
            reward = gr.LinePlot(
                x="step",
                y="reward",
                color="series",
                title="Reward per step, evaluations as mean ± SE",
                x_title="trainer step",
                y_title="mean reward",
                elem_id="plot-reward",
                height=260,
            )
            lag_s_main = gr.LinePlot(
                x="time",
                y="lag_s",
                color="replica",
                title="Sync lag (seconds)",
                y_title="seconds behind newest publish",
                elem_id="plot-lag-seconds-main",
                **plot,
            )
        with gr.Row():
            versions = gr.LinePlot(
                x="time",
                y="version",
                color="series",
                title="Held version vs trainer version",
                y_title="version",
                elem_id="plot-versions",
                **plot,
            )
            lag_v = gr.LinePlot(
                x="time",
                y="lag_versions",
                color="replica",
                title="Lag (versions)",
                y_title="versions behind",
                elem_id="plot-lag-versions",
                **plot,
            )
            lag_s = gr.LinePlot(
                x="time",
                y="lag_s",
                color="replica",
                title="Lag (seconds)",
                y_title="seconds behind newest publish",
                elem_id="plot-lag-seconds",
                **plot,
            )
        with gr.Row():
            payload = gr.BarPlot(
                x="version",
                y="mb",
                color="kind",
                title="Payload per version (anchors marked)",
                x_title="version",
                y_title="MB (10^6 bytes)",
                elem_id="plot-payload",
                height=260,
            )
            density = gr.ScatterPlot(
                x="version",
                y="density_pct",
                color="marker",
                title="Delta density",
                x_title="version",
                y_title="changed elements (%)",
                elem_id="plot-density",
                height=260,
            )
        with gr.Row():
            paused = gr.ScatterPlot(
                x="time",
                y="paused_s",
                color="replica",
                title="Paused window per sync",
                y_title="generation paused (s)",
                elem_id="plot-paused",
                **plot,
            )
            phases = gr.ScatterPlot(
                x="time",
                y="seconds",
                color="phase",
                title="Fetch / decode / apply per sync",
                y_title="seconds",
                elem_id="plot-phases",
                **plot,
            )
        with gr.Row():
            stale = gr.LinePlot(
                x="step",
                y="stale_fraction",
                title="Stale fraction (discarded / generated samples)",
                x_title="trainer step",
                y_title="fraction",
                elem_id="plot-stale-fraction",
                height=260,
            )
            staleness = gr.BarPlot(
                x="step",
                y="count",
                color="staleness",
                title="Staleness of training samples",
                x_title="trainer step",
                y_title="samples (by versions stale)",
                elem_id="plot-staleness",
                height=260,
            )

        plots = [
            (versions, "versions"),
            (lag_v, "lag"),
            (lag_s, "lag"),
            (payload, "payloads"),
            (density, "density"),
            (paused, "syncs"),
            (phases, "sync_phases"),
            (reward, "reward"),
            (lag_s_main, "lag"),
            (stale, "training"),
            (staleness, "staleness"),
        ]

        seen = gr.State(dict)  # per page: {plot index: categories sent, settle flag}

        def refresh(seen: dict):
            snap = shared.snapshot()
            settling = any(v.get("settle") for k, v in seen.items() if isinstance(k, int))
            key = [id(snap), snap.read_at]
            if seen.get("snap") == key and not settling:  # nothing new: send nothing
                return tuple(gr.skip() for _ in outputs)
            seen["snap"] = key
            known = set(snap.frame("versions").series) | set(snap.frame("status").replica)
            replicas = sorted(known - {"trainer"})
            status_df = public_status(snap.frame("status"))
            out = [snap.markdown(public=True), _styled_status(status_df)]
            out += [
                plot_update(snap.frame(name), p.color, replicas, seen.setdefault(i, {}))
                for i, (p, name) in enumerate(plots)
            ]
            return (*out, seen)

        outputs = [summary, status, *(p for p, _ in plots), seen]
        timer = gr.Timer(config.refresh_s)
        timer.tick(
            refresh, inputs=seen, outputs=outputs, api_name="refresh", show_progress="hidden"
        )
        demo.load(
            refresh, inputs=seen, outputs=outputs, api_visibility="private", show_progress="hidden"
        )

        def status_api() -> dict:
            """State, message and the status table of the bucket, as JSON."""
            return status_payload(shared.snapshot())

        gr.api(status_api, api_name="status")
    return demo


def serve(config: DashboardConfig) -> None:
    """Build the app and serve it until interrupted (blocks)."""
    log.info(
        "dashboard on http://%s:%d for %s (refresh %.1fs)",
        config.host,
        config.port,
        config.bucket,
        config.refresh_s,
    )
    build_app(config).launch(
        server_name=config.host,
        server_port=config.port,
        show_error=False,  # exception text stays in the log, not on the public page
        max_file_size="1kb",  # the dashboard takes no uploads
        footer_links=["api"],
    )
