"""The sync-lag dashboard: a Gradio app that reads only a run's bucket.

``dashboard.data`` (bucket -> pandas DataFrames) imports neither torch nor gradio;
``dashboard.config`` holds the settings; ``dashboard.ui`` builds the Gradio Blocks app. Run it with
``python -m dashboard --bucket URI --port N``.
"""
