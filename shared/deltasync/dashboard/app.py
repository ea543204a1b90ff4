"""The dashboard's Gradio app: live plots and a status table of one run's bucket.

``build_app(config)`` returns a ``gr.Blocks`` that polls the bucket through one shared
:class:`~deltasync.dashboard.data.BucketReader` on a ``gr.Timer`` (every open page ticks, but the
bucket is read at most once per ``refresh_s / 2``). API routes (``gradio_client``): ``/status``
(state, message and the status table as JSON) and ``/refresh`` (every output of the page).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from .data import BucketReader, Snapshot

log = logging.getLogger("deltasync.dashboard")

FLAG_STYLE = "background-color: #fde2e1; color: #8a1c1c; font-weight: 600"


@dataclass
class DashboardConfig:
    """Settings of the dashboard process.

    Attributes:
        bucket: the run root URI (folder, ``file://``, ``memory://``, ``hf://buckets/...``,
            ``s3://``).
        refresh_s: seconds between polls of the page (``gr.Timer``).
        stalled_after_s: seconds after which a replica's heartbeat counts as STALLED.
        host: interface to serve on ("0.0.0.0" on a Space).
        port: TCP port.
    """

    bucket: str
    refresh_s: float = 2.0
    stalled_after_s: float = 30.0
    host: str = "127.0.0.1"
    port: int = 7860

    def __post_init__(self):
        if not self.bucket:
            raise ValueError("expected a bucket URI: --bucket URI or the BUCKET variable")
        if self.refresh_s <= 0 or self.stalled_after_s <= 0:
            raise ValueError(
                f"expected refresh_s > 0 and stalled_after_s > 0, found {self.refresh_s}, "
                f"{self.stalled_after_s}"
            )

    @classmethod
    def from_env(cls) -> DashboardConfig:
        """From environment variables (Space variables/secrets): ``BUCKET`` (required),
        ``REFRESH_S``, ``STALLED_AFTER_S``, ``GRADIO_SERVER_NAME`` (default 0.0.0.0), ``PORT``
        (default 7860). ``HF_TOKEN`` is read by the store itself for hf:// buckets."""
        bucket = os.environ.get("BUCKET", "")
        if not bucket:
            raise ValueError(
                "BUCKET is not set: set it to the run's URI, e.g. hf://buckets/<owner>/<name> "
                "(a Space variable), and HF_TOKEN as a secret if the bucket is private"
            )
        return cls(
            bucket=bucket,
            refresh_s=float(os.environ.get("REFRESH_S", cls.refresh_s)),
            stalled_after_s=float(os.environ.get("STALLED_AFTER_S", cls.stalled_after_s)),
            host=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
            port=int(os.environ.get("PORT", "7860")),
        )


class SharedReader:
    """One reader for every page: returns the last snapshot if it is younger than ``min_age_s``."""

    def __init__(self, reader: BucketReader, min_age_s: float):
        self.reader = reader
        self.min_age_s = min_age_s
        self._lock = threading.Lock()
        self._last: Snapshot | None = None
        self._last_mono = 0.0

    def snapshot(self) -> Snapshot:
        """A snapshot at most ``min_age_s`` seconds old."""
        with self._lock:
            if self._last is None or time.monotonic() - self._last_mono >= self.min_age_s:
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
    """The ``/status`` answer: state, message, run, trainer version and one dict per replica."""
    return {
        "uri": snap.uri,
        "state": snap.state,
        "message": snap.message,
        "run_id": snap.run_id,
        "trainer_version": snap.trainer_version,
        "read_at": snap.read_at,
        "warnings": snap.warnings,
        "replicas": _jsonable(snap.frame("status")),
    }


def _styled_status(df: pd.DataFrame):
    """The status table with flagged (STALLED/FAILING) rows highlighted."""
    if df.empty:
        return df

    def row_style(row):
        bad = "STALLED" in row["health"] or "FAILING" in row["health"]
        return [FLAG_STYLE if bad else ""] * len(row)

    return df.style.apply(row_style, axis=1).format(precision=1, na_rep="")


def build_app(config: DashboardConfig, reader: BucketReader | None = None) -> gr.Blocks:
    """The dashboard for ``config.bucket`` (``reader``: an existing BucketReader, for tests)."""
    reader = reader or BucketReader(config.bucket, stalled_after_s=config.stalled_after_s)
    shared = SharedReader(reader, min_age_s=config.refresh_s / 2)
    plot = {"height": 260, "x_title": "time (UTC)"}

    with gr.Blocks(title=f"deltasync · {config.bucket}") as demo:
        gr.Markdown(f"## deltasync sync lag · `{config.bucket}`")
        summary = gr.Markdown("reading the bucket…", elem_id="summary")
        status = gr.Dataframe(
            label="Replicas (lag = trainer version − replica version; STALLED: heartbeat older "
            f"than {config.stalled_after_s:.0f} s)",
            interactive=False,
            elem_id="status-table",
            wrap=True,
        )
        with gr.Row():
            versions = gr.LinePlot(
                x="time", y="version", color="series", title="Held version vs trainer version",
                y_title="version", elem_id="plot-versions", **plot,
            )  # fmt: skip
            lag_v = gr.LinePlot(
                x="time", y="lag_versions", color="replica", title="Lag (versions)",
                y_title="versions behind", elem_id="plot-lag-versions", **plot,
            )  # fmt: skip
            lag_s = gr.LinePlot(
                x="time", y="lag_s", color="replica", title="Lag (seconds)",
                y_title="seconds behind newest publish", elem_id="plot-lag-seconds", **plot,
            )  # fmt: skip
        with gr.Row():
            payload = gr.BarPlot(
                x="version", y="mb", color="kind", title="Payload per version (anchors marked)",
                x_title="version", y_title="MB (10^6 bytes)", elem_id="plot-payload",
                height=260,
            )  # fmt: skip
            density = gr.ScatterPlot(
                x="version", y="density_pct", color="marker", title="Delta density",
                x_title="version", y_title="changed elements (%)", elem_id="plot-density",
                height=260,
            )  # fmt: skip
        with gr.Row():
            paused = gr.ScatterPlot(
                x="time", y="paused_s", color="replica", title="Paused window per sync",
                y_title="generation paused (s)", elem_id="plot-paused", **plot,
            )  # fmt: skip
            phases = gr.ScatterPlot(
                x="time", y="seconds", color="phase", title="Fetch / decode / apply per sync",
                y_title="seconds", elem_id="plot-phases", **plot,
            )  # fmt: skip
        with gr.Row():
            reward = gr.LinePlot(
                x="step", y="reward", title="Reward", x_title="trainer step",
                y_title="mean reward", elem_id="plot-reward", height=260,
            )  # fmt: skip
            staleness = gr.BarPlot(
                x="step", y="count", color="staleness", title="Staleness of training samples",
                x_title="trainer step", y_title="samples (by versions stale)",
                elem_id="plot-staleness", height=260,
            )  # fmt: skip

        outputs = [summary, status, versions, lag_v, lag_s, payload, density, paused, phases]
        outputs += [reward, staleness]

        def refresh():
            snap = shared.snapshot()
            f = snap.frame
            return (
                snap.markdown(), _styled_status(f("status")), f("versions"), f("lag"), f("lag"),
                f("payloads"), f("density"), f("syncs"), f("sync_phases"), f("training"),
                f("staleness"),
            )  # fmt: skip

        timer = gr.Timer(config.refresh_s)
        timer.tick(refresh, outputs=outputs, api_name="refresh", show_progress="hidden")
        demo.load(refresh, outputs=outputs, api_visibility="private", show_progress="hidden")

        def status_api() -> dict:
            """State, message and the status table of the bucket, as JSON."""
            return status_payload(shared.snapshot())

        gr.api(status_api, api_name="status")
    return demo


def serve(config: DashboardConfig) -> None:
    """Build the app and serve it until interrupted (blocks)."""
    log.info("dashboard on http://%s:%d for %s (refresh %.1fs)", config.host, config.port,
             config.bucket, config.refresh_s)  # fmt: skip
    build_app(config).launch(
        server_name=config.host, server_port=config.port, show_error=True, footer_links=["api"]
    )
