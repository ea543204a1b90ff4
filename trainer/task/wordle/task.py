"""Wordle as a :class:`~trainer.task.base.Task`: the one environment the template ships.

Each piece is defined in its own module of this package (``game_env``: prompts, the OpenEnv
client as TRL's tool environment, the reward; ``figures``: the figures of the held-out games, which
the generic evaluation of tool tasks plays (``tool_eval``); ``board``: the per-episode
counts; ``warm_start`` / ``hub_warm_start``: the teacher's warm starts; ``spelling_tie``: the
local model's answer rows). This file assembles them, and plays the held-out games from flat
arguments for the benches (:func:`evaluate`).
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os

from deltasync.status import TaskFigure
from trainer.task.base import EnvServer, EvalRequest, Task, ToolEpisode
from trainer.task.wordle import board, credit, game_env

# spaces/wordle-env, run as `python -m wordle_env.server.app` (the trainer never imports the Space)
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
WORDLE_DIR = os.path.join(_REPO, "spaces", "wordle-env")


def _eval_figures(episodes: list[ToolEpisode]) -> dict:
    from trainer.task.wordle.figures import figures

    return figures(episodes)


def _eval_reward(env) -> float:
    from trainer.task.wordle.figures import eval_reward

    return eval_reward(env)


def _check_context(
    replica_url: str, model_path: str, max_tokens: int, headers: dict | None = None
) -> int:
    from trainer.task.wordle.figures import check_context

    return check_context(replica_url, model_path, max_tokens, headers)


def episode_counts(completion: list) -> dict[str, int]:
    """One training episode's counts: ``consistent`` / ``checked`` guesses
    (``board.consistency``), ``accepted`` guesses and ``invalid:<code>`` moves
    (``board.move_tally``)."""
    consistent, checked = board.consistency(completion)
    accepted, invalid = board.move_tally(completion)
    counts = {"consistent": consistent, "checked": checked, "accepted": accepted}
    counts.update({f"invalid:{code}": n for code, n in invalid.items()})
    return counts


def turn_rewards(completion: list) -> list[float | None]:
    """Each assistant turn's own reward in one training episode, read from the game's reply that
    follows it: an accepted guess earns its expected partial credit given the feedback before it
    (``credit.expected_credits``: its mean ``(greens + 0.5 yellows) / 5`` over the answers still
    possible, so a guess that uses the board is worth more whatever the secret), an invalid move
    ``-INVALID_PENALTY`` (``wordle_task``, the episode reward's units); a turn the game did not
    answer (no call, a call the tool could not run, the call the call cap refused) has None.

    The credit a guess then earned carries the luck of the secret, and taught words of the right
    length but not reading the board (docs/JOURNAL.md, "The Wordle reward's settings").

    Args:
        completion: the episode's messages after the prompt (TRL's ``RolloutSample.completion``).

    Returns:
        one entry per assistant message, in order.
    """
    out: list[float | None] = []
    guesses, marks, accepted_at = [], [], []
    for i, message in enumerate(completion):
        if message.get("role") != "assistant":
            continue
        reply = completion[i + 1] if i + 1 < len(completion) else {}
        reward = None
        if reply.get("role") == "tool":
            words, rows = board.accepted_moves([reply])
            if rows:
                guesses += words
                marks += rows
                accepted_at.append(len(out))
            elif board.move_tally([reply])[1]:
                reward = -game_env.INVALID_PENALTY
        out.append(reward)
    for turn, value in zip(accepted_at, credit.expected_credits(guesses, marks), strict=True):
        out[turn] = value
    return out


def step_figures(counts: dict[str, int], games: int) -> dict:
    """A step's Wordle figures from its games' summed :func:`episode_counts`: the consistent
    share, the valid share of moves, accepted guesses a game, invalid moves by code (None where
    nothing was counted)."""
    invalid = {k.split(":", 1)[1]: n for k, n in counts.items() if k.startswith("invalid:")}
    accepted, checked = counts.get("accepted", 0), counts.get("checked", 0)
    moves = accepted + sum(invalid.values())
    return {
        "consistent_rate": round(counts.get("consistent", 0) / checked, 4) if checked else None,
        "valid_rate": round(accepted / moves, 4) if moves else None,
        "guesses_mean": round(accepted / games, 3) if games else None,
        "invalid_reasons": invalid,
    }


def _attach(trainer, run, grpo) -> None:
    """The local model's answer rows move only along their spelling (``spelling_tie``)."""
    if not grpo.tie_answer_rows:
        return
    from trainer.task.wordle.spelling_tie import SpellingTiedRows

    model = trainer.accelerator.unwrap_model(trainer.model)
    trainer.add_callback(SpellingTiedRows(model, trainer.processing_class))


