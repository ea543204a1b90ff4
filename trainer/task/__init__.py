"""The task: what the model is trained to do and how well it does it, behind one seam.

:class:`~trainer.task.base.Task` (``base``) is all the rest of the trainer knows of an
environment; :func:`~trainer.task.base.load_task` picks one by name (``--task`` / ``TASK``).
What every task shares sits here: the seam (``base``), the rollout's chat rendering
(``chat_format``), the generic evaluation of tool tasks (``tool_eval``, its played episodes in
``tool_episode``, its requests in ``eval_http``) and a char-level Qwen3 made locally for local
models and tests (``char_model``). Wordle, the task the template ships, is the package
``wordle``; ``examples/number_guess`` is a second one outside the trainer. Nothing here knows
about buckets, replicas or the fleet.
"""
