"""The dashboard's Gradio app: live plots and a status table of one run's bucket.

``build_app(config)`` returns a ``gr.Blocks`` that polls the bucket through one shared
:class:`~dashboard.data.BucketReader` on a ``gr.Timer`` (every open page ticks, but the bucket is
read at most once per ``refresh_s / 2``, and less often while nothing changes:
``BucketReader.next_read_delay_s``; a tick that finds the same ``RunView`` sends nothing). API
routes (``gradio_client``): ``/status`` (state, a public message and the status table as JSON,
under the frame's column names) and ``/refresh`` (every output of the page).

The page is written for people: the status table's headers are words with their units
("Held version", "Lag (s)": ``STATUS_HEADERS``) that break between words only (``PAGE_CSS``,
passed to ``launch`` by :func:`serve`), and plot titles are short enough to fit their plot.

Public pages show no bucket URI, local path or exception text: the state's public line (e.g.
"bucket unreadable: token lacks access") and each replica's error kind only.

An adapter run (``RunView.adapter``) is named in the summary ("LoRA adapter r=8, alpha 16 on
...", the base model left out when it is a path), and its plots and status table say "adapter
version" and "adapter bytes" (``ADAPTER_LABELS``, ``ADAPTER_STATUS_HEADERS``); a full-weight run's
page is the page as built. Uploads are capped at 1 KB (the dashboard takes none).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import NamedTuple

import gradio as gr
import pandas as pd

from .config import DashboardConfig
from .data import BucketReader
from .problems import public_error
from .view import RunView, public_adapter

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
    # the learning curve: its reward (dashboard.frames.REWARD_SERIES), and Wordle's figures by
    # label (another task's figures take the palette's colors)
    "reward": "#1f77b4",
    "win rate": "#2ca02c",
    "consistent": "#d62728",
    "consistent (train)": "#f4a6a6",
    "valid": "#9467bd",
    "valid (train)": "#c5b0d5",
}
STALENESS_COLORS = ["#2ca02c", "#bcbd22", "#ff7f0e", "#d62728", "#8c564b", "#7f7f7f"]


class PlotSpec(NamedTuple):
    """One plot of the page: where it stands, what it draws and how it is labelled."""

    row: int  # the page row it stands in (0: top); left to right in ``PLOTS`` order
    kind: type[gr.LinePlot | gr.BarPlot | gr.ScatterPlot]
    frame: str  # the RunView frame it draws
    x: str  # a key of ``X_AXES``
    y: str
    color: str | None  # the column that splits it into series (None: a single series)
    elem_id: str
    title: str
    y_title: str
    tooltip: str | list[str] = "axis"  # Gradio's: "axis", or the columns a point's tooltip shows


# The page's plots in the order ``/refresh`` sends them (its clients unpack them by position).
# A table: one plot a line, its columns those of PlotSpec, so the formatter leaves it as laid out.
# fmt: off
PLOTS = [
    PlotSpec(1, gr.LinePlot, "versions", "time", "version", "series", "plot-versions", "Held version vs trainer version", "version"),
    PlotSpec(1, gr.LinePlot, "lag", "time", "lag_versions", "replica", "plot-lag-versions", "Lag (versions)", "versions behind"),
    PlotSpec(1, gr.LinePlot, "lag", "time", "lag_s", "replica", "plot-lag-seconds", "Lag (seconds)", "seconds behind trainer"),
    PlotSpec(2, gr.BarPlot, "payloads", "version", "mb", "kind", "plot-payload", "Payload per version (anchors marked)", "MB (10^6 bytes)"),
    PlotSpec(2, gr.ScatterPlot, "density", "version", "density_pct", "marker", "plot-density", "Delta density", "changed elements (%)"),
    PlotSpec(3, gr.ScatterPlot, "syncs", "time", "paused_s", "replica", "plot-paused", "Paused window per sync", "generation paused (s)"),
    PlotSpec(3, gr.ScatterPlot, "sync_phases", "time", "seconds", "phase", "plot-phases", "Fetch / decode / apply per sync", "seconds"),
    PlotSpec(0, gr.LinePlot, "reward", "step", "reward", "series", "plot-reward", "Reward per step (evals: mean ± SE)", "mean reward"),
    PlotSpec(0, gr.LinePlot, "curve", "step", "value", "series", "plot-curve", "Learning curve (held-out evals)", "share / mean reward", ["label", "series", "step", "value"]),
    PlotSpec(4, gr.LinePlot, "training", "step", "stale_fraction", None, "plot-stale-fraction", "Stale fraction of samples", "discarded / generated"),
    PlotSpec(4, gr.BarPlot, "staleness", "step", "count", "staleness", "plot-staleness", "Staleness of training samples", "samples (by versions stale)"),
]
# fmt: on
# Each x column's axis: its title, and for clock times the format of the tick labels.
X_AXES = {
    "time": {"x_title": "time (UTC)", "x_axis_format": "%H:%M:%S"},
    "step": {"x_title": "trainer step"},
    "version": {"x_title": "version"},
}
PLOT_HEIGHT = 260
# What an adapter run's plots say instead of ``PLOTS``' and ``X_AXES``' labels (elem_id -> Gradio's
# title / y_title / x_title): its versions, bytes and lag are the adapter's, and its replicas load
# each version without pausing. Plots not named here read the same in both kinds of run.
# fmt: off
ADAPTER_LABELS = {
    "plot-versions": {"title": "Held vs trainer adapter version", "y_title": "adapter version"},
    "plot-lag-versions": {"title": "Lag (adapter versions)", "y_title": "adapter versions behind"},
    "plot-lag-seconds": {"title": "Adapter lag (seconds)"},
    "plot-payload": {"title": "Adapter bytes per version (anchors marked)", "y_title": "adapter MB (10^6 bytes)", "x_title": "adapter version"},
    "plot-density": {"title": "Adapter delta density", "x_title": "adapter version"},
    "plot-paused": {"title": "Pause per adapter sync (loads don't pause)"},
    "plot-phases": {"title": "Fetch / decode / apply (load) per adapter sync"},
}
# fmt: on
# The status table's headers as the page shows them: words, units in parentheses (frame column ->
# header). The frame, the /status API and the code keep the column names.
STATUS_HEADERS = {
    "replica": "Replica",
    "health": "Health",
    "status": "Status",
    "held_version": "Held version",
    "trainer_version": "Trainer version",
    "lag_versions": "Lag (versions)",
    "lag_s": "Lag (s)",
    "heartbeat_age_s": "Heartbeat age (s)",
    "errors": "Errors",
    "last_error": "Last error",
    "apply_path": "Apply path",
    "url": "URL",
    # the trainer's router: its state of the replica (joining, serving, draining, down, gone) and
    # its requests to it (in flight, answered, answered per second, failed requests and checks)
    "fleet_state": "Fleet state",
    "inflight": "In flight",
    "served": "Served",
    "served_per_s": "Served per s",
    "failed": "Failed",
}
# What an adapter run's status table says instead (its versions are the adapter's).
ADAPTER_STATUS_HEADERS = {
    "held_version": "Held adapter version",
    "trainer_version": "Trainer adapter version",
    "lag_versions": "Lag (adapter versions)",
}
# Status columns shown as whole numbers (versions and counts; the others to 0.1).
WHOLE_COLUMNS = ["held_version", "trainer_version", "lag_versions", "errors"]
WHOLE_COLUMNS += ["inflight", "served", "failed"]
# The page's own CSS (``launch(css=PAGE_CSS)``). Gradio lets a table header break anywhere in a word
# ("heal th", "held_ve rsion"); here headers break between words only, so each column is at least
# as wide as the longest word of its header, and are set in the page's text font (narrower than
# the table's monospace: the 17 columns fit a 1,200-pixel page).
PAGE_CSS = """
#status-table th .header {
  font-family: var(--font);
  word-break: normal;
  overflow-wrap: normal;
  hyphens: none;
}
"""


def plot_labels(spec: PlotSpec, adapter: bool) -> dict[str, str]:
    """The ``title``, ``y_title`` and ``x_title`` that ``spec``'s plot shows: as built for a
    full-weight run, with ``ADAPTER_LABELS`` for an adapter run (``adapter``)."""
    labels = {"title": spec.title, "y_title": spec.y_title, "x_title": X_AXES[spec.x]["x_title"]}
    if adapter:
        labels.update(ADAPTER_LABELS.get(spec.elem_id, {}))
    return labels


def status_label(stalled_after_s: float, adapter: bool) -> str:
    """The status table's label: what lag means and when a replica is STALLED."""
    if adapter:
        return (
            "Replicas serving the adapter (lag = trainer adapter version − replica adapter "
            f"version; STALLED: heartbeat older than {stalled_after_s:.0f} s)"
        )
    return (
        "Replicas (lag = trainer version − replica version; STALLED: heartbeat older "
        f"than {stalled_after_s:.0f} s)"
    )


