"""``python -m dashboard [--bucket URI] [--port N]``: serve the sync-lag dashboard (also the
Space's start command, where the flags default to the Space variables)."""

from __future__ import annotations

import logging

from .config import parse_config


def main(argv: list[str] | None = None) -> None:
    """Parse the settings and serve until interrupted."""
    config = parse_config(argv)
    from .ui import serve  # imports gradio: after the arguments are checked

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(config)


if __name__ == "__main__":
    main()
