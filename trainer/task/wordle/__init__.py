"""Wordle, the task the template ships, as one :class:`~trainer.task.base.Task` (``task``).

``game_env``: the prompt, the split of target words, the tool replies, the episode reward and the
OpenEnv client as TRL's tool environment; ``board``: the board added to each tool reply;
``credit``: the per-turn credit; ``figures``: the figures of the held-out games, which the generic
evaluation of tool tasks (``trainer.task.tool_eval``) plays; ``solver``: the teacher;
``model``: the local model's tokenizer and architecture; ``warm_start``: the local model's
creation and its fine-tuning on the teacher's games; ``hub_warm_start``: the same fine-tuning of
a pretrained model; ``spelling`` / ``spelling_tie``: the local model's answer rows tied to their
spelling.
"""
