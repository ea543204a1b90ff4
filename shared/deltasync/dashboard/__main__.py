"""``python -m deltasync.dashboard --bucket URI [--port N]``: serve the sync-lag dashboard."""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and serve until interrupted."""
    p = argparse.ArgumentParser(prog="python -m deltasync.dashboard", description=__doc__)
    p.add_argument(
        "--bucket",
        default=os.environ.get("BUCKET", ""),
        help="run root URI: a folder, file://, memory://, hf://buckets/<owner>/<name>[/prefix], "
        "s3://... (default: $BUCKET)",
    )
    p.add_argument("--port", type=int, default=7860, help="TCP port (default 7860)")
    p.add_argument("--host", default="127.0.0.1", help="interface (0.0.0.0 to serve the LAN)")
    p.add_argument("--refresh-s", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument(
        "--stalled-after-s",
        type=float,
        default=30.0,
        help="flag a replica STALLED when its heartbeat is older than this many seconds",
    )
    args = p.parse_args(argv)
    if not args.bucket:
        p.error("--bucket URI is required (or set BUCKET)")
    from .app import DashboardConfig, serve  # imports gradio: after the arguments are checked

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(
        DashboardConfig(
            bucket=args.bucket,
            refresh_s=args.refresh_s,
            stalled_after_s=args.stalled_after_s,
            host=args.host,
            port=args.port,
        )
    )


if __name__ == "__main__":
    main()
