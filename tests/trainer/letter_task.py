"""The letter puzzle (``letter_env.py``) as a :class:`~trainer.task.base.Task`: a second task, single
turn and scored by a reward function, written only against the seam. Nothing in ``trainer/loop``,
``trainer/fleet`` or ``trainer/stack.py`` knows it; ``--task letter_task:TASK`` picks it.

TRL's spawned rollout process imports this module (the reward function is pickled by name), so
everything it uses is module-level; the server's URL comes from ``DELTASYNC_ENV_URL``.
"""

from __future__ import annotations

import math
import os
import statistics

import httpx
from letter_env import letter_for  # beside this file, on sys.path like it

from deltasync.status import TaskFigure
from trainer.task.base import ENV_URL_VAR, EnvServer, EvalRequest, Task
from trainer.task.chat_format import render_turns

HERE = os.path.dirname(os.path.abspath(__file__))
HELD_OUT_FIRST, HELD_OUT_COUNT = 10_000, 64


def prompt(seed: int) -> list[dict]:
    """The chat prompt of episode ``seed`` (the letter is the server's: ``letter_for``)."""
    return [
        {"role": "system", "content": "Answer with one lowercase 5-letter English word."},
        {"role": "user", "content": f"A word with the letter {letter_for(seed)}."},
    ]


def dataset(rows: int, seed: int):
    """Training rows: a prompt and its ``seed`` (below the held-out seeds)."""
    from datasets import Dataset

    seeds = [(seed * 7919 + i) % HELD_OUT_FIRST for i in range(rows)]
    return Dataset.from_dict({"prompt": [prompt(s) for s in seeds], "seed": seeds})


def answer_text(completion) -> str:
    """The text of a completion: its content and the arguments of any tool call it made."""
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion:
        parts.append(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            args = call.get("function", {}).get("arguments", {})
            parts.extend(str(v) for v in (args.values() if isinstance(args, dict) else [args]))
    return " ".join(parts)


def score(env_url: str, seed: int, text: str) -> float:
    """The server's reward for answer ``text`` to episode ``seed`` (openenv's HTTP ``/step``)."""
    r = httpx.post(f"{env_url}/step", json={"action": {"seed": seed, "message": text}}, timeout=30)
    r.raise_for_status()
    return float(r.json()["reward"])


def letter_reward(prompts, completions, seed, **_) -> list[float]:
    """TRL reward function: each completion scored by the letter server."""
    url = os.environ[ENV_URL_VAR]
    return [score(url, int(s), answer_text(c)) for s, c in zip(seed, completions, strict=True)]


def evaluate(request: EvalRequest, seeds: list, temperature: float, per_seed: bool) -> dict:
    """Held-out episodes through the replica's ``/v1/completions``, scored by the server."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(request.model_path)
    name = (
        request.model_name
        or httpx.get(f"{request.replica_url}/v1/models", headers=request.headers).json()["data"][0][
            "id"
        ]
    )
    rewards, lengths = [], []
    for s in seeds:
        text = render_turns(tokenizer, prompt(s), [], generation_prompt=True)
        payload = {
            "model": name,
            "prompt": text,
            "max_tokens": request.max_tokens,
            "temperature": temperature,
        }
        r = httpx.post(
            f"{request.replica_url}/v1/completions",
            json=payload,
            headers=request.headers,
            timeout=120,
        )
        r.raise_for_status()
        text = r.json()["choices"][0]["text"]
        rewards.append(score(request.env_url, s, text))
        lengths.append(len(text.strip()))
    block = {
        "episodes": len(rewards),
        "reward_mean": round(statistics.fmean(rewards), 4),
        "reward_se": round(statistics.stdev(rewards) / math.sqrt(len(rewards)), 4),
        "answer_chars": round(statistics.fmean(lengths), 3),
    }
    return block | ({"per_seed": rewards} if per_seed else {})


def episode_counts(completion) -> dict[str, int]:
    """One training episode's counts: the characters of its answer."""
    return {"chars": len(answer_text(completion).strip())}


def step_figures(counts: dict[str, int], games: int) -> dict:
    """A step's figures: the mean characters of its answers (None with no game)."""
    return {"answer_chars": round(counts.get("chars", 0) / games, 3) if games else None}


# the letter task's own figure: how long its answers are (a word is 5 letters)
FIGURES = (
    TaskFigure(
        name="answer_chars",
        label="answer length",
        unit="chars",
        higher_is_better=None,
        headline=True,
    ),
)

TASK = Task(
    name="letter",
    dataset=dataset,
    server=EnvServer("letter-env", (os.path.join(HERE, "letter_env.py"),), HERE),
    reward_funcs=[letter_reward],
    eval_seeds=lambda count: list(range(HELD_OUT_FIRST, HELD_OUT_FIRST + count)),
    eval_seed_count=HELD_OUT_COUNT,
    evaluate=evaluate,
    episode_counts=episode_counts,
    step_figures=step_figures,
    figures=FIGURES,
)
