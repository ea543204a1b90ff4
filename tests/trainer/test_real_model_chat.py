"""The hub-model branch with a real BPE tokenizer and a ChatML template without tools
(SmolLM2-135M-Instruct, converted by ``make model``): the trainer gives the model TRL's ChatML
tool template in a derived folder (weights linked, the original untouched), TRL's rollout parser
accepts it, a ``guess`` call renders and parses back (several tokens a word, within a turn's
token cap), malformed calls are scored below legal play, and the warm start trains on exactly the
call tokens of games rendered as the rollout renders them, shares their prompt without changing
a hidden state, and is built once, in bf16, with the tool template."""

from __future__ import annotations

import os

import pytest

from trainer.config import GRPOSettings
from trainer.task import chat_format
from trainer.task.wordle.game_env import (
    RESET_TEXT,
    EpisodeStats,
    call_message,
    episode_reward,
    guess_tool,
    parse_call,
    prompt_messages,
)
from trainer.task.wordle.hub_warm_start import HubWarmStartConfig, cut, encoded_games


@pytest.fixture(scope="module")
def tool_model(real_model_dir, tmp_path_factory) -> str:
    return chat_format.with_tool_template(
        real_model_dir, str(tmp_path_factory.mktemp("tools") / "smol")
    )


@pytest.fixture(scope="module")
def tokenizer(tool_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)


def _render(tokenizer, messages, **kw) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tools=[guess_tool()],
        tokenize=False,
        enable_thinking=False,
        chat_template=chat_format.rollout_template(tokenizer),
        **kw,
    )


def test_a_template_without_tools_gets_trls_chatml_tool_template(real_model_dir, tool_model):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema

    own = AutoTokenizer.from_pretrained(real_model_dir)
    assert not chat_format.has_tools(own.chat_template)
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        add_response_schema(own)  # what stopped TRL's rollout worker before
    swapped = AutoTokenizer.from_pretrained(tool_model)
    assert swapped.chat_template == chat_format.trl_template(chat_format.CHATML_TOOL_TEMPLATE)
    add_response_schema(swapped)  # accepted now
    weights = os.path.join(tool_model, "model.safetensors")
    assert os.path.islink(weights)  # linked, not copied
    assert os.path.samefile(weights, os.path.join(real_model_dir, "model.safetensors"))
    assert AutoTokenizer.from_pretrained(real_model_dir).chat_template == own.chat_template
    assert chat_format.with_tool_template(tool_model, tool_model + "-again") == tool_model


