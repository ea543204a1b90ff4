"""Turn-level credit (``--turn-credit``): inside one game, the tokens of a move that lost reward
are pushed down against the moves of the same game that earned it, through TRL's own packer.

The episodes are played on the real Wordle game (``wordle_env.game``) and their replies rendered
as the trainer's tool replies; the samples go through ``TurnCredit`` and TRL 1.16's
``TreeRow.pack`` with the per-token patch, as the trainer's data loader packs them."""

import math

import numpy as np
import pytest

from trainer.config import GRPOConfigError, TrainConfig
from trainer.loop import trl_compat
from trainer.loop.advantages import TurnCredit, turn_spans
from trainer.task.base import Task
from trainer.task.wordle import credit, game_env
from trainer.task.wordle import task as wordle
from wordle_env.game import WordleGame

from .queue_fake import SampleQueue

TARGET = "crane"


def _episode(moves):
    """The completion of a game on TARGET (assistant call, tool reply per move) and, per move,
    what the game's own rows make it worth: its expected credit given the board before it
    (``credit.expected_credits``), or None for an invalid move."""
    game, completion, accepted = WordleGame(TARGET), [], []
    for word in moves:
        result = game.play(f"[{word}]")
        completion.append(game_env.call_message(word))
        reply = game_env.tool_reply(result.reply, game.done, game.guesses, game.marks)
        completion.append({"role": "tool", "name": "guess", "content": reply})
        accepted.append(not result.invalid)
    worth = iter(credit.expected_credits(game.guesses, game.marks))
    return completion, [next(worth) if ok else None for ok in accepted]


class _Sample:
    """A ``RolloutSample`` as TRL's queue hands it to the trainer: a prompt of 4 untrained tokens,
    then per move 3 trained tokens (the call) and 2 untrained ones (the tool reply)."""

    def __init__(self, completion, advantage, turns, group_id=0):
        self.completion = completion
        self.advantage = advantage
        self.group_id = group_id
        mask = [0] * 4
        for _ in range(turns):
            mask += [1, 1, 1, 0, 0]
        self.completion_mask = np.array(mask, dtype=np.int64)
        self.input_ids = np.arange(100, 100 + len(mask)) + 1000 * group_id
        self.old_log_probs = np.full(len(mask), -1.0, dtype=np.float32)
        self.metrics = {}


def _pack(samples):
    """TRL's packer over ``samples`` (the dicts its ``RolloutQueueDataset`` yields)."""
    from trl.experimental.async_grpo.packing import TreeRow

    trl_compat.per_token_advantages()
    row = TreeRow()
    for s in samples:
        row.add(
            {
                "input_ids": s.input_ids,
                "completion_mask": s.completion_mask,
                "old_log_probs": s.old_log_probs,
                "advantage": s.advantage,
                "group_id": s.group_id,
            }
        )
    return row.pack()


def test_the_game_replies_give_each_move_its_own_reward():
    completion, worth = _episode(["slate", "crate", "cranes", "brine"])
    got = wordle.turn_rewards(completion)
    want = [-game_env.INVALID_PENALTY if v is None else v for v in worth]
    assert got == pytest.approx(want)
    assert got[2] == -game_env.INVALID_PENALTY  # 'cranes': the wrong length
    # a call the game never answered (the call cap refused it) and a closing text have none
    refused = completion + [game_env.call_message("trace")]
    assert wordle.turn_rewards(refused)[-1] is None
    assert wordle.turn_rewards([{"role": "assistant", "content": "Done."}]) == [None]


def test_a_wrong_move_inside_a_good_game_is_pushed_down_and_the_game_keeps_its_push():
    completion, worth = _episode(["slate", "crate", "cranes", "brine"])
    sample = _Sample(completion, 0.3, turns=4)
    q = TurnCredit(SampleQueue([sample]), wordle.turn_rewards, weight=1.0, metrics=None)
    assert q.qsize() == 1  # the rest of TRL's queue API passes through
    out = _pack([q.get()])

    adv = out["advantages"].numpy()
    per_turn = adv.reshape(4, 3)  # the trained tokens, call by call
    assert (per_turn == per_turn[:, :1]).all()  # one value a call
    wrong = per_turn[2, 0]
    assert wrong < 0 < 0.3 < per_turn[1, 0]  # 'cranes' pushed down, 'crate' (it fits) up
    assert wrong == min(per_turn[:, 0])
    # the terms spread the game's advantage over its moves without changing its sum
    assert math.isclose(float(per_turn[:, 0].mean()), 0.3, abs_tol=1e-6)
    rewards = [-game_env.INVALID_PENALTY if v is None else v for v in worth]
    want = [0.3 + r - sum(rewards) / 4 for r in rewards]
    assert per_turn[:, 0] == pytest.approx(want, abs=1e-6)
    assert q.spread == 1 and q.unmatched == 0


def test_samples_without_turn_terms_pack_exactly_as_trl_packs_them():
    one_move, _ = _episode(["slate"])
    two, (slate, crate) = _episode(["slate", "crate"])
    plain = [_Sample(one_move, -0.2, turns=1), _Sample(two, 0.25, turns=2, group_id=1)]
    reference = _pack(plain)  # floats: TRL's own path
    metrics = {
        "turn_credit/spread": [],
        "turn_credit/unmatched": [],
        "turn_credit/term_abs_mean": [],
    }
    q = TurnCredit(SampleQueue(plain), wordle.turn_rewards, weight=1.0, metrics=metrics)
    mixed = [q.get(), q.get()]
    assert isinstance(mixed[0].advantage, float)  # a one-move game has nothing to spread
    assert isinstance(mixed[1].advantage, np.ndarray)
    out = _pack(mixed)
    for key in reference:
        if key != "advantages":
            assert np.array_equal(reference[key].numpy(), out[key].numpy()), key
    adv = out["advantages"].numpy()
    assert adv[:3] == pytest.approx([-0.2] * 3)  # the first sample's tokens
    assert adv[3:6] == pytest.approx([0.25 + (slate - crate) / 2] * 3)  # slate, opened cold
    assert adv[6:9] == pytest.approx([0.25 + (crate - slate) / 2] * 3)  # crate, after a and e green
    assert metrics["turn_credit/spread"] == [0.0, 1.0]
    assert metrics["turn_credit/unmatched"] == [0.0, 0.0]
    assert metrics["turn_credit/term_abs_mean"] == pytest.approx([(crate - slate) / 2])


def test_an_episode_whose_turns_do_not_match_its_trained_runs_keeps_its_advantage():
    completion, _ = _episode(["slate", "crate", "brine"])
    sample = _Sample(completion, 0.1, turns=2)  # 3 calls, 2 trained runs
    q = TurnCredit(SampleQueue([sample]), wordle.turn_rewards, weight=1.0)
    assert q.get().advantage == 0.1 and q.unmatched == 1


def test_trained_runs_are_found_in_the_mask():
    assert turn_spans([0, 1, 1, 0, 1]) == [(1, 3), (4, 5)]
    assert turn_spans([1, 0, 0]) == [(0, 1)]
    assert turn_spans([0, 0]) == []


def test_the_setting_is_checked_against_the_task():
    assert TrainConfig.from_flags(turn_credit=1.0).grpo.turn_credit == 1.0
    with pytest.raises(GRPOConfigError, match="a weight of 0"):
        TrainConfig.from_flags(turn_credit=-0.5)
    assert Task.__dataclass_fields__["turn_rewards"].default is None
    assert wordle.TASK.turn_rewards is wordle.turn_rewards
