"""What the warm start of a pretrained model that never called a tool teaches it: the first call
of new games, sampled, parsed and checked (docs/BENCHMARKS.md section 11 (a real pretrained chat model), the warm-start table).

The model is ``make model``'s SmolLM2-135M-Instruct with the trainer's tool template
(``trainer.task.chat_format.with_tool_template``); each point builds (or finds cached) its warm
start (``trainer.task.wordle.hub_warm_start``) with the settings given, then samples ``--samples``
first turns at temperature 1 over the whole vocabulary (as the replica's evaluation samples) from
the prompt as the rollout renders it, in transformers on this machine. Reported: calls that parse
(``trainer.task.wordle.game_env.parse_call``), five-letter words, valid guesses (the Wordle server's
word list), the SFT seconds. The replica's own evaluation of the default is in ``make train``'s
summary; these figures compare settings with each other.

Run: ``.venv/bin/python bench/bench_hub_warm_start.py [--set games=48 --set learning_rate=5e-5]
[--samples 32]``; writes ``bench/results/hub_warm_start.json``. The default point is cached after
``make train MODEL=runs/models/smollm2-135m-instruct``; a new point takes 3-7 minutes on 2 cores.
``--smoke``: the same model, 2 games cut to their first call (one SFT step) built in a temporary
cache, 2 samples; about a minute on 2 cores (``make model``'s conversion, when it is not there yet,
comes on top).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))  # the trainer package (run from anywhere)

from report import parse_with_smoke, save, smoke_path  # noqa: E402

from tools.real_model import real_model  # noqa: E402
from trainer.task.chat_format import (  # noqa: E402
    rollout_template,
    tool_template_folder,
    with_tool_template,
)
from trainer.task.wordle.game_env import RESET_TEXT, guess_tool, parse_call, prompt_messages  # noqa: E402
from trainer.task.wordle.hub_warm_start import HubWarmStartConfig, hub_warm_start  # noqa: E402


def first_calls(path: str, samples: int, seed: int = 0) -> dict:
    """Sample ``samples`` first turns of the model at ``path``; returns the counts and words."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wordle_env import wordlists

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    messages = prompt_messages()
    messages[-1]["content"] += RESET_TEXT
    ids = tokenizer.apply_chat_template(
        messages,
        tools=[guess_tool()],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        enable_thinking=False,
        chat_template=rollout_template(tokenizer),
    )
    x = torch.tensor([ids] * samples)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=32,  # TrainConfig.max_completion_length
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
        )
    texts = [tokenizer.decode(o[len(ids) :], skip_special_tokens=False) for o in out]
    words = [w.strip().lower() for w in map(parse_call, texts) if w is not None]
    allowed = wordlists.allowed_guesses()
    return {
        "samples": samples,
        "parsed": len(words),
        "five_letters": sum(len(w) == 5 for w in words),
        "valid": sum(w in allowed for w in words),
        "words": words,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", action="append", default=[], help="a HubWarmStartConfig field=value")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--cache", default=str(REPO / "runs" / "cache"))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "hub_warm_start.json"))
    smoke = dict(set=["games=2", "turns=1"], samples=2, cache=None)
    args = parse_with_smoke(p, {**smoke, "out": smoke_path("hub_warm_start.json")})
    if args.cache is None:  # --smoke: a temporary cache, not runs/cache
        with tempfile.TemporaryDirectory(prefix="bench-hub-warm-start-") as tmp:
            args.cache = tmp
            run(args)
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    """Build (or find) the warm start of ``args``' settings, sample its first calls, write the
    result to ``args.out``."""
    kinds = {f.name: f.type for f in dataclasses.fields(HubWarmStartConfig)}
    kw = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in kinds:
            raise SystemExit(f"--set {item}: expected one of {', '.join(kinds)}, found {name!r}")
        kw[name] = {"int": int, "float": float}.get(kinds[name], str)(value)
    cfg = HubWarmStartConfig(**kw)
    base = real_model(str(REPO / "runs" / "models"))
    tools = with_tool_template(base, tool_template_folder(base, args.cache))
    t0 = time.perf_counter()
    path, build_s = hub_warm_start(args.cache, tools, cfg)
    result = {"config": dataclasses.asdict(cfg), "build_s": round(build_s, 1)}
    result |= first_calls(path, args.samples)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(
        f"{kw or 'default'}: parsed {result['parsed']}/{args.samples}, five letters "
        f"{result['five_letters']}, valid {result['valid']}; SFT {result['build_s']} s"
    )
    save(args.out, result)


if __name__ == "__main__":
    main()
