"""Number guessing as a :class:`~trainer.task.base.Task`: a multi-turn tool task with its own
OpenEnv Space (``space/``), written only against the seam, as README "Your own environment" walks
through it. ``--task number_guess`` (``make train TASK=number_guess``) picks it; ``make spaces
TASK=number_guess`` deploys its Space.

Each rollout plays one game on the Space's server (``env.NumberGuessEnv``): the model calls
``guess(number)`` and reads ``higher`` / ``lower`` / ``correct`` until it solves the game or runs out
of guesses; the server pays the reward (``space/game.py``). All completions of one GRPO group share
their row's ``seed``, so they play the same secret. The held-out evaluation is the trainer's
generic one for tool tasks (``trainer.task.tool_eval``), on :func:`eval_row`'s episodes.

TRL's spawned rollout process imports this module, so everything it uses is module-level and the
server's address comes from ``DELTASYNC_ENV_URL``.
"""

from __future__ import annotations

import os

from examples.number_guess import figures
from examples.number_guess.env import NumberGuessEnv
from trainer.task.base import EnvServer, Task

SPACE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "space")
# Held-out episodes: seeds EVAL_SEED_FIRST.. (training rows use seeds below it).
EVAL_SEED_FIRST, EVAL_SEED_COUNT = 1_000_000, 256

SYSTEM_PROMPT = (
    "You are playing a number guessing game. Find the secret whole number in as few guesses as "
    "you can. Call the `guess` tool with one number; the reply says whether the secret is higher "
    "or lower than your guess, or that it is correct."
)
USER_PROMPT = "A new game starts. Make your first guess."


def prompt_messages() -> list[dict]:
    """The prompt of every game (TRL appends ``reset``'s text, the game's range, to the user's)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT},
    ]


def dataset(rows: int, seed: int):
    """``datasets.Dataset`` of ``rows`` games: the prompt and the game's ``seed`` (below the
    held-out seeds; the server draws the secret from it)."""
    from datasets import Dataset

    seeds = [(seed * 1_000_003 + i) % EVAL_SEED_FIRST for i in range(rows)]
    return Dataset.from_dict({"prompt": [prompt_messages()] * rows, "seed": seeds})


def eval_seeds(count: int) -> list[int]:
    """The first ``count`` held-out seeds."""
    return list(range(EVAL_SEED_FIRST, EVAL_SEED_FIRST + count))


def eval_row(seed: int) -> dict:
    """A held-out episode's row, as :func:`dataset`'s rows."""
    return {"prompt": prompt_messages(), "seed": seed}


def _local_model(run, settings) -> tuple[str, float]:
    from examples.number_guess.local_model import local_model

    return local_model(run, settings)


TASK = Task(
    name="number_guess",
    dataset=dataset,
    environment_factory=NumberGuessEnv,
    eval_seeds=eval_seeds,
    eval_seed_count=EVAL_SEED_COUNT,
    eval_row=eval_row,
    eval_figures=figures.eval_figures,
    episode_counts=figures.episode_counts,
    step_figures=figures.step_figures,
    figures=figures.FIGURES,
    # the local default runs the Space's server on loopback, without a key (one the user
    # exported for a deployed Space is not inherited; blank is unset)
    server=EnvServer(
        "number-guess-env",
        ("-m", "server"),
        SPACE_DIR,
        (("NUMBER_GUESS_HOST", "127.0.0.1"), ("NUMBER_GUESS_API_KEY", "")),
    ),
    space="examples/number_guess/space",
    local_model=_local_model,
)
