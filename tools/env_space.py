"""Which environment Space ``make spaces TASK=...`` deploys: the task's own Space folder
(``trainer.task.base.Task.space``), its name in the account and the name of its key secret.

Wordle (the default, ``TASK`` unset) deploys ``spaces/wordle-env`` as ``<prefix>-wordle`` with
``WORDLE_API_KEY``, as before tasks had Spaces; another task (``TASK=number_guess``, or your own
``TASK=my_env.task:TASK``) deploys its ``Task.space`` as ``<prefix>-<task name, _ as ->`` with
``<TASK NAME>_API_KEY`` (``NUMBER_GUESS_API_KEY``), which its server reads. The trainer sends the
key as ``WORDLE_API_KEY`` (``trainer.task.base.ENV_KEY_VAR``) whatever the task.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .space_config import DeployError

DEFAULT_TASK = "wordle"
WORDLE_FOLDER = "spaces/wordle-env"


@dataclass(frozen=True)
class EnvSpace:
    """The environment Space of one task.

    Attributes:
        task: the task as ``TASK`` named it (``wordle``, ``number_guess``, ``pkg.mod:TASK``).
        name: the task's own name (``Task.name``).
        folder: its Space folder, relative to the repository root or absolute.
        key: its ``SpaceSpec.key`` and the suffix of its Space's name (``wordle``,
            ``number-guess``).
        key_variable: the secret its server reads its key from (``WORDLE_API_KEY``,
            ``NUMBER_GUESS_API_KEY``).
    """

    task: str
    name: str
    folder: str
    key: str
    key_variable: str

    @property
    def default(self) -> bool:
        """Whether this is the default task's (Wordle's): the ``make train`` line needs no
        ``TASK=``."""
        return self.task == DEFAULT_TASK


def env_space(task: str = DEFAULT_TASK) -> EnvSpace:
    """The environment Space of ``task`` (a name of ``trainer.task.base.TASKS`` or
    ``package.module:NAME``).

    Raises:
        DeployError: the task cannot be loaded, or it names no Space folder (``Task.space``);
            the message says which and what to do.
    """
    if task == DEFAULT_TASK:
        return EnvSpace(task, "wordle", WORDLE_FOLDER, "wordle", "WORDLE_API_KEY")
    from trainer.task.base import TaskError, load_task

    try:
        loaded = load_task(task)
    except TaskError as e:
        raise DeployError(f"TASK={task}: {e}") from e
    folder = loaded.space or (WORDLE_FOLDER if loaded.name == DEFAULT_TASK else None)
    if not folder:
        raise DeployError(
            f"TASK={task}: expected a task with its environment's Space folder (Task.space: a "
            f"Dockerfile and a README with the Space's card), found space=None in task "
            f"{loaded.name!r}; set Task.space, or deploy its server yourself and pass ENV_URL"
        )
    slug = re.sub(r"[^a-z0-9]+", "-", loaded.name.lower()).strip("-")
    variable = re.sub(r"[^A-Z0-9]+", "_", loaded.name.upper()).strip("_") + "_API_KEY"
    return EnvSpace(task, loaded.name, folder, slug, variable)
