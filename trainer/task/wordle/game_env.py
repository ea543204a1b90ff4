"""The Wordle task of the trainer: prompts, the tool-calling environment, the reward, and the
conversation format shared by the warm start, GRPO and the evaluation.

Style: tool calls, as in TRL's Wordle example. Each rollout plays one game against the Wordle
environment server (OpenEnv WebSocket protocol, ``wordle_env.client``): the model calls
``guess(word)`` and reads the game's reply, for up to ``MAX_TURNS`` calls. The environment keeps
the game state, so the trainer never re-implements the rules.

All completions of one GRPO group come from one dataset row and so share its ``seed``: the server
maps the seed to the target deterministically, so the whole group plays the same word.

Reward (:func:`episode_reward`, the only reward TRL sees): 1 for a win, else the best partial
credit ``(greens + 0.5 yellows) / 5`` of any accepted guess, minus 0.1 per invalid move and minus
0.2 when the model stopped before the game was over (:func:`stopped`; a game the call cap cut
did not stop). The best guess (not the last, which is the
environment's own ``game_reward``) is used so that stopping early never pays: another guess can
only raise the best credit. Text that is not a move earns nothing. ``--reward game`` trains on the
game's own reward instead (:func:`episode_reward`): it raises the held-out game's reward most but
teaches a real model one strong word and a stop, so ``best`` stays the task's default and a hub
model on CPU trains on ``game`` (``trainer.config.HUB_CPU_DEFAULTS``; docs/JOURNAL.md, "The
Wordle reward's settings").

Stopping costs what the two invalid moves in a row that end a game cost (0.2): a larger penalty
did not stop a real model from stopping and slowed its valid share (docs/JOURNAL.md).

This module is imported in TRL's spawned rollout process, so everything here is module-level and
the server address comes from the environment (``DELTASYNC_ENV_URL``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field

from trainer.task.base import ENV_KEY_VAR, ENV_URL_VAR, REWARD_VAR, env_headers
from trainer.task.wordle import board
from trainer.trust import TrustedUrls
from wordle_env import rules, wordlists

log = logging.getLogger("trainer.task.wordle.game_env")

# Held-out evaluation seeds (:func:`eval_seeds`): their targets are kept out of the warm start and
# of GRPO's data. An evaluation plays the first ``eval_episodes`` of them, at most EVAL_SEED_COUNT:
# 512 seeds hold out 484 of the 3,568 answers.
EVAL_SEED_FIRST = 900_000
EVAL_SEED_COUNT = 512

SYSTEM_PROMPT = (
    "You are playing Wordle. Find the secret 5-letter English word in at most 6 guesses. "
    "Call the `guess` tool with one lowercase 5-letter word. After each guess you get feedback "
    "per letter: G = right letter, right place; Y = in the word, elsewhere; X = not in the word. "
    "The reply also lists each letter's mark, what is known so far, and the words tried."
)
USER_PROMPT = "A new game starts. Make your first guess."
RESET_TEXT = "\nGuess the word."
FINAL_TEXT = "Done."  # the assistant's last message once the game is over
GAME_OVER = " Game over."
# 6 guesses + 1 invalid move (a second invalid move in a row ends the game by the rules).
MAX_TURNS = rules.MAX_GUESSES + 1
INVALID_PENALTY = 0.1
STOPPED_EARLY_PENALTY = 0.2
# The episode rewards :func:`episode_reward` knows (``--reward``; ``REWARD_VAR`` hands the choice to
# TRL's spawned rollout process, :func:`reward_kind`), the default first.
EPISODE_REWARDS = ("best", "game")
RESET_ATTEMPTS = 3
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def eval_seeds(first: int = EVAL_SEED_FIRST, count: int = EVAL_SEED_COUNT) -> list[int]:
    """The evaluation seeds ``first .. first + count - 1``."""
    return list(range(first, first + count))


def held_out_targets(first: int = EVAL_SEED_FIRST, count: int = EVAL_SEED_COUNT) -> frozenset:
    """The target words of the evaluation seeds (excluded from training games)."""
    return frozenset(wordlists.target_for_seed(s) for s in eval_seeds(first, count))


def prompt_messages() -> list[dict]:
    """The dataset prompt: system and user messages (TRL appends the reset text to the user's)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT},
    ]


