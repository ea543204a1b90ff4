"""The dashboard's settings, and where each comes from (flags, else Space variables)."""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields


@dataclass
class DashboardConfig:
    """Settings of the dashboard process. Each declares, next to its default, the Space variable
    that feeds it (``metadata["env"]``) and the help of its flag (``--refresh-s`` for
    ``refresh_s``); see ``parse_config``.

    Attributes:
        bucket: the run root URI (folder, ``file://``, ``memory://``, ``hf://buckets/...``,
            ``s3://``); ``BUCKET``.
        refresh_s: seconds between polls of the page (``gr.Timer``); the bucket itself is read
            less often while nothing changes. ``REFRESH_S``.
        stalled_after_s: seconds after which a replica's heartbeat counts as STALLED;
            ``STALLED_AFTER_S``.
        host: interface to serve on ("0.0.0.0" on a Space); ``GRADIO_SERVER_NAME``.
        port: TCP port; ``PORT``.
    """

    bucket: str = field(
        metadata={
            "env": "BUCKET",
            "help": "run root URI: a folder, file://, memory://, "
            "hf://buckets/<owner>/<name>[/prefix], s3://...",
        }
    )
    refresh_s: float = field(
        default=2.0, metadata={"env": "REFRESH_S", "help": "seconds between refreshes"}
    )
    stalled_after_s: float = field(
        default=30.0,
        metadata={
            "env": "STALLED_AFTER_S",
            "help": "flag a replica STALLED when its heartbeat is older than this many seconds",
        },
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"env": "GRADIO_SERVER_NAME", "help": "interface (0.0.0.0 to serve the LAN)"},
    )
    port: int = field(default=7860, metadata={"env": "PORT", "help": "TCP port"})

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
    """The settings from command-line flags, each defaulting to the Space variable its field
    declares, else to the field's default.

    Variables: ``BUCKET`` (required unless ``--bucket``), ``REFRESH_S`` (default 2),
    ``STALLED_AFTER_S`` (30), ``GRADIO_SERVER_NAME`` (the interface; ``0.0.0.0`` in the Space's
    image, else 127.0.0.1) and ``PORT`` (7860). ``HF_TOKEN`` is read by the store itself for
    private hf:// buckets.

    Raises:
        SystemExit: (code 2, from argparse) no bucket, or a value that does not parse.
    """
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        prog="python -m dashboard", description="Serve the sync-lag dashboard of one run."
    )
    kinds = typing.get_type_hints(DashboardConfig)
    for f in fields(DashboardConfig):
        var, kind = f.metadata["env"], kinds[f.name]
        declared = "" if f.default is MISSING else f.default  # "": required (the bucket)
        shown = f"${var}, else {declared}" if declared != "" else f"${var}"
        raw = env.get(var, "").strip()
        try:
            default = kind(raw) if raw else declared  # a set variable replaces the declared default
        except ValueError:
            p.error(f"{var}: expected a {kind.__name__}, found {raw!r}; fix it or unset it")
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=default,
            help=f"{f.metadata['help']} (default: {shown})",
        )
    args = p.parse_args(argv)
    if not args.bucket:
        p.error(
            "--bucket URI is required (or set BUCKET to the run's URI, e.g. "
            "hf://buckets/<owner>/<name>, and HF_TOKEN as a secret if the bucket is private)"
        )
    try:
        return DashboardConfig(**vars(args))
    except ValueError as e:
        p.error(str(e))
