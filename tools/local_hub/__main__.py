"""``python -m tools.local_hub`` (``make hub``): serve a local Hub (buckets, Xet CAS, Spaces) until
interrupted. Prints one line: where it listens and where its tokens are."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from .app import HubConfig, LocalHub, describe


def parse_args(argv: list[str] | None = None) -> HubConfig:
    """The :class:`HubConfig` from the command line."""
    p = argparse.ArgumentParser(prog="python -m tools.local_hub", description=__doc__)
    p.add_argument("--root", default="runs/local-hub", help="state folder (default: %(default)s)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument("--port", type=int, default=8330, help="the Hub's port (default: %(default)s)")
    p.add_argument(
        "--cas-port",
        type=int,
        default=8331,
        help="the Xet CAS and file bridge's port (default: %(default)s)",
    )
    p.add_argument(
        "--user", default="me", help="the account of the default tokens (default: %(default)s)"
    )
    p.add_argument(
        "--space-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment added to every Space it runs (repeatable), e.g. vLLM CPU settings",
    )
    a = p.parse_args(argv)
    env = {}
    for item in a.space_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--space-env: expected KEY=VALUE, found {item!r}")
        env[key] = value
    return HubConfig(Path(a.root).resolve(), a.host, a.port, a.cas_port, a.user, env)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    cfg = parse_args(argv)
    hub = LocalHub(cfg)
    print(describe(cfg), flush=True)
    try:
        asyncio.run(hub.serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
