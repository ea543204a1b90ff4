"""Hugging Face Space entry point: the deltasync sync-lag dashboard of the run in ``$BUCKET``.

Space variables: ``BUCKET`` (the run's URI, e.g. ``hf://buckets/<owner>/<name>``), optional
``REFRESH_S`` and ``STALLED_AFTER_S``; secret ``HF_TOKEN`` when the bucket is private.
"""

from __future__ import annotations

import logging

from deltasync.dashboard.app import DashboardConfig, serve

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(DashboardConfig.from_env())
