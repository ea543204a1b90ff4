"""The dashboard's settings, and where each comes from (flags, else Space variables)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class DashboardConfig:
    """Settings of the dashboard process.

    Attributes:
        bucket: the run root URI (folder, ``file://``, ``memory://``, ``hf://buckets/...``,
            ``s3://``).
        refresh_s: seconds between polls of the page (``gr.Timer``); the bucket itself is read
            less often while nothing changes.
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


def parse_config(
    argv: list[str] | None = None, env: Mapping[str, str] | None = None
) -> DashboardConfig:
    """The settings from command-line flags, each defaulting to a Space variable.

    Variables: ``BUCKET`` (required unless ``--bucket``), ``REFRESH_S``, ``STALLED_AFTER_S``,
    ``GRADIO_SERVER_NAME`` (the interface; ``0.0.0.0`` in the Space's image, else 127.0.0.1) and
    ``PORT`` (default 7860). ``HF_TOKEN`` is read by the store itself for private hf:// buckets.

    Raises:
        SystemExit: (code 2, from argparse) no bucket, or a value that does not parse.
    """
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        prog="python -m dashboard", description="Serve the sync-lag dashboard of one run."
    )
    p.add_argument(
        "--bucket",
        default=env.get("BUCKET", ""),
        help="run root URI: a folder, file://, memory://, hf://buckets/<owner>/<name>[/prefix], "
        "s3://... (default: $BUCKET)",
    )
    p.add_argument("--port", type=int, default=int(env.get("PORT", "7860")), help="TCP port")
    p.add_argument(
        "--host",
        default=env.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        help="interface (0.0.0.0 to serve the LAN; default $GRADIO_SERVER_NAME or 127.0.0.1)",
    )
    p.add_argument(
        "--refresh-s",
        type=float,
        default=float(env.get("REFRESH_S", "2")),
        help="seconds between refreshes (default $REFRESH_S or 2)",
    )
    p.add_argument(
        "--stalled-after-s",
        type=float,
        default=float(env.get("STALLED_AFTER_S", "30")),
        help="flag a replica STALLED when its heartbeat is older than this many seconds",
    )
    args = p.parse_args(argv)
    if not args.bucket:
        p.error(
            "--bucket URI is required (or set BUCKET to the run's URI, e.g. "
            "hf://buckets/<owner>/<name>, and HF_TOKEN as a secret if the bucket is private)"
        )
    try:
        return DashboardConfig(
            bucket=args.bucket,
            refresh_s=args.refresh_s,
            stalled_after_s=args.stalled_after_s,
            host=args.host,
            port=args.port,
        )
    except ValueError as e:
        p.error(str(e))
