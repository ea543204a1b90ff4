"""What the run changes in TRL's GRPO update: advantages centred without TRL's division by the
group's std (``scale_rewards="none"``), and answer rows that GRPO moves only along their spelling
(``tie_answer_rows``), so that a step on a training word reaches the held-out words spelled like it."""

import math

import numpy as np
import pytest

from trainer.config import GRPOConfigError, TrainConfig
from trainer.loop.advantages import CentredAdvantages
from trainer.task.wordle import model as wordle_model
from trainer.task.wordle.spelling_tie import SpellingTiedRows, SpellingTieError, spelling_features
from wordle_env import wordlists

from .queue_fake import SampleQueue


class _Sample:
    def __init__(self, advantage, reward, reward_std):
        self.advantage = advantage
        self.metrics = {"reward": reward, "reward_std": reward_std}


def _trl_group(rewards):
    """A GRPO group's samples as TRL 1.16's async worker scores them: (r - mean) / (std + 1e-8)."""
    r = np.asarray(rewards, dtype=float)
    adv = (r - r.mean()) / (r.std() + 1e-8)
    return [_Sample(float(a), float(x), float(r.std())) for a, x in zip(adv, r, strict=True)]


@pytest.mark.parametrize("rewards", [[0.6, 0.62, 0.58, 0.6], [1.0, 0.6, 0.6, 0.6], [0.5] * 4])
def test_centred_advantages_are_reward_minus_group_mean(rewards):
    q = CentredAdvantages(SampleQueue(_trl_group(rewards)))
    assert q.qsize() == len(rewards)  # the rest of TRL's queue API passes through
    got = [q.get().advantage for _ in rewards]
    want = [r - sum(rewards) / len(rewards) for r in rewards]
    assert all(math.isclose(g, w, abs_tol=1e-9) for g, w in zip(got, want, strict=True))


def test_near_tie_group_weighs_less_than_a_win_once_centred():
    """TRL's std division gives a group that differs by one yellow letter as much weight as a
    group where one game won; centred, the win's group dominates."""
    tie, win = _trl_group([0.62, 0.58, 0.6, 0.6]), _trl_group([1.0, 0.6, 0.6, 0.6])
    assert max(abs(s.advantage) for s in tie) > 1.0  # TRL's: noise scaled up to unit std
    tie_c = [CentredAdvantages(SampleQueue([s])).get().advantage for s in tie]
    win_c = [CentredAdvantages(SampleQueue([s])).get().advantage for s in win]
    assert max(map(abs, win_c)) > 10 * max(map(abs, tie_c))


def test_unscored_group_keeps_advantage_zero():
    s = _Sample(0.0, float("nan"), float("nan"))
    assert CentredAdvantages(SampleQueue([s])).get().advantage == 0.0


def test_scale_rewards_setting_is_checked():
    assert TrainConfig.from_flags(scale_rewards="none").grpo.scale_rewards == "none"
    with pytest.raises(GRPOConfigError, match="expected 'group'"):
        TrainConfig.from_flags(scale_rewards="std")


def test_spelling_features_mark_letters_at_positions_and_distinct_letters():
    s = spelling_features(["crane", "eerie"])
    assert s.shape == (2, 156)
    assert s[0, :130].sum() == 5 and s[0, 130:].sum() == 5
    assert s[1, 130:].sum() == 3  # e, r, i
    assert s[0, 0 * 26 + 2] == 1 and s[0, 130 + ord("n") - 97] == 1


def test_a_step_on_a_training_word_reaches_held_out_words_spelled_like_it(tokenizer):
    import torch

    model = wordle_model.build_model(tokenizer, seed=0, hidden_size=64, layers=1)
    tie = SpellingTiedRows(model, tokenizer)
    tie.on_train_begin(None, None, None)
    head = model.get_output_embeddings().weight
    embed_before = model.get_input_embeddings().weight.detach().clone()
    before = head.detach().clone()
    ids = {w: tokenizer.convert_tokens_to_ids(w) for w in ("crane", "crate", "fuzzy")}
    item = tokenizer.convert_tokens_to_ids(" r2 green,")
    h = torch.randn(64)
    with torch.no_grad():  # a step that raises "crane" after some board (hidden state h)
        head[ids["crane"]] += 0.1 * h
        head[item] += 0.1 * h  # a row that is not an answer: left as the optimizer set it
    tie.on_optimizer_step(None, None, None)
    gain = {w: float((head[i].detach() - before[i]) @ h) for w, i in ids.items()}
    assert gain["crate"] > 0.2 * gain["crane"] > 0  # 4 letters at the same places: raised too
    assert abs(gain["fuzzy"]) < 0.2 * gain["crate"]  # no letter in common: about unchanged
    assert torch.equal(head[item], before[item] + 0.1 * h)
    assert torch.equal(model.get_input_embeddings().weight, embed_before)  # no step there
    # every answer row's change is a function of its spelling: S @ V for one V (156 x 64)
    answers = list(wordlists.answers())
    rows = torch.tensor(tokenizer.convert_tokens_to_ids(answers))
    d = (head[rows] - before[rows]).detach().double()
    s = spelling_features(answers).double()
    v = torch.linalg.pinv(s) @ d
    assert torch.allclose(s @ v, d, atol=1e-6)


def test_tying_needs_answers_as_tokens():
    from trainer.task.char_model import make_char_tokenizer

    tok = make_char_tokenizer(wordle_model.chat_template())
    with pytest.raises(SpellingTieError, match="one token"):
        SpellingTiedRows(None, tok)
