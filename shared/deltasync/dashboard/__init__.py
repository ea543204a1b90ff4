"""The sync-lag dashboard: a Gradio app that reads only a run's bucket.

``deltasync.dashboard.data`` (the data layer: bucket -> pandas DataFrames) imports neither torch
nor gradio; ``deltasync.dashboard.app`` builds the Gradio Blocks app. Run it with
``python -m deltasync.dashboard --bucket URI --port N``.
"""