class SharedReader:
    """One reader for every page: returns the last view of the run if it is younger than
    ``min_age_s``."""

    def __init__(self, reader: BucketReader, min_age_s: float):
        self.reader = reader
        self.min_age_s = min_age_s
        self._lock = threading.Lock()
        self._last: RunView | None = None
        self._last_mono = 0.0

    def view(self) -> RunView:
        """A view of the run at most max(``min_age_s``, ``reader.next_read_delay_s()``) seconds
        old."""
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


def status_payload(view: RunView) -> dict:
    """The ``/status`` answer: state, public message, run, trainer version, the adapter of an
    adapter run (``public_adapter``: no base model path; None for full weights) and one
    dict per replica (its error kind only: no paths, URIs or exception text)."""
    return {
        "state": view.state,
        "message": view.public,
        "run_id": view.run_id,
        "trainer_version": view.trainer_version,
        "adapter": public_adapter(view.adapter),
        "read_at": view.read_at,
        "warnings": len(view.warnings),
        "replicas": _jsonable(public_status(view.frame("status"))),
    }


def public_status(df: pd.DataFrame) -> pd.DataFrame:
    """The status table as public pages show it: ``last_error`` reduced to its kind."""
    out = df.copy()
    if len(out):
        out["last_error"] = [public_error(e) for e in out["last_error"]]
    return out


