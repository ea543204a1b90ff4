"""The warm start of a pretrained chat model that has never been shown the ``guess`` tool.

SmolLM2-135M-Instruct, given the Wordle prompt and the tool, wrote 0 parsable calls in 512
held-out games (prose, code blocks, ``<tool_call2>``): GRPO would see no reward differences and
publish nothing. Before GRPO, :func:`hub_warm_start` fine-tunes the model (every weight) on the
teacher's games (``trainer.task.wordle.warm_start.solver_games``, the warm start's target words
only), rendered with the model's own tokenizer and exactly the template the rollout uses
(``trainer.task.chat_format.rollout_template``), the loss on the assistant turns only
(``trainer.task.wordle.warm_start.train_sft`` with hard labels: the soft targets need one token per
word, and in a BPE vocabulary a word is several).

On 2 cores a forward and backward pass of a 135 M-parameter model runs at about 100-140 tokens a
second, and a whole rendered game is about 1,100-1,300 tokens, so each game is cut after its first
``turns`` calls (~780 tokens), and the ~450 tokens every game shares (the system turn with the
tool schema, the user turn) are computed once per step without gradient
(:func:`shared_prefix_forward`): a game costs its ~330 suffix tokens. The format is in the first
call, the words in every call (docs/BENCHMARKS.md section 11 has the figures).

The result is cached under ``<cache_dir>/hub-warm-start-<key>``, the key hashing the model
folder's config and weight files, the settings, the SFT set itself (every game's token ids and
mask, ~2 s to build for 128 games) and the code that trains on it: an edit to the task that leaves
the teacher's games as they were (a reward, a docstring) keeps the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass

log = logging.getLogger("trainer.task.wordle.hub_warm_start")


@dataclass(frozen=True)
class HubWarmStartConfig:
    """Settings of a pretrained model's warm start (part of the cache key).

    Attributes:
        games: teacher games in the SFT set. 96 with small batches (the defaults): more
            optimizer steps, not more tokens a step, taught the tool-call format (the settings
            compared: docs/JOURNAL.md, "The trainer's defaults").
        turns: calls kept of each game (the game is cut after the tool reply of the last one).
        epochs: passes over the set.
        tokens_per_batch: padded tokens per optimizer step, the shared prompt not counted (about
            3 games cut to 3 calls).
        learning_rate: AdamW peak learning rate (linear warm-up 5%, cosine decay to 10%;
            ``trainer.task.wordle.warm_start.train_sft``).
        explore: share of the teacher's later moves replaced by a random answer, kept out of the
            loss (``trainer.task.wordle.warm_start.WarmStartConfig.explore``).
        seed: games and data order.
        threads: torch CPU threads.
    """

    games: int = 96
    turns: int = 3
    epochs: int = 1
    tokens_per_batch: int = 1024
    learning_rate: float = 1e-4
    explore: float = 0.25
    seed: int = 0
    threads: int = 2


def _model_digest(model_path: str) -> str:
    """A digest of a model folder: its config and, per weight file, its name, size and first MiB
    (enough to tell two checkpoints apart without reading hundreds of MB)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(model_path)):
        path = os.path.join(model_path, name)
        if name == "config.json" or name.endswith(".jinja"):
            with open(path, "rb") as f:
                h.update(name.encode() + f.read())
        elif name.endswith(".safetensors"):
            with open(path, "rb") as f:
                h.update(f"{name}:{os.path.getsize(path)}".encode() + f.read(1 << 20))
    return h.hexdigest()


def _key(model_path: str, cfg: HubWarmStartConfig, seqs: list) -> str:
    """The cache key of the warm start of ``model_path`` under ``cfg`` on the SFT set ``seqs``
    (:func:`encoded_games`): 16 hex digits of a SHA-256 over the settings, the model's digest,
    the set's token ids and masks, and the code that trains on them (this module and
    ``trainer.task.wordle.warm_start``)."""
    from trainer.task.wordle import warm_start

    h = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode())
    h.update(_model_digest(model_path).encode())
    h.update(json.dumps([(ids, mask) for ids, mask, _ in seqs]).encode())
    for path in (warm_start.__file__, __file__):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def cut(messages: list[dict], turns: int) -> list[dict]:
    """The game ``messages`` (prompt, then call / tool reply pairs, then a final assistant
    message) up to the tool reply of its ``turns``-th call; the whole game when it is shorter."""
    out, calls = [], 0
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            if calls == turns:
                break
            calls += 1
        out.append(m)
    return out


