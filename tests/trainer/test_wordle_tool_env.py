"""The Wordle tool environment TRL plays training episodes in, against the real Wordle server:
the reward chosen with ``--reward`` (handed over in ``$DELTASYNC_TASK_REWARD``) is what the
episode is paid, and ``game`` pays what the game pays when the model stops on a good row."""

from __future__ import annotations

import pytest

from trainer.task.base import ENV_URL_VAR, REWARD_VAR
from trainer.task.wordle.game_env import (
    INVALID_PENALTY,
    STOPPED_EARLY_PENALTY,
    WordleToolEnv,
    make_dataset,
)
from wordle_env import rules, wordlists
from wordle_env.game import WordleGame


def _episode(seed: int, moves: list[str]) -> WordleToolEnv:
    """A training episode that makes ``moves`` then stops (writes no further call)."""
    env = WordleToolEnv()
    env.reset(seed=seed)
    for word in moves:
        env.guess(word)
    return env


@pytest.mark.parametrize("kind", ["game", "best", ""])
def test_the_chosen_reward_is_what_a_stopped_episode_is_paid(monkeypatch, wordle_url, kind):
    monkeypatch.setenv(ENV_URL_VAR, wordle_url)
    monkeypatch.setenv(REWARD_VAR, kind)
    seed = make_dataset(1, seed=5)["seed"][0]
    target = wordlists.target_for_seed(seed)
    # a good row (the target with its last letter changed, when that is a word), then a worse one
    near = next(
        w for w in sorted(wordlists.allowed_guesses()) if w[:4] == target[:4] and w != target
    )
    far = next(w for w in sorted(wordlists.allowed_guesses()) if not set(w) & set(target))
    game = WordleGame(target)
    for word in (near, far):
        game.play(f"[{word}]")
    worse = _episode(seed, [near, far, "zzzzz"]).get_reward()
    kept = _episode(seed, [near]).get_reward()
    near_credit = rules.partial_credit(rules.feedback(near, target))
    if kind == "game":  # the game's reward, which the last row sets, less the invalid move
        assert worse == pytest.approx(game.reward - INVALID_PENALTY)
        assert kept == pytest.approx(near_credit)  # stopping on the good row keeps it
        assert kept > worse
    else:  # "best" (also when unset): the best row, less the stop penalty; stopping never pays
        assert worse == pytest.approx(near_credit - INVALID_PENALTY - STOPPED_EARLY_PENALTY)
        assert kept == pytest.approx(near_credit - STOPPED_EARLY_PENALTY)
