"""The training loop: TRL's AsyncGRPOTrainer and what the run adds to it.

Owns building the trainer (``grpo``), the bucket weight transfer that publishes each update
(``bucket_transfer``), the TRL patches with their version checks (``trl_compat``), the per-step
metrics written to the bucket (``metrics``), the learning-curve evaluations (``learning_curve``)
and the multi-process ranks (``ranks``).
"""
