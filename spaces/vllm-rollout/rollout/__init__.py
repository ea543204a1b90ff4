"""The vLLM rollout replica: a vLLM server that follows a deltasync bucket on its own.

Modules: ``config`` (env vars), ``launch`` (the Space's entry point), ``server`` (the public
front), ``sync_loop`` (poll, prefetch, verify, pause, apply) with ``state`` (its states) and
``heartbeat`` (when it reports), ``apply_plan`` (apply-path choice and fused reload groups; no
torch), ``staging`` (the staging file, and a verified pull written as one), ``engine`` (client of
vLLM's internal dev routes), ``lora`` + ``lora_load`` (``ADAPTER=lora``: which adapter version
serves a request, loading and unloading them); inside the vLLM worker: ``extension`` (the
``--worker-extension-cls``) and ``worker_apply`` (the apply paths, on torch and vLLM).
"""