def test_a_template_that_is_neither_tool_capable_nor_chatml_is_refused():
    with pytest.raises(chat_format.ChatTemplateError, match="ChatML") as e:
        chat_format.tool_template_for("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert "chat_template" in str(e.value)  # says how to fix it
    with pytest.raises(chat_format.ChatTemplateError, match="found none"):
        chat_format.tool_template_for(None)


def test_a_guess_call_renders_parses_back_and_fits_a_turn(tokenizer):
    from trl.chat_template_utils import add_response_schema

    messages = prompt_messages()
    messages[-1]["content"] += RESET_TEXT
    prompt = _render(tokenizer, messages, add_generation_prompt=True)
    full = _render(tokenizer, [*messages, call_message("crane")])
    assert full.startswith(prompt) and "<tool_call>" in prompt  # the system turn shows the format
    completion = full[len(prompt) :].rstrip("\n")
    assert parse_call(completion) == "crane"
    parsed = add_response_schema(tokenizer).parse_response(completion, prefix=prompt)
    assert parsed["tool_calls"][0]["function"] == {"name": "guess", "arguments": {"word": "crane"}}
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    assert len(tokenizer("crane", add_special_tokens=False)["input_ids"]) >= 1
    assert len(ids) <= GRPOSettings.max_completion_length  # a call fits the per-turn cap


@pytest.mark.parametrize(
    "text",
    [
        "```python\nguess('crane')\n```",  # the kinds of text the untrained model wrote
        '<tool_call2>{"name": 1, "arguments": {"word": "crane"}}</tool_call2>',
        '<tool_call>\n{"name": "guess", "arguments": {"word": "crane"}\n</tool_call>',
        "The word is crane.",
    ],
)
def test_a_malformed_call_is_no_move_and_scores_below_legal_play(text):
    assert parse_call(text) is None
    stopped = EpisodeStats()  # the episode ends at a malformed call: no guess, not done
    lost = EpisodeStats(accepted=6, done=True)  # six legal all-grey guesses: the worst legal game
    assert episode_reward(stopped) < episode_reward(lost) == 0.0


def test_the_warm_start_trains_on_the_call_tokens_of_games_as_the_rollout_renders_them(tokenizer):
    cfg = HubWarmStartConfig(games=4, turns=2)
    from trainer.task.wordle import warm_start as ws

    games = [cut(g, cfg.turns) for g in ws.solver_games(cfg.games, cfg.seed, cfg.explore)]
    for ids, mask, soft in encoded_games(cfg, tokenizer):
        game = games.pop(0)
        calls = [m for m in game if m.get("tool_calls")]
        assert len(calls) == min(cfg.turns, len(calls)) <= cfg.turns
        assert game[-1]["role"] == "tool" and soft == []
        assert tokenizer.decode(ids) == _render(tokenizer, game)  # the rollout's text exactly
        trained = tokenizer.decode([t for t, k in zip(ids, mask, strict=True) if k])
        words = [c["tool_calls"][0]["function"]["arguments"]["word"] for c in calls if c["train"]]
        assert trained.count("<tool_call>") == len(words) > 0
        for word in words:
            assert f'"word": "{word}"' in trained
        assert "<tool_response>" not in trained and "Wordle" not in trained


def test_the_shared_prompt_forward_equals_the_full_forward(tool_model, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.task.wordle.hub_warm_start import common_prefix, shared_prefix_forward

    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32)
    seqs = encoded_games(HubWarmStartConfig(games=6, turns=2), tokenizer)
    seqs = [seqs[0], next(s for s in seqs if len(s[0]) != len(seqs[0][0]))]
    p = common_prefix(seqs)
    assert p > 300  # the system turn with the tool schema and the user turn
    assert not any(m[: p + 1].count(1) for _, m, _ in seqs)  # nothing trained in it
    lengths = [len(ids) - p for ids, _, _ in seqs]
    assert lengths[0] != lengths[1]  # one row is padded
    ids = torch.zeros(2, max(lengths), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, (row, _, _) in enumerate(seqs):
        ids[r, : lengths[r]] = torch.tensor(row[p:])
        attn[r, : lengths[r]] = 1
    with torch.no_grad():
        shared = shared_prefix_forward(seqs[0][0][:p])(model, ids, attn)
        for r, (row, _, _) in enumerate(seqs):
            full = model.model(input_ids=torch.tensor([row])).last_hidden_state[0, p:]
            torch.testing.assert_close(shared[r, : lengths[r]], full, atol=2e-4, rtol=1e-4)


def test_the_warm_starts_cache_follows_its_sft_set_not_the_task_files(tool_model):
    """The cache key hashes the SFT set itself: the same games give the same key (an edit to the
    task that leaves them as they were keeps the cache), one token changed or a game cut
    elsewhere gives another."""
    from transformers import AutoTokenizer

    from trainer.task.wordle.hub_warm_start import _key

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    cfg = HubWarmStartConfig(games=2, turns=1)
    seqs = encoded_games(cfg, tokenizer)
    assert _key(tool_model, cfg, seqs) == _key(tool_model, cfg, encoded_games(cfg, tokenizer))
    ids, mask, soft = seqs[0]
    edited = [([*ids[:-1], ids[-1] + 1], mask, soft), *seqs[1:]]
    assert _key(tool_model, cfg, edited) != _key(tool_model, cfg, seqs)
    longer = HubWarmStartConfig(games=2, turns=2)
    assert _key(tool_model, longer, encoded_games(longer, tokenizer)) != _key(tool_model, cfg, seqs)


def test_the_warm_start_is_built_once_in_bf16_with_the_tool_template(tool_model, tmp_path):
    import json

    from safetensors import safe_open
    from transformers import AutoTokenizer

    from trainer.task.wordle.hub_warm_start import hub_warm_start

    cfg = HubWarmStartConfig(games=2, turns=1)
    path, build_s = hub_warm_start(str(tmp_path), tool_model, cfg)
    assert build_s > 0 and hub_warm_start(str(tmp_path), tool_model, cfg) == (path, 0.0)
    assert AutoTokenizer.from_pretrained(path).chat_template == chat_format.trl_template(
        chat_format.CHATML_TOOL_TEMPLATE
    )
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(n).get_dtype()) for n in f.keys()} == {"BF16"}
    with open(os.path.join(path, "warm_start.json")) as f:
        figures = json.load(f)
    assert figures["steps"] >= 1 and figures["shared_prefix_tokens"] > 300
    assert not os.path.exists(path + ".tmp")