# One in GRPO_SHARE of the answers that are not evaluation words is a GRPO target, the others are
# the warm start's (:func:`grpo_targets`).
GRPO_SHARE = 3
_SPLIT_SALT = b"deltasync-target-split:"


@functools.lru_cache(maxsize=1)
def grpo_targets() -> frozenset:
    """The words GRPO's games are played on: one in ``GRPO_SHARE`` of the answers that are not
    held out (1,021 of 3,084), chosen by ``sha256(salt + word)`` so every process and session
    agrees. The warm start's teacher plays the others (:func:`warm_start_targets`).

    Three disjoint sets of targets, as a train/validation/test split: the warm start learns
    its targets by heart (it wins 0.47 of games on them and 0.31 on words it never saw as a
    target), so GRPO on those words reinforced memorised play that held-out words do not share.
    Measured (docs/BENCHMARKS.md section 6 (the main job), "Training words and held-out words"):
    GRPO's held-out gain +0.025, +0.011 and +0.020 in three runs on words the teacher never played,
    against +0.015 (SD 0.004, eight runs) on the teacher's words."""
    held_out = held_out_targets()
    return frozenset(
        w
        for w in wordlists.answers()
        if w not in held_out
        and int.from_bytes(hashlib.sha256(_SPLIT_SALT + w.encode()).digest()[:8], "big")
        % GRPO_SHARE
        == 0
    )


def warm_start_targets() -> list[str]:
    """The warm start's target words, in the answer list's order: the answers that are neither
    held out (:func:`held_out_targets`) nor GRPO's (:func:`grpo_targets`)."""
    held_out, grpo = held_out_targets(), grpo_targets()
    return [w for w in wordlists.answers() if w not in held_out and w not in grpo]


def make_dataset(n_rows: int, seed: int = 0):
    """``datasets.Dataset`` of ``n_rows`` games: a chat ``prompt`` and the game's ``seed``, only
    seeds whose target is one of GRPO's words (:func:`grpo_targets`): never an evaluation word,
    never one the warm start's teacher played."""
    from datasets import Dataset

    targets = grpo_targets()
    seeds, i = [], 0
    while len(seeds) < n_rows:
        s = seed * 1_000_003 + i
        if wordlists.target_for_seed(s) in targets:
            seeds.append(s)
        i += 1
    return Dataset.from_dict({"prompt": [prompt_messages()] * n_rows, "seed": seeds})


def tool_reply(reply: str, done: bool, guesses=(), marks=()) -> str:
    """The tool message the model reads after a move: the game's own reply, then, while the game
    goes on, the board (``trainer.task.wordle.board.render``: the last guess's cells, the running
    constraints, the words tried) built from the accepted ``guesses`` and their feedback ``marks``;
    marked when the game is over (nothing follows to decide)."""
    if done:
        return reply + GAME_OVER
    shown = board.render(guesses, marks)
    return f"{reply}\n{shown}" if shown else reply


