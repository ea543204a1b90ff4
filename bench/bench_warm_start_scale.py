"""How far the warm start alone takes the local model with more supervised fine-tuning: more
teacher games and more epochs, on a GPU where there is one (docs/BENCHMARKS.md section 6 (the main job), "What
would take it to a win rate of 0.5").

Each point builds the local model's warm start (``trainer.task.wordle.warm_start.build``: the
teacher's games, the tokenizer, the spelling-initialised model, SFT) with ``games`` teacher games
and ``epochs`` passes, then plays the first ``--episodes`` held-out games in this process: the model
samples each turn at temperature 1 over its whole vocabulary (as the replica's evaluation does),
the game is ``wordle_env.game.WordleGame`` (the rules the Wordle server runs) and the tool replies
are the trainer's own (``EpisodeStats.reply``). Reported per point: win rate, the environment's
reward +- SE, consistent share of later guesses, invalid moves by reason, bad endings, SFT seconds.
The player is not the replica: its figures are for comparing points with each other; the
replica's evaluation of the default warm start is in ``make train``'s summary.

Run: ``.venv/bin/python bench/bench_warm_start_scale.py [--points 3000:3,12000:3] [--episodes 512]
[--device cuda]``; writes ``bench/results/warm_start_scale-<device>.json``. On 2 CPU cores the default
point alone takes about 5 minutes; the larger points are meant for a GPU. ``--smoke``: 100 games in
one epoch, 4 held-out games, written under ``bench/results/smoke/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))  # the trainer package (run from anywhere)

from report import parse_with_smoke, save, smoke_path  # noqa: E402

from trainer.task.wordle.figures import EpisodeResult, summarize  # noqa: E402
from trainer.task.wordle.game_env import (  # noqa: E402
    MAX_TURNS,
    RESET_TEXT,
    EpisodeStats,
    call_message,
    eval_seeds,
    guess_tool,
    parse_call,
    prompt_messages,
)
from trainer.task.wordle.warm_start import WarmStartConfig, build, teacher_games  # noqa: E402
from wordle_env import wordlists  # noqa: E402
from wordle_env.game import WordleGame  # noqa: E402

RESULTS = REPO / "bench" / "results"  # warm_start_scale-<device>.json


def play(model, tokenizer, seeds: list[int], max_tokens: int = 32, batch: int = 512) -> dict:
    """Play the games of ``seeds`` with ``model`` sampling at temperature 1 (all games of a batch
    advance one turn per ``generate`` call); returns the evaluation block of
    ``trainer.task.wordle.figures.summarize``, the same figures as the replica's evaluation."""
    import torch

    device = next(model.parameters()).device
    model.eval()
    tokenizer.padding_side = "left"
    tools = [guess_tool()]
    games = []
    for seed in seeds:
        messages = prompt_messages()
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + RESET_TEXT}
        game = WordleGame(wordlists.target_for_seed(seed))
        games.append(SimpleNamespace(seed=seed, game=game, stats=EpisodeStats(), messages=messages))
        games[-1].turns, games[-1].wellformed, games[-1].end = 0, 0, None
    torch.manual_seed(0)
    for _turn in range(MAX_TURNS):
        live = [g for g in games if g.end is None]
        for i in range(0, len(live), batch):
            part = live[i : i + batch]
            texts = [
                tokenizer.apply_chat_template(
                    g.messages,
                    tools=tools,
                    add_generation_prompt=True,
                    tokenize=False,
                    enable_thinking=False,
                )
                for g in part
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(device)
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=max_tokens,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            for g, row in zip(part, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
                g.turns += 1
                word = parse_call(tokenizer.decode(row, skip_special_tokens=False))
                if word is None:
                    g.end = "malformed"
                    continue
                g.wellformed += 1
                move = g.game.play(f"[{word.strip().lower()}]")
                obs = SimpleNamespace(
                    reply=move.reply,
                    done=g.game.done,
                    won=g.game.won,
                    guesses=list(g.game.guesses),
                    feedback=list(g.game.marks),
                    error_code=None if move.invalid is None else move.invalid.code,
                )
                g.stats.record(obs)
                g.messages.append(call_message(word))
                g.messages.append(
                    {"role": "tool", "name": "guess", "content": g.stats.reply(obs, obs.done)}
                )
                if g.game.done:
                    won, invalid = g.game.won, g.stats.last_invalid
                    g.end = "won" if won else ("invalid" if invalid else "out_of_guesses")
    return summarize(
        [
            EpisodeResult(
                g.seed, g.turns, g.wellformed, g.stats, g.game.reward, g.end or "turn_limit"
            )
            for g in games
        ]
    )


def _setting(kv: str) -> tuple[str, object]:
    """``"layers=4"`` -> ``("layers", 4)``, typed as the ``WarmStartConfig`` field's default.

    Raises:
        SystemExit: not ``key=value``, an unknown field, or a value of the wrong type.
    """
    key, sep, value = kv.partition("=")
    fields = {f.name: f for f in dataclasses.fields(WarmStartConfig)}
    if not sep or key not in fields:
        raise SystemExit(f"--set: expected key=value with a WarmStartConfig field, found {kv!r}")
    default = fields[key].default
    try:
        if isinstance(default, bool):
            return key, {"true": True, "false": False}[value.lower()]
        if default is None:  # teacher_top_k: an int, or none
            return key, None if value.lower() == "none" else int(value)
        return key, type(default)(value)
    except (KeyError, ValueError):
        kind = "int or none" if default is None else type(default).__name__
        raise SystemExit(f"--set {key}: expected a {kind}, found {value!r}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default="3000:3", help="comma-separated games:epochs")
    p.add_argument("--episodes", type=int, default=512, help="held-out games per point")
    p.add_argument("--device", default=None, help="cuda where available, else cpu")
    p.add_argument("--set", action="append", default=[], help="another WarmStartConfig field, k=v")
    p.add_argument("--out", help="default: bench/results/warm_start_scale-<device>.json")
    p.add_argument("--model", help="play a saved model folder (e.g. a cached warm start) instead")
    args = parse_with_smoke(p, dict(points="100:1", episodes=4))
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = f"warm_start_scale-{device}.json"
    args.out = args.out or (smoke_path(name) if args.smoke else str(RESULTS / name))
    if args.model:  # the player checked against the replica's evaluation of the same model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
        result = play(
            model, AutoTokenizer.from_pretrained(args.model), eval_seeds()[: args.episodes]
        )
        print(json.dumps({"model": args.model, "device": device, **result}), flush=True)
        return
    extra = dict(_setting(kv) for kv in args.set)
    seeds = eval_seeds()[: args.episodes]
    rows, made = [], {}
    for point in args.points.split(","):
        n_games, epochs = (int(x) for x in point.split(":"))
        cfg = dataclasses.replace(WarmStartConfig(), games=n_games, epochs=epochs, **extra)
        t0 = time.perf_counter()
        if n_games not in made:  # the teacher's games of a size are made once (~10 ms a game)
            made[n_games] = teacher_games(cfg)
        model, tokenizer, figures = build(cfg, device, made[n_games])
        built = time.perf_counter() - t0
        t1 = time.perf_counter()
        result = play(model, tokenizer, seeds)
        row = {
            "games": n_games,
            "epochs": epochs,
            **extra,
            "device": device,
            "sft_steps": figures["steps"],
            "sft_s": round(figures["train_s"], 1),
            "build_s": round(built, 1),
            "loss_last": round(figures["loss_last"], 3),
            "play_s": round(time.perf_counter() - t1, 1),
            **result,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        # written after every point: a run stopped at its time limit keeps what it measured
        save(Path(args.out), {"points": rows, "device": device, "torch": torch.__version__})


if __name__ == "__main__":
    main()
