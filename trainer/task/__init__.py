"""The Wordle task: what the model is trained to do and how well it does it.

Owns the prompt, the tool-calling environment and the reward (``wordle_task``), the board the
trainer adds to each tool reply (``board``), the teacher (``solver``), the local model and its
tokenizer (``wordle_model``, ``tiny_model``), the warm start (``warm_start``) and the held-out
evaluation (``evaluate``). Nothing here knows about buckets, replicas or the fleet.
"""
