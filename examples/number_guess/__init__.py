"""Number guessing: a multi-turn tool task with its own OpenEnv Space (README \"Your own
environment\"). ``task.TASK`` is the Task; ``space/`` the Space."""
