"""The warm start of the local default model: supervised fine-tuning on solver transcripts.

A random-init model never emits a well-formed tool call, so GRPO would see no reward differences.
Before GRPO, :func:`warm_start` builds the task tokenizer (``trainer.task.wordle.model``), creates a
small Qwen3 and fine-tunes it on games of the stochastic solver (``trainer.task.wordle.solver``)
rendered with exactly the chat template, tool schema and tool-response texts the rollout uses, with
the loss on the assistant turns only. The evaluation words are kept out.

A plain PyTorch loop, not TRL's ``SFTTrainer``: the 2507 template has no ``{% generation %}``
markers, so ``assistant_only_loss`` would need a patched template, while the assistant spans are
found directly from the rendered text's offsets here; the loop also packs games into fixed token
budgets, which is what makes the CPU budget (a few minutes) enough.

The result is cached under ``runs/cache/warm-start-<key>`` where the key hashes every input (this
file, the solver, the task texts, the word lists, the settings): a second ``make train`` reuses it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("trainer.task.wordle.warm_start")
_WORD_ARG = '"word": "'  # the text just before the called word
_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)


@dataclass(frozen=True)
class WarmStartConfig:
    """Settings of the warm start (they are part of the cache key).

    Attributes:
        games: solver games in the SFT set.
        tokenizer_games: games whose rendered text trains the BPE.
        epochs: passes over the SFT set.
        tokens_per_batch: packed tokens per optimizer step.
        learning_rate: AdamW peak learning rate (linear warm-up 5%, cosine decay to 10%).
        hidden_size: the local model's hidden size.
        layers: the local model's decoder layers.
        init: ``spelling`` or ``random`` (``trainer.task.wordle.model.build_model``).
        board: tool replies carry the board (``trainer.task.wordle.board``); False: the
            environment's text only (the model must then align the two feedback rows itself).
        teacher_top_k: the solver's later guesses: None, a uniformly random consistent answer;
            k, one of the k best-scored.
        n_openers: the solver's first guess is one of this many best openers.

            ``init``, ``board``, ``teacher_top_k`` and ``n_openers`` are the switches of the
            warm-start ablation (``bench/bench_warm_start.py``, docs/BENCHMARKS.md): a run keeps
            their defaults (``trainer.settings.LocalModelSettings`` sets none of them).
        soft: the loss at each called word is the cross-entropy against the teacher's whole
            distribution (:func:`soft_targets`); False: against the one word it played.
        explore: share of the solver's later moves replaced by a random answer (masked out of
            the loss): the model also learns the teacher's answer on histories like its own,
            where it otherwise wrote malformed calls (exposure bias; the idea of DAgger, Ross et
            al. 2011, with the solver as the expert).
        seed: games, init and data order.
        threads: torch CPU threads.
    """

    games: int = 3000
    tokenizer_games: int = 400
    epochs: int = 3
    tokens_per_batch: int = 8192
    learning_rate: float = 3e-3
    explore: float = 0.25
    hidden_size: int = 192
    layers: int = 2
    init: str = "spelling"
    board: bool = True
    teacher_top_k: int | None = None
    n_openers: int = 7
    soft: bool = True
    seed: int = 0
    threads: int = 2


def _key(cfg: WarmStartConfig) -> str:
    from trainer.task.wordle import board, game_env, solver, spelling
    from trainer.task.wordle import model as wordle_model
    from wordle_env import wordlists

    h = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode())
    for mod in (board, solver, spelling, wordle_model, game_env):
        with open(mod.__file__, "rb") as f:
            h.update(f.read())
    with open(__file__, "rb") as f:
        h.update(f.read())
    h.update("\n".join(wordlists.answers()).encode())
    h.update("\n".join(sorted(wordlists.allowed_guesses())).encode())
    h.update(wordle_model.chat_template().encode())
    return h.hexdigest()[:16]


def solver_games(
    n: int, seed: int, explore: float = 0.0, board: bool = True, **solver
) -> list[list[dict]]:
    """``n`` solver games (message lists) on the warm start's targets
    (``trainer.task.wordle.game_env.warm_start_targets``: never an evaluation word, never one of
    GRPO's), each target once in a shuffled pass before any comes again; ``explore`` and
    ``solver`` (``top_k``, ``n_openers``) as in ``trainer.task.wordle.solver.solver_guesses``,
    ``board`` as in :class:`WarmStartConfig`."""
    from trainer.task.wordle.game_env import solver_conversation, warm_start_targets
    from wordle_env.game import WordleGame

    rng = random.Random(seed)
    pool, order, games = warm_start_targets(), [], []
    for _ in range(n):
        if not order:
            order = rng.sample(pool, len(pool))
        games.append(solver_conversation(WordleGame(order.pop()), rng, explore, board, **solver))
    return games


def render(messages: list[dict], tokenizer) -> str:
    """A conversation as the rollout renders it (tools, no thinking)."""
    from trainer.task.chat_format import render_turns
    from trainer.task.wordle.game_env import guess_tool

    return render_turns(tokenizer, messages, [guess_tool()])


def encode_with_mask(text: str, tokenizer, trained=None) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a 0/1 mask of the assistant-generated tokens
    (everything after ``<|im_start|>assistant\\n`` up to and including ``<|im_end|>``).

    Args:
        trained: one flag per assistant turn, in order; turns flagged False are masked out
            (default: every turn is trained).
    """
    spans = [m.span(1) for m in _ASSISTANT.finditer(text)]
    if trained is not None:
        spans = [s for s, keep in zip(spans, trained, strict=True) if keep]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask, j = [], 0
    for start, _end in enc["offset_mapping"]:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        mask.append(int(j < len(spans) and spans[j][0] <= start < spans[j][1]))
    return enc["input_ids"], mask


def _trained_turns(messages: list[dict]) -> list[bool]:
    return [m.get("train", True) for m in messages if m["role"] == "assistant"]


def soft_targets(ids: list[int], mask: list[int], messages: list[dict], tokenizer) -> list:
    """The teacher's distribution at each trained word token: ``(position, option ids)`` pairs,
    where ``position`` indexes ``ids`` (the called word's token) and the options are the words
    the solver drew that guess from, uniformly (``options`` of its call message).

    Distillation from the teacher's whole distribution (soft targets, Hinton et al. 2015,
    "Distilling the Knowledge in a Neural Network") instead of its one sampled word: every turn
    teaches the full set of words consistent with the board, not one of them.

    Raises:
        ValueError: the trained word tokens and the trained calls do not pair up one to one.
    """
    answer_ids = _answer_ids(tokenizer)
    calls = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    options = [m.get("options") for m in calls if m.get("train", True)]
    positions = [
        i
        for i, (t, k) in enumerate(zip(ids, mask, strict=True))
        if k and t in answer_ids and tokenizer.decode(ids[i - 1 : i]).endswith(_WORD_ARG)
    ]
    if len(positions) != len(options):
        raise ValueError(
            f"expected one trained word token per trained call ({len(options)}), found "
            f"{len(positions)}: the tokenizer must hold every answer as one token"
        )
    return [
        (pos, tokenizer.convert_tokens_to_ids(list(opts)))
        for pos, opts in zip(positions, options, strict=True)
        if opts
    ]


@functools.lru_cache(maxsize=4)
def _answer_ids(tokenizer) -> frozenset:
    from wordle_env import wordlists

    return frozenset(tokenizer.convert_tokens_to_ids(list(wordlists.answers())))


def _batches(seqs, tokens_per_batch: int, rng: random.Random):
    """Lists of sequences of similar length whose padded size stays within ``tokens_per_batch``,
    in shuffled order (sorted by length within a shuffled window of 64 batches' worth, so padding
    wastes little and the order still varies per epoch)."""
    order = list(range(len(seqs)))
    rng.shuffle(order)
    window = max(1, 64 * tokens_per_batch // 500)
    batches = []
    for w in range(0, len(order), window):
        part = sorted(order[w : w + window], key=lambda i: len(seqs[i][0]))
        batch, width = [], 0
        for i in part:
            n = len(seqs[i][0])
            if batch and max(width, n) * (len(batch) + 1) > tokens_per_batch:
                batches.append(batch)
                batch, width = [], 0
            batch.append(seqs[i])
            width = max(width, n)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    yield from batches


def train_sft(model, seqs, cfg: WarmStartConfig, pad_id: int, forward=None) -> dict:
    """Supervised fine-tuning, loss on masked (assistant) tokens only, on the device that holds
    ``model`` (the local run: the CPU; ``bench/bench_warm_start_scale.py``: a GPU where there is
    one). ``forward(model, ids, attn)``: the (B, T, H) last hidden states of a padded batch
    (default: the decoder's plain forward; ``trainer.task.wordle.hub_warm_start`` passes one that
    shares the games' common prompt). Returns figures."""
    import torch

    device = next(model.parameters()).device

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    steps_per_epoch = sum(1 for _ in _batches(seqs, cfg.tokens_per_batch, random.Random(0)))
    total = steps_per_epoch * cfg.epochs
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    warm = max(1, total // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        p = min(1.0, (step - warm) / max(1, total - warm))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    step, t0, tokens, last = 0, time.perf_counter(), 0, None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="warm start (SFT)", unit="step", leave=False)
    for _epoch in range(cfg.epochs):
        for batch in _batches(seqs, cfg.tokens_per_batch, rng):
            width = max(len(s[0]) for s in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            soft_rows, soft_pos, soft_opts = [], [], []
            for r, (x, m, soft) in enumerate(batch):
                ids[r, : len(x)] = torch.tensor(x)
                attn[r, : len(x)] = 1
                lab = torch.tensor(x)
                lab[torch.tensor(m) == 0] = -100
                for pos, opts in soft:  # a word with a soft target: no hard label there
                    lab[pos] = -100
                    soft_rows.append(r)
                    soft_pos.append(pos - 1)  # predicted from the token before it
                    soft_opts.append(opts)
                labels[r, : len(x)] = lab
            ids, labels, attn = ids.to(device), labels.to(device), attn.to(device)
            # The lm_head dominates the cost: apply it only where a label is trained.
            if forward is None:
                hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
            else:
                hidden = forward(model, ids, attn)
            target = labels[:, 1:]
            keep = target != -100
            logits = model.lm_head(hidden[:, :-1][keep])
            hard = torch.nn.functional.cross_entropy(logits.float(), target[keep], reduction="sum")
            n = int(keep.sum())
            if soft_rows:
                # cross-entropy against the teacher's uniform distribution over its options
                soft_logits = model.lm_head(hidden[soft_rows, soft_pos]).float()
                dist = torch.zeros_like(soft_logits)
                for k, opts in enumerate(soft_opts):
                    dist[k, opts] = 1.0 / len(opts)
                soft = -(dist * soft_logits.log_softmax(-1)).sum()
                hard, n = hard + soft, n + len(soft_rows)
            loss = hard / max(n, 1)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            tokens += int(attn.sum())
            step += 1
            last = loss.item()
            bar.update(1)
            bar.set_postfix(loss=f"{last:.3f}")
    bar.close()
    dt = time.perf_counter() - t0
    return {"steps": step, "loss_last": last, "tokens": tokens, "train_s": dt, "tok_s": tokens / dt}


def teacher_games(cfg: WarmStartConfig) -> list[list[dict]]:
    """The warm start's SFT games for ``cfg`` (:func:`solver_games` with its teacher settings)."""
    return solver_games(
        cfg.games,
        cfg.seed,
        cfg.explore,
        cfg.board,
        top_k=cfg.teacher_top_k,
        n_openers=cfg.n_openers,
    )


def build(cfg: WarmStartConfig, device: str = "cpu", games=None) -> tuple[Any, Any, dict]:
    """Build the warm-started model (not cached): the teacher's games (``games``, when given:
    :func:`solver_games` of ``cfg`` made earlier), the tokenizer trained on them, the model
    (``trainer.task.wordle.model``) and its SFT on ``device``.

    Returns:
        ``(model, tokenizer, figures)``: the fp32 model on ``device``, the tokenizer, and
        :func:`train_sft`'s figures with ``game_tokens_mean``.
    """
    from trainer.task.char_model import make_char_tokenizer
    from trainer.task.wordle import model as wordle_model

    games = games or teacher_games(cfg)
    renderer = make_char_tokenizer(wordle_model.chat_template())  # renders text only
    texts = [render(g, renderer) for g in games]
    tokenizer = wordle_model.build_tokenizer(texts[: cfg.tokenizer_games])
    seqs = []
    for text, game in zip(texts, games, strict=True):
        ids, mask = encode_with_mask(text, tokenizer, _trained_turns(game))
        seqs.append((ids, mask, soft_targets(ids, mask, game, tokenizer) if cfg.soft else []))
    model = wordle_model.build_model(tokenizer, cfg.seed, cfg.hidden_size, cfg.layers, cfg.init)
    model = model.to(device)
    figures = train_sft(model, seqs, cfg, tokenizer.pad_token_id)
    figures["game_tokens_mean"] = sum(len(q[0]) for q in seqs) / len(seqs)
    return model, tokenizer, figures


def cached_build(path: str, build) -> tuple[str, float]:
    """The finished build at ``path`` (it holds ``warm_start.json``), else ``build(tmp)``, which
    writes a model folder into ``tmp`` and returns its figures, recorded in ``warm_start.json``
    with ``build_s``; ``tmp`` is then renamed to ``path``, so a stopped build never looks finished.

    Returns:
        ``(path, seconds spent building)``; 0 seconds when it was there already.
    """
    if os.path.exists(os.path.join(path, "warm_start.json")):
        log.info("warm start: cached model %s", path)
        return path, 0.0
    t0 = time.perf_counter()
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    figures = build(tmp)
    figures["build_s"] = time.perf_counter() - t0
    with open(os.path.join(tmp, "warm_start.json"), "w") as f:
        json.dump(figures, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path, figures["build_s"]


def warm_start(cache_dir: str, cfg: WarmStartConfig | None = None) -> tuple[str, float]:
    """The warm-started model folder for the local default (built once, then cached).

    Args:
        cache_dir: folder of cached models (``runs/cache`` for ``make train``).
        cfg: the settings (default :class:`WarmStartConfig`).

    Returns:
        ``(model folder, seconds spent building it)``; 0 seconds when it came from the cache.
    """
    import torch

    from trainer.task.wordle import model as wordle_model

    cfg = cfg or WarmStartConfig()

    def build_into(tmp: str) -> dict:
        torch.set_num_threads(cfg.threads)
        model, tokenizer, figures = build(cfg)
        wordle_model.save(model, tokenizer, tmp)
        log.info(
            "warm start: %d SFT steps in %.0fs (%.0f tok/s), loss %.3f",
            figures["steps"],
            figures["train_s"],
            figures["tok_s"],
            figures["loss_last"],
        )
        params = sum(p.numel() for p in model.parameters())
        return figures | {"config": asdict(cfg), "params": params, "vocab": len(tokenizer)}

    path = os.path.abspath(os.path.join(cache_dir, f"warm-start-{_key(cfg)}"))
    return cached_build(path, build_into)
