"""``trainer.loop.off_policy``: the three modes' arithmetic on hand-made log-probabilities: TRL's
objective as it is (``off``), the truncated mismatch weight (``tis``), the ratio against the
generating policy (``decoupled``); truncation at the cap, PPO's clip, masked tokens, a stale
sample weighed as stated, and a sample whose turns came from two versions."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loop.off_policy import MODES, TIS_CAP, OffPolicyLoss, OffPolicyModeError, kl_by_lag


def _t(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def _loss_and_grad(mode, lp, gen, samp, adv, mask=None):
    lp = lp.clone().requires_grad_(True)
    loss, stats = OffPolicyLoss(mode).per_token(lp, gen, samp, adv, mask)
    loss.sum().backward()
    return loss.detach(), lp.grad, stats


def test_on_policy_tokens_get_the_same_update_in_every_mode():
    """Fresh samples (pi_theta = pi_gen) with no mismatch (pi_gen = pi_vLLM): one update."""
    lp = torch.log(_t(0.5, 0.2, 0.9))
    adv = _t(1.0, -0.5, 0.25)
    results = [_loss_and_grad(m, lp, lp.clone(), lp.clone(), adv) for m in MODES]
    for loss, grad, _ in results:
        assert torch.allclose(loss, -adv) and torch.allclose(grad, -adv)


def test_off_is_trls_objective_with_drift_and_mismatch_in_one_ratio():
    lp, samp = torch.log(_t(0.6, 0.45)), torch.log(_t(0.4, 0.5))
    adv = _t(1.0, -1.0)
    loss, grad, stats = _loss_and_grad("off", lp, None, samp, adv)
    r = [0.6 / 0.4, 0.45 / 0.5]  # 1.5 (clipped at 1.2 for A > 0), 0.9 (inside the range)
    assert loss.tolist() == pytest.approx([-1.2, r[1]], rel=1e-6)
    assert grad.tolist() == pytest.approx([0.0, r[1]], rel=1e-6)  # the clipped token: no gradient
    assert stats["clipped"] == pytest.approx(0.5) and math.isnan(stats["kl"])


def test_a_stale_sample_is_clipped_against_its_generating_policy():
    """Two versions of drift moved the token's probability 0.4 -> 0.6 and the replica sampled it
    at 0.38: ``decoupled`` clips the drift 1.5 at 1.2 and weighs by the mismatch 0.4 / 0.38;
    ``tis`` ignores the drift (the gradient of log pi_theta, weighed); ``off`` clips 0.6 / 0.38."""
    lp, gen, samp, adv = torch.log(_t(0.6)), torch.log(_t(0.4)), torch.log(_t(0.38)), _t(1.0)
    w = 0.4 / 0.38
    loss, grad, stats = _loss_and_grad("decoupled", lp, gen, samp, adv)
    assert loss.item() == pytest.approx(-1.2 * w, rel=1e-6) and grad.item() == 0.0
    assert stats["drift_mean"] == pytest.approx(1.5) and stats["mismatch_mean"] == pytest.approx(w)
    assert stats["kl"] == pytest.approx(1.5 - 1 - math.log(1.5), rel=1e-5)
    loss, grad, _ = _loss_and_grad("tis", lp, gen, samp, adv)
    assert loss.item() == pytest.approx(-w, rel=1e-6) and grad.item() == pytest.approx(-w)
    loss, grad, _ = _loss_and_grad("off", lp, gen, samp, adv)
    assert loss.item() == pytest.approx(-1.2, rel=1e-6) and grad.item() == 0.0
    # a negative advantage: off's ratio 0.6 / 0.38 = 1.58 is unbounded on that side
    loss, _, _ = _loss_and_grad("off", lp, gen, samp, -adv)
    assert loss.item() == pytest.approx(0.6 / 0.38, rel=1e-6)
    loss, _, _ = _loss_and_grad("decoupled", lp, gen, samp, -adv)
    assert loss.item() == pytest.approx(1.5 * w, rel=1e-6)


def test_the_mismatch_weight_is_truncated_at_the_cap():
    gen, samp = torch.log(_t(0.5, 0.5, 0.5, 0.5)), torch.log(_t(0.05, 0.2, 0.5, 0.9))
    adv = torch.ones(4)
    loss, grad, stats = _loss_and_grad("tis", gen.clone(), gen, samp, adv)
    want = [min(0.5 / s, TIS_CAP) for s in (0.05, 0.2, 0.5, 0.9)]  # 2 (from 10), 2 (2.5), 1, 0.56
    assert grad.tolist() == pytest.approx([-x for x in want], rel=1e-6)
    assert stats["truncated"] == pytest.approx(0.5)
    assert stats["mismatch_max"] == pytest.approx(10.0, rel=1e-5)


def test_masked_tokens_add_nothing_and_are_not_counted():
    lp, gen = torch.log(_t(0.5, 0.9)), torch.log(_t(0.5, 0.1))  # the second: a tool token
    samp, adv, mask = gen.clone(), torch.ones(2), torch.tensor([True, False])
    for mode in MODES:
        loss, grad, stats = _loss_and_grad(mode, lp, gen, samp, adv, mask)
        assert loss[1] == 0 and grad[1] == 0
        assert stats["drift_max"] == pytest.approx(1.0)  # the masked token's drift 9 left out


def test_a_sample_whose_turns_came_from_two_versions_is_weighed_turn_by_turn():
    """Turn 1 (2 tokens) came from v3, turn 2 (2 tokens) from v4; the trainer is at v5. Each
    turn's tokens carry their own generating log-probabilities, and the KL is kept per lag."""
    lp = torch.log(_t(0.5, 0.5, 0.5, 0.5))
    gen = torch.log(_t(0.25, 0.25, 0.45, 0.45))  # v3 saw 0.25, v4 already 0.45
    samp = gen.clone()
    loss, grad, _ = _loss_and_grad("decoupled", lp, gen, samp, torch.ones(4))
    assert loss.tolist() == pytest.approx([-1.2, -1.2, -0.5 / 0.45, -0.5 / 0.45], rel=1e-6)
    assert grad.tolist() == pytest.approx([0.0, 0.0, -0.5 / 0.45, -0.5 / 0.45], rel=1e-6)
    by_lag = kl_by_lag(lp, gen, torch.tensor([2, 2, 1, 1]))
    assert list(by_lag) == [1, 2]
    assert by_lag[2] == pytest.approx(2 - 1 - math.log(2), rel=1e-5)
    assert by_lag[1] > 0 and by_lag[1] < by_lag[2]


def test_modes_and_caps_are_checked():
    with pytest.raises(OffPolicyModeError, match="expected one of off, tis, decoupled"):
        OffPolicyLoss("ppo")
    with pytest.raises(OffPolicyModeError, match="above 1"):
        OffPolicyLoss("tis", cap=1.0)
    with pytest.raises(OffPolicyModeError, match="gen_log_probs"):
        OffPolicyLoss("decoupled").per_token(_t(0.0), None, _t(0.0), _t(1.0))