def _local_model(run, settings) -> tuple[str, float]:
    """The local default's model: a ~2.7 M-parameter Qwen3 with one token per answer, warm
    started on the solver's games (``warm_start``, cached); ``settings``: the run's
    ``trainer.settings.LocalModelSettings`` over ``WarmStartConfig``'s defaults."""
    from trainer.task.wordle.warm_start import WarmStartConfig, warm_start

    return warm_start(run.cache, WarmStartConfig(**settings.given()))


def _warm_start(run, model_path: str, games: int) -> tuple[str, float]:
    """A pretrained model's warm start on ``games`` teacher games (``hub_warm_start``), in a
    spawned child: its SFT peaked at ~10 GB of activations (SmolLM2-135M, 4k-token batches) that
    the trainer's process would keep as freed heap beside TRL's model."""
    from trainer.task.wordle.hub_warm_start import hub_warm_start, logged

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(logged, (hub_warm_start, run.cache, model_path, hub_config(run, games)))


def hub_config(run, games: int):
    """The warm-start settings of a pretrained model from the run's (``games`` teacher games,
    ``run.hub_warm_start_turns`` calls of each, ``run.seed``); the rest are
    ``HubWarmStartConfig``'s measured defaults."""
    from trainer.task.wordle.hub_warm_start import HubWarmStartConfig

    return HubWarmStartConfig(games=games, turns=run.hub_warm_start_turns, seed=run.seed)


def _share(name: str, label: str, *, better: bool | None = True, **where) -> TaskFigure:
    return TaskFigure(name=name, label=label, unit="share", higher_is_better=better, **where)


# Wordle's figures in the order they are shown: the step line shows those of the training games
# (``step_figures``), the summary and the dashboard those of the held-out games (the evaluation
# block, ``trainer.task.wordle.figures.summarize``) too; the headline ones are on the learning
# curve.
EVAL_ONLY = {"steps": False}
FIGURES = (
    _share("win_rate", "win rate", headline=True, **EVAL_ONLY),
    # later guesses that fit every earlier feedback row (``board.consistency``)
    _share("consistent_rate", "consistent", headline=True),
    # of the training games' moves, the accepted guesses (``step_figures``)
    _share("valid_rate", "valid", headline=True, evals=False),
    # of the held-out games' parseable calls, those the game accepted as a word
    _share("valid_guess_rate", "valid", headline=True, **EVAL_ONLY),
    TaskFigure(name="guesses_mean", label="guesses a game", unit="guesses", higher_is_better=None),
    # invalid moves by the game's code (wrong_length, not_a_word, ...): "invalid_reasons/<code>"
    TaskFigure(
        name="invalid_reasons",
        label="invalid moves",
        unit="moves",
        higher_is_better=False,
        counts=True,
    ),
    _share("wellformed_rate", "well-formed calls", **EVAL_ONLY),
    _share("invalid_rate", "invalid moves a turn", better=False, **EVAL_ONLY),
    _share("stopped_early_rate", "stopped early", better=False, **EVAL_ONLY),
    _share("two_guesses_rate", "two guesses or a win", **EVAL_ONLY),
    _share("bad_end_rate", "malformed or invalid end", better=False, **EVAL_ONLY),
    _share("no_guess_rate", "no accepted guess", better=False, **EVAL_ONLY),
    TaskFigure(name="guess_value_mean", label="guess value", steps=False),
    TaskFigure(name="shaped_reward_mean", label="shaped reward", unit="reward", steps=False),
    _share("stop_after_good_rate", "stopped after a good row", better=None, **EVAL_ONLY),
    _share("stop_after_poor_rate", "stopped after a poor row", better=None, **EVAL_ONLY),
    TaskFigure(
        name="stopped_row_credit_mean",
        label="credit of the row stopped on",
        steps=False,
        higher_is_better=None,
    ),
)

