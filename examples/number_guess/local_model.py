"""The example's own small model for the local default (``--model tiny``, ``make train
TASK=number_guess``): a ~0.2 M-parameter Qwen3 (``trainer.task.char_model``) taught to call
``guess`` by a teacher's games, so that the task trains offline on 2 cores. A task needs no local
model (``--model`` names a real one); this one has it so that the example, and its test, run
without a download.

The teacher half plays binary search and half guesses anywhere in the range the feedback left,
now and then anywhere at all: the model learns the call format and plays worse than binary search,
so GRPO has something to improve. Its tokenizer is the char-level one plus, as single tokens, the
numbers 0..``HIGH`` and every text segment the rendered games repeat (the system prompt with the
tool schema, the call's JSON around its number, the reply's words): a game is ~200 tokens and the
SFT takes seconds. The model is built once and cached under the run's cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass

# Part of the cache key: raise it when the teacher, the tokenizer or the model changes.
BUILD_VERSION = 1
# The Space's rules (space/game.py), which the teacher plays by.
LOW, HIGH, MAX_GUESSES = 1, 100, 7
FINAL_TEXT = "Done."  # the assistant's last message, once the game is over
_SPECIAL = re.compile(r"(<\|[a-z_]+\|>|</?think>|</?tool_call>|</?tool_response>|\d+)")
_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)


@dataclass(frozen=True)
class LocalModelConfig:
    """What the local model is built from (all of it keys the cache).

    Attributes:
        games: teacher games.
        epochs: passes over them.
        batch: games a step.
        learning_rate: AdamW's.
        binary_search: the teacher's share of binary-search moves (the rest: anywhere in the
            range left, or with ``stray`` anywhere at all).
        stray: the share of moves anywhere in ``[LOW, HIGH]``.
        seed: the games' and the initial weights' seed.
    """

    games: int = 256
    epochs: int = 2
    batch: int = 16
    learning_rate: float = 3e-3
    binary_search: float = 0.5
    stray: float = 0.1
    seed: int = 0


def _call(number: int) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "guess", "arguments": {"number": number}}}
        ],
    }


def teacher_game(rng: random.Random, cfg: LocalModelConfig) -> list[dict]:
    """One teacher game as TRL's rollout builds it: the prompt (the reset text appended), then
    each ``guess`` call and the tool's reply, and :data:`FINAL_TEXT` once the game is over."""
    from examples.number_guess.env import reset_text, tool_reply
    from examples.number_guess.task import prompt_messages

    messages = prompt_messages()
    user = messages[-1]
    messages[-1] = {**user, "content": user["content"] + reset_text(LOW, HIGH, MAX_GUESSES)}
    secret, lo, hi = rng.randint(LOW, HIGH), LOW, HIGH
    for turn in range(1, MAX_GUESSES + 1):
        draw = rng.random()
        if draw < cfg.stray:
            number = rng.randint(LOW, HIGH)
        elif draw < cfg.stray + cfg.binary_search:
            number = (lo + hi) // 2
        else:
            number = rng.randint(lo, hi)
        if number == secret:
            feedback = "correct"
        else:
            feedback = "higher" if secret > number else "lower"
        if feedback == "higher":
            lo = max(lo, number + 1)
        elif feedback == "lower":
            hi = min(hi, number - 1)
        done = feedback == "correct" or turn == MAX_GUESSES
        reply = tool_reply(feedback, number, MAX_GUESSES - turn, done, LOW, HIGH)
        messages += [_call(number), {"role": "tool", "name": "guess", "content": reply}]
        if done:
            break
    messages.append({"role": "assistant", "content": FINAL_TEXT})
    return messages


def _tokenizer(texts: list[str]):
    """The char-level tokenizer plus the numbers and the repeated segments of ``texts``."""
    from trainer.task.char_model import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    counts = Counter(
        part
        for text in texts
        for part in _SPECIAL.split(text)
        if part and not _SPECIAL.fullmatch(part)
    )
    phrases = sorted(p for p, n in counts.items() if n >= 2 and len(p) > 1)
    tokenizer.add_tokens([str(n) for n in range(HIGH + 1)] + phrases)
    return tokenizer


