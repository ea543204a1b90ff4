"""The chat format a run's model plays Wordle in: its own template when it knows tools, a
tool-capable template of its own chat format when it does not.

TRL's rollout worker parses tool calls only for chat templates it knows (``add_response_schema``;
anything else stops the worker at start-up: "Unrecognized chat template"), and renders episodes
with the template, or with TRL's training variant of it when the template is not prefix-preserving
(``get_training_chat_template``). A model whose template has no tools (SmolLM2-135M-Instruct's
ChatML template, for one) has never been shown a tool; it gets TRL's ChatML tool template
(``qwen2_5.jinja``: the same ``<|im_start|>role ... <|im_end|>`` turns, tools listed in the
system turn, calls as ``<tool_call>{json}</tool_call>``), which TRL recognises. A model whose
template already handles tools (Qwen3) keeps its own.

The swapped template is written into a derived model folder (the weights linked, not copied), so
that TRL's trainer, its rollout child, the warm start and the evaluation, which each load the
tokenizer from the folder, all render the same text.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil

log = logging.getLogger("trainer.task.chat_format")

CHATML_TOOL_TEMPLATE = "qwen2_5.jinja"  # TRL's ChatML template with tools
_CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
# files of a tokenizer's own that save_pretrained writes again (with the new template)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


class ChatTemplateError(ValueError):
    """A model's chat template neither handles tools nor is a chat format this module has a tool
    template for; the message names the format found and how to give the model one."""


def has_tools(template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` list (its text uses the variable)."""
    return bool(template) and "tools" in template


def trl_template(name: str) -> str:
    """The text of TRL's chat template ``chat_templates/<name>`` from the installed package.

    Raises:
        ChatTemplateError: TRL is not installed or lacks the file.
    """
    spec = importlib.util.find_spec("trl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "chat_templates", name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    raise ChatTemplateError(
        f"expected TRL's chat template chat_templates/{name} in the installed trl package, found "
        "none; install the trainer extra (pip install -e '.[trainer]')"
    )


def tool_template_for(template: str | None) -> str | None:
    """The tool-capable template to give a model whose chat template is ``template``: None when
    it handles tools already (it is kept), TRL's ChatML tool template for a ChatML template.

    Raises:
        ChatTemplateError: no template, or one of a format other than ChatML without tools.
    """
    if has_tools(template):
        return None
    if template and all(m in template for m in _CHATML_MARKERS):
        return trl_template(CHATML_TOOL_TEMPLATE)
    raise ChatTemplateError(
        "expected a chat template that renders tools, or a ChatML one (<|im_start|>role ... "
        f"<|im_end|>) that this trainer can give TRL's tool template, found "
        f"{'none' if not template else repr(template[:80] + '...')}; set a tool-capable "
        "template (one TRL's add_response_schema knows) as the tokenizer's chat_template"
    )


def rollout_template(tokenizer) -> str | None:
    """The template TRL's rollout renders episodes with: None for the tokenizer's own (when it is
    prefix-preserving), else TRL's training variant of it (e.g. for Qwen3-0.6B). The warm start
    and the evaluation render with it too, so all three see the same tokens."""
    from trl.chat_template_utils import (
        get_training_chat_template,
        is_chat_template_prefix_preserving,
    )

    if is_chat_template_prefix_preserving(tokenizer):
        return None
    return get_training_chat_template(tokenizer)


_ROLLOUT = object()  # render_turns' default: the rollout's template (rollout_template)


def render_turns(
    tokenizer,
    messages: list[dict],
    tools: list[dict],
    *,
    tokenize: bool = False,
    generation_prompt: bool = False,
    chat_template=_ROLLOUT,
):
    """A conversation rendered as TRL's rollout renders an episode (its tools, the rollout's
    template, no thinking: ``trainer.loop.grpo`` passes ``enable_thinking=False`` to TRL), so
    that the warm start, the evaluation and the context check see the tokens training sees.

    Args:
        tokenizer: the run's tokenizer.
        messages: chat messages (``role``, ``content``; tool calls and tool replies).
        tools: the environment's tool schemas.
        tokenize: token ids (list[int]) instead of text.
        generation_prompt: end with the assistant's turn opened, as for generation.
        chat_template: a template already computed by :func:`rollout_template` (a loop over
            turns passes it once); default: computed here.
    """
    template = rollout_template(tokenizer) if chat_template is _ROLLOUT else chat_template
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=generation_prompt,
        tokenize=tokenize,
        return_dict=False,
        chat_template=template,
        enable_thinking=False,
    )


def tool_template_folder(model: str, cache_dir: str) -> str:
    """Where :func:`with_tool_template` writes the derived folder of ``model`` (a hub id or a
    folder) under ``cache_dir``: its base name and a digest of its absolute path."""
    name = os.path.basename(os.path.normpath(model)).lower()
    digest = hashlib.sha256(os.path.abspath(model).encode()).hexdigest()[:8]
    return os.path.join(cache_dir, f"tools-{name}-{digest}")


def with_tool_template(model_path: str, dst: str) -> str:
    """``model_path`` itself when its chat template handles tools; else a folder ``dst`` holding
    the same model (every file but the tokenizer's linked to the original) whose tokenizer has the
    tool template of :func:`tool_template_for`. Logs the swap. Returns the folder to use.

    Raises:
        ChatTemplateError: see :func:`tool_template_for`.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    template = tool_template_for(tokenizer.chat_template)
    if template is None:
        return model_path
    src = model_path
    if not os.path.isdir(src):  # a hub id: the files of its snapshot
        from huggingface_hub import snapshot_download

        src = snapshot_download(model_path)
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in os.listdir(src):
        if name not in _TOKENIZER_FILES and os.path.isfile(os.path.join(src, name)):
            os.symlink(os.path.realpath(os.path.join(src, name)), os.path.join(tmp, name))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    log.info(
        "%s: its chat template has no tools; using TRL's ChatML tool template (%s) in %s",
        model_path,
        CHATML_TOOL_TEMPLATE,
        dst,
    )
    return dst