TASK = Task(
    name="wordle",
    dataset=game_env.make_dataset,
    server=EnvServer(
        "wordle-env",
        ("-m", "wordle_env.server.app"),
        WORDLE_DIR,
        # loopback, serving this run alone: no key (a WORDLE_API_KEY the user exported for a
        # public Space is not inherited; blank is unset), and the per-client cap (for public
        # Spaces) out of the way of a large --per-device-train-batch-size
        (
            ("WORDLE_HOST", "127.0.0.1"),
            ("WORDLE_API_KEY", ""),
            ("WORDLE_MAX_SESSIONS_PER_CLIENT", "256"),
        ),
    ),
    environment_factory=game_env.WordleToolEnv,
    eval_seeds=lambda count: game_env.eval_seeds(count=count),
    eval_seed_count=game_env.EVAL_SEED_COUNT,
    eval_row=game_env.eval_row,
    eval_figures=_eval_figures,
    eval_reward=_eval_reward,
    check_context=_check_context,
    episode_counts=episode_counts,
    step_figures=step_figures,
    figures=FIGURES,
    turn_rewards=turn_rewards,
    rewards=game_env.EPISODE_REWARDS,
    attach=_attach,
    warm_start=_warm_start,
    local_model=_local_model,
)


def evaluate(
    replica_url: str,
    tokenizer_path: str,
    env_url: str,
    seeds: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    workers: int = 64,
    headers: dict | None = None,
    board: bool = True,
    per_seed: bool = False,
    model_name: str | None = None,
    draw: int = 0,
    env_headers: dict | None = None,
    max_turns: int = game_env.MAX_TURNS,
) -> dict:
    """Play the held-out games ``seeds`` through the replica (:data:`TASK`'s generic
    evaluation, ``trainer.task.tool_eval``), from flat arguments (the benches); returns the
    block: ``episodes``, ``reward_mean``, ``reward_se``, ``turns_mean``, ``tool_error_rate``,
    ``trainer.task.wordle.figures.summarize``'s figures and, with ``per_seed``, each game's reward.

    Args:
        replica_url: the replica's base URL (its ``/v1``).
        tokenizer_path: model folder or hub id whose tokenizer renders the prompts (its chat
            template one TRL's response parser knows).
        env_url: the Wordle server.
        seeds: game seeds (the held-out set: ``trainer.task.wordle.game_env.eval_seeds``).
        max_tokens: completion cap per turn (the GRPO setting).
        temperature: 0 = greedy.
        workers: games played concurrently.
        headers: headers of every request to the replica (the fleet router's run key, or
            ``Authorization`` for a private Space).
        board: tool replies carry the board (``trainer.task.wordle.board``), as in training.
        per_seed: add ``per_seed``: each game's environment reward, in ``seeds`` order (for a
            paired comparison of two evaluations on the same seeds).
        model_name: the model name the requests carry (an adapter run: its adapter name, which
            the replica maps to its newest adapter version). None: the replica's served model
            (``GET /v1/models``).
        draw: the sampling draw (``trainer.task.eval_http.sampling_seed``; ``EvalRequest.draw``).
        env_headers: headers of the environment's WebSocket handshake (a private Wordle Space's
            ``Authorization``; ``EvalRequest.env_headers``).
        max_turns: assistant turns a game may take (TRL's ``max_tool_calling_iterations``).

    Raises:
        trainer.task.eval_http.EvalError: the replica did not answer usably.
        wordle_env.client.WordleRefusedError: the Wordle server refused the connection (e.g. no
            key), after ``RESET_ATTEMPTS`` tries.
    """
    task = TASK
    if not board:
        factory = functools.partial(game_env.WordleToolEnv, board=False)
        task = dataclasses.replace(task, environment_factory=factory)
    request = EvalRequest(
        replica_url,
        tokenizer_path,
        env_url,
        model_name,
        max_tokens,
        draw=draw,
        workers=workers,
        max_turns=max_turns,
        headers=headers,
        env_headers=env_headers,
    )
    return task.run_evaluation(request, seeds, temperature, per_seed)