def _encode(text: str, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of a rendered game and a 0/1 mask of the assistant's tokens."""
    spans = [m.span(1) for m in _ASSISTANT.finditer(text)]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def _train(model, seqs, cfg: LocalModelConfig, pad_id: int) -> float:
    """SFT on the assistant's tokens; returns the last batch's loss."""
    import torch

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    model.train()
    loss = None
    for _ in range(cfg.epochs):
        order = list(range(len(seqs)))
        rng.shuffle(order)
        for i in range(0, len(order), cfg.batch):
            batch = [seqs[j] for j in order[i : i + cfg.batch]]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), pad_id)
            labels = torch.full((len(batch), width), -100)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (x, m) in enumerate(batch):
                ids[r, : len(x)] = torch.tensor(x)
                attn[r, : len(x)] = 1
                labels[r, : len(x)] = torch.where(torch.tensor(m) == 1, torch.tensor(x), -100)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return loss.item()


def build(path: str, cfg: LocalModelConfig) -> dict:
    """Build the model into ``path`` (created); returns its build figures."""
    import torch
    from transformers import AutoModelForCausalLM

    from examples.number_guess.env import NumberGuessEnv
    from trainer.task.char_model import make_char_qwen3, make_char_tokenizer
    from trainer.task.chat_format import render_turns

    t0 = time.perf_counter()
    rng = random.Random(cfg.seed)
    games = [teacher_game(rng, cfg) for _ in range(cfg.games)]
    tools = [NumberGuessEnv().guess]
    plain = make_char_tokenizer()
    tokenizer = _tokenizer([render_turns(plain, g, tools) for g in games])
    seqs = [_encode(render_turns(tokenizer, g, tools), tokenizer) for g in games]
    vocab = -(-len(tokenizer) // 64) * 64
    make_char_qwen3(path, seed=cfg.seed, hidden_size=64, intermediate_size=128, vocab_size=vocab)
    tokenizer.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loss = _train(model, seqs, cfg, tokenizer.pad_token_id)
    model.to(torch.bfloat16).save_pretrained(path)
    return {
        "config": asdict(cfg),
        "vocab": len(tokenizer),
        "tokens_per_game": round(sum(len(s[0]) for s in seqs) / len(seqs), 1),
        "loss_last": round(loss, 4),
        "build_s": round(time.perf_counter() - t0, 1),
    }


def local_model(run, settings=None, cfg: LocalModelConfig | None = None):
    """``Task.local_model``: the model's folder under ``run.cache`` (built once, by one process
    at a time) and the seconds spent building it now (0 when cached). ``settings``: the run's
    ``trainer.settings.LocalModelSettings``, whose ``games``, ``epochs`` and ``seed`` override
    :class:`LocalModelConfig`'s (the model's size is fixed here); ``cfg``: all of it instead."""
    from filelock import FileLock

    if cfg is None:
        given = settings.given() if settings is not None else {}
        cfg = LocalModelConfig(**{k: given[k] for k in ("games", "epochs", "seed") if k in given})
    key = json.dumps({**asdict(cfg), "build": BUILD_VERSION}, sort_keys=True)
    path = os.path.join(run.cache, "number-guess-" + hashlib.sha256(key.encode()).hexdigest()[:16])
    os.makedirs(run.cache, exist_ok=True)
    with FileLock(path + ".lock"):
        if os.path.isfile(os.path.join(path, "local_model.json")):
            return path, 0.0
        t0 = time.perf_counter()
        tmp = path + ".building"
        shutil.rmtree(tmp, ignore_errors=True)
        figures = build(tmp, cfg)
        with open(os.path.join(tmp, "local_model.json"), "w") as f:
            json.dump(figures, f, indent=1)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        return path, time.perf_counter() - t0