def encoded_games(cfg: HubWarmStartConfig, tokenizer) -> list[tuple[list[int], list[int], list]]:
    """The SFT set: ``(token ids, 0/1 assistant mask, [])`` per teacher game, cut to
    ``cfg.turns`` calls and rendered as the rollout renders it."""
    from trainer.task.chat_format import render_turns, rollout_template
    from trainer.task.wordle import warm_start as ws
    from trainer.task.wordle.game_env import guess_tool

    template = rollout_template(tokenizer)
    seqs = []
    for game in ws.solver_games(cfg.games, cfg.seed, cfg.explore):
        game = cut(game, cfg.turns)
        text = render_turns(tokenizer, game, [guess_tool()], chat_template=template)
        ids, mask = ws.encode_with_mask(text, tokenizer, ws._trained_turns(game))
        seqs.append((ids, mask, []))
    return seqs


def common_prefix(seqs: list[tuple[list[int], list[int], list]]) -> int:
    """The length of the token prefix every game shares up to the token before its first
    trained token (the system turn with the tool schema, the user turn): it is computed once per
    optimizer step, without gradient, by :func:`shared_prefix_forward`."""
    first = seqs[0][0]
    n = min(len(ids) for ids, _, _ in seqs)
    for ids, mask, _ in seqs:
        k = 0
        while k < n and ids[k] == first[k] and not mask[k]:
            k += 1
        n = k
    return max(0, n - 1)  # the suffix starts with the token that predicts the first trained one


def shared_prefix_forward(prefix_ids: list[int]):
    """A ``forward(model, ids, attn)`` for ``trainer.task.wordle.warm_start.train_sft`` whose batch
    holds only the games' suffixes after ``prefix_ids``: the prefix's keys and values are computed
    once per call without gradient (the weights changed since the last step) and shared by the
    batch's rows through the decoder's KV cache, so a game costs its suffix (~330 of ~780 tokens
    at 3 calls) instead of the whole text. The loss's tokens all lie in the suffix; what is lost
    is the gradient through the prefix's keys and values. Returns the (B, T, H) hidden states of
    the suffix tokens, equal to the full forward's (``tests/trainer/test_real_model_chat.py``)."""
    import torch
    from transformers import DynamicCache

    prefix = torch.tensor([prefix_ids])

    def forward(model, ids, attn):
        b, w = ids.shape
        p = prefix.shape[1]
        with torch.no_grad():
            cache = model.model(input_ids=prefix.to(ids.device), use_cache=True).past_key_values
        kv = [
            (layer.keys.expand(b, -1, -1, -1), layer.values.expand(b, -1, -1, -1))
            for layer in cache.layers
        ]
        mask = torch.cat([torch.ones(b, p, dtype=attn.dtype, device=attn.device), attn], 1)
        pos = torch.arange(p, p + w, device=ids.device)[None].expand(b, -1)
        out = model.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=DynamicCache(ddp_cache_data=kv),
            use_cache=True,
        )
        return out.last_hidden_state

    return forward


def hub_warm_start(
    cache_dir: str, model_path: str, cfg: HubWarmStartConfig | None = None
) -> tuple[str, float]:
    """The warm-started copy of the pretrained model at ``model_path`` (a folder whose chat
    template handles tools: ``trainer.task.chat_format.with_tool_template``), built once, then
    cached (``trainer.task.wordle.warm_start.cached_build``).

    Returns:
        ``(model folder, seconds spent building it)``; 0 seconds when it came from the cache.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.task.wordle import warm_start as ws

    cfg = cfg or HubWarmStartConfig()

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    seqs = encoded_games(cfg, tokenizer)

    def build_into(tmp: str) -> dict:
        torch.set_num_threads(cfg.threads)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        sft = ws.WarmStartConfig(
            games=cfg.games,
            epochs=cfg.epochs,
            tokens_per_batch=cfg.tokens_per_batch,
            learning_rate=cfg.learning_rate,
            seed=cfg.seed,
            soft=False,
        )
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        p = common_prefix(seqs)
        suffixes = [(ids[p:], mask[p:], soft) for ids, mask, soft in seqs]
        forward = shared_prefix_forward(seqs[0][0][:p])
        figures = ws.train_sft(model, suffixes, sft, pad_id, forward=forward)
        model.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        log.info(
            "warm start of %s: %d SFT steps on %d games in %.0fs (%.0f tok/s), loss %.3f",
            model_path,
            figures["steps"],
            cfg.games,
            figures["train_s"],
            figures["tok_s"],
            figures["loss_last"],
        )
        return figures | {
            "config": asdict(cfg),
            "base": os.path.abspath(model_path),
            "game_tokens_mean": sum(len(s[0]) for s in seqs) / len(seqs),
            "shared_prefix_tokens": p,
        }

    path = os.path.abspath(os.path.join(cache_dir, f"hub-warm-start-{_key(model_path, cfg, seqs)}"))
    return ws.cached_build(path, build_into)


def logged(fn, *args):
    """``fn(*args)`` in a spawned child, its log lines formatted as the trainer's, without the
    weights' loading and saving bars."""
    from transformers.utils import logging as hf_logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    hf_logging.disable_progress_bar()
    return fn(*args)
