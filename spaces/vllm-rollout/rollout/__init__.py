"""The vLLM rollout replica: a vLLM server that follows a deltasync bucket on its own.

Modules: ``config`` (env vars), ``plan`` (apply-path choice and fused reload groups; no torch),
``stage`` (the staging file), ``apply`` + ``extension`` (inside the vLLM worker), ``engine``
(client of vLLM's internal dev routes), ``sync_loop`` (poll, prefetch, verify, pause, apply),
``server`` (the public front), ``launch`` (the Space's entry point).
"""
