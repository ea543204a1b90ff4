"""The task: what the model is trained to do and how well it does it, behind one seam.

:class:`~trainer.task.base.Task` (``base``) is all the rest of the trainer knows of an
environment; :func:`~trainer.task.base.load_task` picks one by name (``--task`` / ``TASK``). Wordle is the one
shipped (``wordle``): the prompt, the tool-calling environment and the reward (``wordle_task``),
the board added to each tool reply (``board``), the teacher (``solver``), the local model and its
tokenizer (``wordle_model``, ``tiny_model``), the warm starts (``warm_start``,
``hub_warm_start``), the answer rows tied to their spelling (``spelling``, ``spelling_tie``) and
Wordle's figures of the held-out games (``evaluate``), which the generic evaluation of tool
tasks plays (``tool_eval``, its requests in ``eval_http``). Nothing here knows about buckets,
replicas or the fleet.
"""