def call_message(word: str) -> dict:
    """The assistant message of one ``guess`` call, as TRL's response parser returns it."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "guess", "arguments": {"word": word}}}
        ],
    }


def parse_call(text: str) -> str | None:
    """The ``word`` argument of the first well-formed ``guess`` call in ``text``, else None.

    Well-formed: ``<tool_call>{"name": "guess", "arguments": {"word": <str>}}</tool_call>``.
    """
    m = _TOOL_CALL.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    args = call.get("arguments") if isinstance(call, dict) else None
    if call.get("name") != "guess" or not isinstance(args, dict):
        return None
    word = args.get("word")
    return word if isinstance(word, str) else None


@dataclass
class EpisodeStats:
    """What one episode did, for the reward and the evaluation.

    Attributes:
        best_credit: best partial credit of an accepted guess (0 when none).
        won: the target was guessed.
        done: the game is over (won, out of guesses, or two invalid moves in a row).
        accepted: accepted guesses.
        invalid: invalid moves (not a word, repeated, ...).
        invalid_reasons: invalid moves by the environment's code (``wordle_env.rules``
            ``INVALID_MOVE_CODES``, e.g. ``repeated_guess``).
        last_invalid: the last move was invalid.
        guesses: the accepted guesses, in order.
        marks: their feedback rows (``G``/``Y``/``X`` strings).
        consistent: accepted guesses from the 2nd on that could still be the secret word given all
            earlier feedback (``trainer.task.wordle.board.is_consistent``); ``checked`` counts those
            guesses.
    """

    best_credit: float = 0.0
    won: bool = False
    done: bool = False
    accepted: int = 0
    invalid: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=dict)
    last_invalid: bool = False
    guesses: list[str] = field(default_factory=list)
    marks: list[str] = field(default_factory=list)
    consistent: int = 0
    checked: int = 0

    def record(self, observation) -> None:
        """Update from a ``WordleObservation`` returned by a step."""
        self.done = bool(observation.done)
        self.won = bool(observation.won)
        if observation.error_code is not None:
            self.invalid += 1
            code = str(observation.error_code)
            self.invalid_reasons[code] = self.invalid_reasons.get(code, 0) + 1
            self.last_invalid = True
            return
        self.last_invalid = False
        self.accepted = len(observation.feedback)
        if observation.feedback:
            if self.guesses:  # the new guess against every earlier feedback row
                self.checked += 1
                self.consistent += board.is_consistent(
                    observation.guesses[-1], self.guesses, self.marks
                )
            self.guesses = list(observation.guesses)
            self.marks = list(observation.feedback)
            self.best_credit = max(self.best_credit, rules.partial_credit(observation.feedback[-1]))

    def reply(self, observation, done: bool) -> str:
        """The tool message for ``observation`` (after :meth:`record`): :func:`tool_reply`."""
        return tool_reply(observation.reply, done, self.guesses, self.marks)


def episode_reward(stats: EpisodeStats, kind: str = "best") -> float:
    """The training reward of one episode, in [-0.9, 1].

    Args:
        stats: the episode's :class:`EpisodeStats`.
        kind: ``best`` (the module docstring: the best credit, minus the invalid moves and the
            stop penalty) or ``game``: what the game itself pays (``rules.game_reward``: 1 for a
            win, else the credit of the *last* accepted guess) minus ``INVALID_PENALTY`` per
            invalid move, so a player that stops while its last row is good keeps that row's
            credit, as the game (and the evaluation) scores it. Stopping costs
            ``STOPPED_EARLY_PENALTY`` only before any accepted guess: without it a real model
            learns to stop before any guess, where every game scores 0 and GRPO has no signal
            left (docs/JOURNAL.md, "The Wordle reward's settings").

    Raises:
        ValueError: ``kind`` is not one of ``EPISODE_REWARDS``.
    """
    if kind not in EPISODE_REWARDS:
        raise ValueError(
            f"episode reward {kind!r}: expected one of {', '.join(EPISODE_REWARDS)}; "
            "set --reward to one of them"
        )
    if kind == "game":
        base = rules.game_reward(stats.won, stats.marks[-1] if stats.marks else None)
        nothing = not stats.marks and stopped(stats)  # stopped before any accepted guess
        return base - INVALID_PENALTY * stats.invalid - (STOPPED_EARLY_PENALTY if nothing else 0.0)
    base = 1.0 if stats.won else stats.best_credit
    penalty = INVALID_PENALTY * stats.invalid + (STOPPED_EARLY_PENALTY if stopped(stats) else 0.0)
    return base - penalty


def reward_kind() -> str:
    """The episode reward this process trains on: ``$DELTASYNC_TASK_REWARD`` (set by the run
    stack from ``--reward``; TRL's spawned rollout process inherits it), ``best`` when unset.

    Raises:
        ValueError: the variable holds something other than one of ``EPISODE_REWARDS``.
    """
    kind = os.environ.get(REWARD_VAR) or EPISODE_REWARDS[0]
    if kind not in EPISODE_REWARDS:
        raise ValueError(
            f"${REWARD_VAR}={kind!r}: expected one of {', '.join(EPISODE_REWARDS)}; "
            "set --reward to one of them"
        )
    return kind


def stopped(stats: EpisodeStats) -> bool:
    """Whether the model ended the episode itself before the game was over: not done and under
    ``MAX_TURNS`` calls. A game that used every call (two or more invalid moves that were not in a
    row) was cut by the call cap (TRL's ``max_tool_calling_iterations``, which refuses the call
    the model wrote next): it did not stop, and does not pay the stop penalty (docs/JOURNAL.md,
    "The Wordle reward's settings")."""
    return not stats.done and stats.accepted + stats.invalid < MAX_TURNS


class WordleToolEnv:
    """One Wordle game per rollout, played on the environment server (``environment_factory``).

    TRL builds it with no arguments, calls ``reset(**row)`` before the rollout, exposes ``guess``
    as a tool, and adds ``get_reward()`` to the rewards when the rollout ends. A reset that fails
    is retried ``RESET_ATTEMPTS`` times on a new connection; after that a training episode is
    dropped (its reward is None, which TRL scores as no signal) and counted in ``dropped``, and
    training goes on.

    The held-out evaluation (``trainer.task.tool_eval``) builds it with the server's URL and
    headers, plays it like TRL, stops once :attr:`done`, scores it by :attr:`game_reward` and
    closes it (a context manager); there a reset that still fails after its attempts raises.

    Args:
        env_url: the Wordle server's URL; None: ``$DELTASYNC_ENV_URL`` (set by the trainer for
            TRL's rollout process), with the headers the run's rule gives it
            (``base.env_headers``).
        env_headers: headers of the WebSocket handshake with ``env_url`` (a key or a private
            Space's ``Authorization``), sent as given; ignored without ``env_url``.
        board: tool replies carry the board (``trainer.task.wordle.board``), as in training; False:
            the game's reply alone (the warm-start ablation of ``bench/bench_warm_start.py``).

    Attributes:
        stats: the game's :class:`EpisodeStats`.
        game_reward: what the game paid for the last move (``rules.game_reward``: 1 for a win,
            else the credit of the last accepted guess); 0 before any.
    """

    dropped = 0  # episodes dropped in this process (reset failures)

    def __init__(
        self, env_url: str | None = None, env_headers: dict | None = None, board: bool = True
    ):
        self._url, self._headers, self._board = env_url, env_headers, board
        self._client = None
        self.stats = EpisodeStats()
        self.game_reward = 0.0
        self._dropped = False

    @property
    def done(self) -> bool:
        """The game is over (won, out of guesses, or two invalid moves in a row)."""
        return self.stats.done

    def _connect(self):
        from wordle_env.client import WordleEnv

        url, headers = self._url, self._headers
        if url is None:
            url = os.environ.get(ENV_URL_VAR)
            if not url:
                raise RuntimeError(
                    f"expected the Wordle server's URL in ${ENV_URL_VAR} (set by the trainer), "
                    "found none"
                )
            # A public Wordle Space needs its key, a private one the HF token (openenv's client
            # sends these headers on the WebSocket handshake): the run's rule, base.env_headers.
            # The trainer set this URL from the user's ENV_URL (or its own local server), so it
            # is the one URL trusted here; the HF token still goes only over https to a
            # *.hf.space host.
            headers = env_headers(
                url, os.environ.get(ENV_KEY_VAR), os.environ.get("HF_TOKEN"), TrustedUrls.of([url])
            )
        self._client = WordleEnv(base_url=url, headers=headers or None).sync()
        self._client.connect()

    def _close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception as e:  # the connection is broken already; a new one replaces it
                log.debug("closing a broken Wordle connection: %r", e)
        self._client = None

    def __enter__(self) -> WordleToolEnv:
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    def reset(self, seed: int, **_row) -> str:
        """Start the game of this row's seed; returns the text appended to the user prompt.

        Raises:
            Exception: (built with ``env_url``, an evaluation) the last reset error, once every
                attempt failed.
        """
        self.stats = EpisodeStats()
        self.game_reward = 0.0
        self._dropped = False
        for attempt in range(RESET_ATTEMPTS):
            try:
                if self._client is None:
                    self._connect()
                self._client.reset(seed=int(seed))
                return RESET_TEXT
            except Exception as e:
                self._close()
                log.warning(
                    "Wordle reset failed (attempt %d/%d): %r", attempt + 1, RESET_ATTEMPTS, e
                )
                if self._url is not None and attempt == RESET_ATTEMPTS - 1:
                    raise  # an evaluation has no episode to drop
                time.sleep(min(2.0**attempt, 8.0))
        WordleToolEnv.dropped += 1
        self._dropped = True
        log.error("Wordle server unreachable: episode dropped (%d so far)", WordleToolEnv.dropped)
        return RESET_TEXT

    def guess(self, word: str) -> str:
        """Guess the secret word.

        Args:
            word: a lowercase 5-letter English word.

        Returns:
            The game's feedback on the guess.
        """
        if self._dropped:
            raise RuntimeError("the Wordle server is unreachable; this episode was dropped")
        result = self._client.step(f"[{str(word).strip().lower()}]")
        self.stats.record(result.observation)
        self.game_reward = float(result.reward or 0.0)
        if self._board:
            return self.stats.reply(result.observation, bool(result.done))
        return tool_reply(result.observation.reply, bool(result.done))

    def get_reward(self) -> float | None:
        """The training reward of this rollout (:func:`episode_reward` of :func:`reward_kind`);
        None when dropped."""
        return None if self._dropped else episode_reward(self.stats, reward_kind())


def eval_row(seed: int) -> dict:
    """The held-out game of ``seed`` as a dataset row (``Task.eval_row``): the prompt and the
    seed ``reset`` takes."""
    return {"prompt": prompt_messages(), "seed": seed}


def solver_conversation(
    game, rng, explore: float = 0.0, with_board: bool = True, **solver
) -> list[dict]:
    """The messages of one game played by ``trainer.task.wordle.solver`` in the format TRL builds
    during rollouts: prompt (reset text appended), then per move a ``guess`` call and the tool's
    reply, and a final short assistant message once the game is over. Exploratory moves (see
    ``solver_guesses``, which also takes ``solver``'s ``top_k`` and ``n_openers``) carry
    ``"train": False``: they shape the history, not the lesson. Each call also carries
    ``"options"``, the words the solver drew it from (the teacher's distribution).
    ``with_board=False`` leaves the board out of the tool replies (an ablation)."""
    from trainer.task.wordle.solver import solver_guesses

    messages = prompt_messages()
    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + RESET_TEXT}
    for word, result, explored, options in solver_guesses(game, rng, explore=explore, **solver):
        messages.append({**call_message(word), "train": not explored, "options": options})
        messages.append(
            {
                "role": "tool",
                "name": "guess",
                "content": tool_reply(
                    result.reply, game.done, *((game.guesses, game.marks) if with_board else ())
                ),
            }
        )
    messages.append({"role": "assistant", "content": FINAL_TEXT})
    return messages


def guess_tool():
    """The ``guess`` tool as TRL passes it to the chat template: a bound method (no connection
    is opened until ``reset``)."""
    return WordleToolEnv().guess
