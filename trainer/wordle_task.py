"""The Wordle task of the trainer: prompts, the tool-calling environment, and rewards.

Style: tool calls, as in TRL's Wordle example. Each rollout plays one game against the Wordle
environment server (OpenEnv WebSocket protocol, ``deltasync.wordle.client``): the model calls
``guess(word)`` and reads the feedback, for up to ``max_tool_calling_iterations`` turns. We use the
tool style because it is TRL's native multi-turn path (the same code trains Qwen3 on a GPU box) and
the environment keeps the game state, so the trainer never re-implements the rules.

All completions of one GRPO group come from one dataset row and so share its ``seed``: the server
maps the seed to the target deterministically, so the whole group plays the same word.

Rewards (summed by TRL): the environment's game reward (1 for a win, else (greens + 0.5 yellows) / 5
of the last accepted guess, ``deltasync.wordle.rules.game_reward``) and ``format_reward``, a small
dense shaping term (<= 0.3) for writing guesses in the game's alphabet, so that a tiny random model
sees reward differences within a group from the first step (GRPO learns nothing from groups whose
rewards are all equal).

This module is imported in TRL's spawned rollout process, so everything here is module-level and
the server address comes from the environment (``DELTASYNC_ENV_URL``).
"""

from __future__ import annotations

import os
import re

ENV_URL_VAR = "DELTASYNC_ENV_URL"
SYSTEM_PROMPT = (
    "You are playing Wordle. Find the secret 5-letter English word in at most 6 guesses. "
    "Call the `guess` tool with one lowercase 5-letter word. After each guess you get feedback "
    "per letter: G = right letter, right place; Y = in the word, elsewhere; X = not in the word."
)
_WORD = re.compile(r"[a-z]{5}")


def make_dataset(n_rows: int, seed: int = 0):
    """``datasets.Dataset`` of ``n_rows`` games: a chat ``prompt`` and the game's ``seed``."""
    from datasets import Dataset

    prompt = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "A new game starts. Make your first guess."},
    ]
    return Dataset.from_dict(
        {"prompt": [prompt] * n_rows, "seed": [seed * 1_000_003 + i for i in range(n_rows)]}
    )


class WordleToolEnv:
    """One Wordle game per rollout, played on the environment server (``environment_factory``).

    TRL calls ``reset(**row)`` before the rollout, exposes ``guess`` as a tool, and adds
    ``get_reward()`` to the rewards when the rollout ends.
    """

    def __init__(self):
        self._client = None
        self._reward = 0.0

    def _connect(self):
        from deltasync.wordle.client import WordleEnv

        url = os.environ.get(ENV_URL_VAR)
        if not url:
            raise RuntimeError(
                f"expected the Wordle server's URL in ${ENV_URL_VAR} (set by the trainer), found none"
            )
        self._client = WordleEnv(base_url=url).sync()
        self._client.connect()

    def reset(self, seed: int, **_row) -> str:
        """Start the game of this row's seed; returns the text appended to the user prompt."""
        if self._client is None:
            self._connect()
        result = self._client.reset(seed=int(seed))
        self._reward = 0.0
        return f"\n{result.observation.reply or 'Guess the word.'}"

    def guess(self, word: str) -> str:
        """Guess the secret word.

        Args:
            word: a lowercase 5-letter English word.

        Returns:
            The game's feedback on the guess.
        """
        result = self._client.step(f"[{str(word).strip().lower()}]")
        obs = result.observation
        self._reward = float(result.reward or 0.0)
        if result.done:
            return f"{obs.reply} Game over."
        return obs.reply

    def get_reward(self) -> float:
        """The game's reward of this rollout (see the module docstring)."""
        return self._reward


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    parts = []
    for msg in completion:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            parts.append(content)
        for call in (msg.get("tool_calls") or []) if isinstance(msg, dict) else []:
            parts.append(str(call))
    return " ".join(parts)


def format_reward(completions, **_kwargs) -> list[float]:
    """0.2 x the share of the completion's first 10 non-space characters that are lowercase
    letters, plus 0.1 when it contains a 5-letter lowercase word: a dense shaping signal."""
    out = []
    for completion in completions:
        text = _text(completion)
        head = "".join(text.split())[:10]
        share = sum(c.islower() for c in head) / 10
        out.append(0.2 * share + (0.1 if _WORD.search(text) else 0.0))
    return out
