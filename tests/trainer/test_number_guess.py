"""The number-guess example (``examples/number_guess``), a multi-turn tool task with its own
Space, trains through the same trainer, replica and bucket as Wordle with nothing but its Task:
``--task number_guess`` on the local default starts its Space's server, builds its own small model,
plays its games through TRL's tool loop, evaluates before and after with the generic evaluation
of tool tasks (paired), and records its declared figures in the summary and each step's log."""

from __future__ import annotations

import pytest

from .small_task_run import small_task_run


@pytest.mark.slow
def test_number_guess_trains_and_is_evaluated_before_and_after(tmp_path):
    # 2 steps through the bucket, the replica bit-exact, a paired evaluation (small_task_run)
    summary, served, steps = small_task_run(tmp_path, "number_guess", "number-guess")
    # the server played every training game and both evaluations' games, and the model's guesses
    # reached it (several a game)
    games = summary["train_games"]
    assert games >= 2 * 4 and served["games"] >= games + 2 * 16
    assert served["moves"] > served["games"], served
    # the held-out evaluations ran through the replica with the generic evaluation, paired
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["reward_se"] > 0 and 0 < before["turns_mean"] <= 7  # rewards differ by game
    assert before["tool_error_rate"] is not None
    # its own figures, declared by the task, in the summary and each step's log
    names = [f["name"] for f in summary["figures"]]
    assert names[:4] == ["solved_rate", "consistent_rate", "guesses_mean", "out_of_range_rate"]
    for block in (before, after):
        assert 0 <= block["solved_rate"] <= 1 and block["guesses_mean"] > 1
    assert summary["train_figures"]["guesses_mean"] > 1
    assert all(s["games/guesses_mean"] > 1 for s in steps)
    assert all("games/solved_rate" in s and "games/consistent_rate" in s for s in steps)
    # the game's reward is the one TRL trained on (NumberGuessEnv.get_reward)
    assert all(s["rewards/NumberGuessEnv"] == s["reward"] for s in steps)