def status_headers(adapter: bool) -> dict[str, str]:
    """The status table's headers (frame column -> header): ``STATUS_HEADERS``, with
    ``ADAPTER_STATUS_HEADERS`` for an adapter run (``adapter``)."""
    return {**STATUS_HEADERS, **(ADAPTER_STATUS_HEADERS if adapter else {})}


def status_table(df: pd.DataFrame, adapter: bool):
    """The status table as the page shows it: ``df`` (the public status frame) under the headers
    of :func:`status_headers`, versions and counts as whole numbers, and flagged (STALLED/FAILING)
    rows highlighted."""
    headers = status_headers(adapter)
    shown = df.rename(columns=headers)
    if shown.empty:
        return shown
    health = headers["health"]

    def row_style(row):
        bad = "STALLED" in row[health] or "FAILING" in row[health]
        return [FLAG_STYLE if bad else ""] * len(row)

    whole = [headers[c] for c in WHOLE_COLUMNS if c in df.columns]
    return (
        shown.style.apply(row_style, axis=1)
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


def plot_update(
    df: pd.DataFrame,
    color: str | None,
    replicas: list[str],
    seen: dict,
    labels: dict[str, str] | None = None,
):
    """A plot's new value, with a ``color_map`` of the categories present, and its labels when
    they differ from those the page shows.

    Gradio's native plots fix their color domain when they build the chart, and rebuild only when
    a setting such as ``color_map`` changes, not on new data; a rebuild triggered together with
    new data may still see the previous data. So a category that appears later (a new replica,
    the first delta after an anchor, a staleness bucket) would stay invisible. The map therefore
    carries a generation key (``~gen``) that changes when the set of categories changes and once
    more on the next refresh, which rebuilds the chart on data that has them all; otherwise the
    map stays the same and new data only updates the chart. It also keeps each replica's color
    the same in every plot. New labels (an adapter run after a full-weight one, or back) rebuild
    the chart too, so they count as a change of categories.

    Args:
        df: the plot's frame.
        color: the plot's color column (None: no color, the frame is returned as it is).
        replicas: every replica id, sorted (their palette order).
        seen: this page's state for this plot, updated in place: ``cats`` (the categories last
            sent), ``gen`` (the generation), ``settle`` (rebuild once more next refresh) and
            ``labels`` (the labels the page shows; absent: as built).
        labels: the ``title``, ``y_title`` and ``x_title`` the plot must show (``plot_labels``);
            None: leave them as they are.
    """
    relabel = labels is not None and labels != seen.get("labels")
    if relabel:
        seen["labels"] = labels
    new_labels = labels if relabel else {}
    if color is None:
        return gr.update(value=df, **new_labels) if relabel else df
    cats = sorted(str(c) for c in df[color].dropna().unique())
    if cats != seen.get("cats") or relabel:
        seen["cats"], seen["settle"] = cats, True
        seen["gen"] = seen.get("gen", 0) + 1
    elif seen.get("settle"):
        seen["settle"] = False
        seen["gen"] += 1
    cmap = {c: _color_of(c, replicas) for c in cats}
    cmap["~gen"] = str(seen["gen"])  # never a category: only makes the map differ
    return gr.update(value=df, color_map=cmap, **new_labels)


def _plot(spec: PlotSpec) -> gr.LinePlot | gr.BarPlot | gr.ScatterPlot:
    """The Gradio plot that ``spec`` describes, rendered where it is created."""
    same_name = ("x", "y", "color", "title", "y_title", "elem_id", "tooltip")  # Gradio's names
    args = {name: getattr(spec, name) for name in same_name}
    return spec.kind(**args, height=PLOT_HEIGHT, **X_AXES[spec.x])


def _plot_rows() -> list[gr.LinePlot | gr.BarPlot | gr.ScatterPlot]:
    """Create the plots of ``PLOTS``, one ``gr.Row`` per row, top to bottom; returns them in
    ``PLOTS`` order."""
    made = {}
    for row in sorted({spec.row for spec in PLOTS}):
        with gr.Row():
            for spec in PLOTS:
                if spec.row == row:
                    made[spec.elem_id] = _plot(spec)
    return [made[spec.elem_id] for spec in PLOTS]


def build_app(config: DashboardConfig, reader: BucketReader | None = None) -> gr.Blocks:
    """The dashboard for ``config.bucket`` (``reader``: an existing BucketReader, for tests)."""
    reader = reader or BucketReader(config.bucket, stalled_after_s=config.stalled_after_s)
    shared = SharedReader(reader, min_age_s=config.refresh_s / 2)

    with gr.Blocks(title="deltasync dashboard") as demo:
        gr.Markdown("## deltasync: sync lag and training")
        summary = gr.Markdown("reading the bucket…", elem_id="summary")
        status = gr.Dataframe(
            headers=list(status_headers(adapter=False).values()),
            label=status_label(config.stalled_after_s, adapter=False),
            interactive=False,
            elem_id="status-table",
            wrap=True,
        )
        plots = _plot_rows()

        seen = gr.State(dict)  # per page: {plot index: categories sent, settle flag}

        def refresh(seen: dict):
            view = shared.view()
            settling = any(v.get("settle") for k, v in seen.items() if isinstance(k, int))
            key = [id(view), view.read_at]
            if seen.get("view") == key and not settling:  # nothing new: send nothing
                return tuple(gr.skip() for _ in outputs)
            seen["view"] = key
            known = set(view.frame("versions").series) | set(view.frame("status").replica)
            replicas = sorted(known - {"trainer"})
            adapter = view.adapter is not None
            table = status_table(public_status(view.frame("status")), adapter)
            label = status_label(config.stalled_after_s, adapter)
            if label != seen.get("table_label", status_label(config.stalled_after_s, False)):
                seen["table_label"] = label
                table = gr.update(value=table, label=label)
            out = [view.markdown(public=True), table]
            for i, spec in enumerate(PLOTS):
                mine = seen.setdefault(i, {"labels": plot_labels(spec, adapter=False)})
                labels = plot_labels(spec, adapter)
                frame = view.frame(spec.frame)
                out.append(plot_update(frame, spec.color, replicas, mine, labels))
            return (*out, seen)

        outputs = [summary, status, *plots, seen]
        timer = gr.Timer(config.refresh_s)
        timer.tick(
            refresh, inputs=seen, outputs=outputs, api_name="refresh", show_progress="hidden"
        )
        demo.load(
            refresh, inputs=seen, outputs=outputs, api_visibility="private", show_progress="hidden"
        )

        def status_api() -> dict:
            """State, message and the status table of the bucket, as JSON."""
            return status_payload(shared.view())

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
        css=PAGE_CSS,
        footer_links=["api"],
    )
