"""``trainer.loop.generating_policy``: a sample's tokens scored under the bucket versions that
generated its turns (rebuilt bit for bit from the run's deltas), and the correction that rewrites
what TRL's loss reads: ``decoupled`` puts pi_gen in ``old_log_probs`` and the truncated mismatch
weight in the advantage, ``tis`` the current policy and the same weight, ``off`` nothing; a
sample whose versions are unknown is left as TRL made it."""

from __future__ import annotations

import copy
import queue
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from deltasync.history import VersionHistory
from deltasync.publisher import DeltaPublisher
from deltasync.subscriber import DeltaSubscriber
from trainer.loop.generating_policy import (
    GeneratingPolicy,
    OffPolicyCorrection,
    batch_log_probs,
    current_policy_fn,
    position_versions,
)
from trainer.loop.off_policy import OffPolicyLoss
from trainer.task.char_model import make_char_qwen3

IDS = np.array([5, 17, 3, 99, 42, 8, 64, 21, 7, 30])


def token_log_probs(model, input_ids: np.ndarray) -> np.ndarray:
    """The reference: ``log p(ids[p] | ids[:p])`` from one whole forward (position 0: NaN)."""
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return np.concatenate([[np.nan], lp.numpy()]).astype(np.float32)


def close(a, b):
    """Equal up to float32 summation order (a batched forward, the head on chosen positions)."""
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_each_position_takes_the_version_of_its_turn():
    # turn 1 is ids[:4] (answered by v3), turn 2 ids[:8] (v4); positions 8, 9: a tool reply
    assert position_versions(10, [(4, 3), (8, 4)]).tolist() == [3, 3, 3, 3, 4, 4, 4, 4, -1, -1]
    assert position_versions(3, []).tolist() == [-1, -1, -1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Qwen3 published as v0, v1, v2 (each a step of noise); the bf16 weights of each."""
    tmp = tmp_path_factory.mktemp("gp")
    folder = make_char_qwen3(str(tmp / "model"), vocab_size=128)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pub = DeltaPublisher(str(tmp / "bucket"), run_id="gp")
    history = VersionHistory(DeltaSubscriber(str(tmp / "bucket")), keep=2)  # follows each version
    weights = {}
    g = torch.Generator().manual_seed(0)
    for v in range(3):
        if v:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=g))
        pub.publish(model.named_parameters(), step=v)
        pub.flush()
        history.update()
        weights[v] = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
    pub.close()
    config = AutoConfig.from_pretrained(folder)
    assert history.versions() == [0, 1, 2]
    policy = GeneratingPolicy(lambda: AutoModelForCausalLM.from_config(config), history, models=2)
    return SimpleNamespace(folder=folder, config=config, weights=weights, policy=policy)


def _model_with(run, v):
    model = AutoModelForCausalLM.from_config(run.config, dtype=torch.float32)
    model.load_state_dict(run.weights[v], strict=False)
    return model.eval()


def test_a_versions_model_computes_in_float32_whatever_its_config_says(run):
    """The tiny model's config says bf16 (as SmolLM2's and Qwen3's do) and transformers 5 builds
    in it; the version's model is float32 anyway, so its scores are the same function on a CPU
    with native bf16 (AVX-512 BF16, AMX) and on one that emulates it (AVX2): found on an AVX2
    machine, where the bf16 forward differed from a padded one by 3e-3."""
    assert run.config.dtype == torch.bfloat16
    assert AutoModelForCausalLM.from_config(run.config).dtype == torch.bfloat16  # the trap
    model = run.policy.model_at(1)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # and its weights are the published bf16 bits, upcast exactly
    for n, p in model.named_parameters():
        if n in run.weights[1]:
            assert torch.equal(p.detach(), run.weights[1][n]), n


def test_log_probs_come_from_each_turns_own_version(run):
    versions = position_versions(len(IDS), [(4, 0), (8, 2)])
    got = run.policy.log_probs(IDS, versions)
    want0, want2 = (
        token_log_probs(_model_with(run, 0), IDS),
        token_log_probs(_model_with(run, 2), IDS),
    )
    assert np.isnan(got[0]) and np.isnan(got[8:]).all()
    close(got[1:4], want0[1:4])  # the published bf16 weights (bit for bit: test_history.py)
    close(got[4:8], want2[4:8])
    assert not np.allclose(want0[4:8], want2[4:8])  # the versions differ


class _Queue:
    """TRL's rollout queue: ``get`` blocks, ``get_nowait`` raises ``queue.Empty`` when empty."""

    def __init__(self, samples):
        self.items = list(samples)

    def get(self, timeout=None):
        if not self.items:
            raise queue.Empty
        return self.items.pop(0)

    def get_nowait(self):
        return self.get()

    def qsize(self):
        return len(self.items)


def _sample(adv=1.0):
    mask = np.array([0, 1, 1, 1, 0, 1, 1, 1, 0, 0])
    return SimpleNamespace(
        input_ids=IDS.copy(),
        completion_mask=mask,
        old_log_probs=np.full(10, -2.0, dtype=np.float32),
        advantage=adv,
    )


@pytest.mark.parametrize("mode", ["decoupled", "tis", "off"])
def test_the_correction_rewrites_what_trls_loss_reads(run, mode):
    """``off`` (installed with ``off_policy_stats``) records the statistics and changes
    nothing."""
    current = token_log_probs(_model_with(run, 2), IDS)
    queue = _Queue([_sample()])
    correction = OffPolicyCorrection(
        queue,
        OffPolicyLoss(mode),
        run.policy,
        lambda ids: [(4, 0), (8, 1)],
        lambda seqs, wanted: [current for _ in seqs],
        lambda: 2,
    )
    s = correction.get()
    mask = s.completion_mask.astype(bool)
    gen = run.policy.log_probs(IDS, position_versions(10, [(4, 0), (8, 1)]))
    w = min(float(np.exp(np.mean(gen[mask] + 2.0))), 2.0)
    stats = correction.take_stats()
    assert stats["offpolicy/weight_mean"] == pytest.approx(w)
    assert stats["offpolicy/lag_mean"] == pytest.approx((2 * 3 + 1 * 3) / 6)
    # the drift by lag: tokens 1-3 came from v0 (2 behind v2), tokens 5-7 from v1 (1 behind)
    for lag, tokens in ((2, [1, 2, 3]), (1, [5, 6, 7])):
        x = current[tokens] - gen[tokens]
        assert stats[f"offpolicy/kl_drift_lag{lag}"] == pytest.approx(np.mean(np.exp(x) - 1 - x))
        assert stats[f"offpolicy/tokens_lag{lag}"] == 3
    assert stats["offpolicy/kl_drift_lag2"] > stats["offpolicy/kl_drift_lag1"] > 0
    x = gen[mask] + 2.0
    assert stats["offpolicy/kl_mismatch"] == pytest.approx(np.mean(np.exp(x) - 1 - x))
    if mode == "off":
        assert (s.old_log_probs == -2.0).all() and s.advantage == 1.0
        return
    assert s.advantage == pytest.approx(w)
    want = gen if mode == "decoupled" else current
    close(s.old_log_probs[mask], want[mask])
    assert (s.old_log_probs[~mask] == -2.0).all()  # prompt and tool tokens untouched


def test_a_sample_whose_versions_are_unknown_is_left_as_trl_made_it(run):
    queue = _Queue([_sample(0.5)])
    correction = OffPolicyCorrection(
        queue,
        OffPolicyLoss("decoupled"),
        run.policy,
        lambda ids: [],
        lambda seqs, wanted: None,
        lambda: 2,
    )
    s = correction.get()
    assert s.advantage == 0.5 and (s.old_log_probs == -2.0).all()
    assert correction.take_stats()["offpolicy/uncorrected"] == 1.0


def test_a_batched_forward_scores_each_sequence_as_its_own_forward(run, monkeypatch):
    import trainer.loop.generating_policy as gp

    model = _model_with(run, 1)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 128, n) for n in (10, 3, 17, 8, 17, 2)]
    alone = [token_log_probs(model, s) for s in seqs]
    # forwards of at most 40 tokens (several sequences each, padded to the longest), the head
    # on 7 positions at a time
    monkeypatch.setattr(gp, "FORWARD_TOKENS", 40)
    monkeypatch.setattr(gp, "LOGITS_BUDGET_BYTES", 7 * 4 * 128)
    for batched, want in zip(batch_log_probs(model, seqs), alone, strict=True):
        assert batched.shape == want.shape and np.isnan(batched[0])
        close(batched[1:], want[1:])
    # only the positions asked for are scored; the others are NaN
    wanted = [rng.random(len(s)) < 0.4 for s in seqs]
    for batched, want, w in zip(batch_log_probs(model, seqs, wanted), alone, wanted, strict=True):
        w = w & (np.arange(len(w)) > 0)
        close(batched[w], want[w])
        assert np.isnan(batched[~w]).all()


def test_queued_samples_are_corrected_together_and_handed_out_in_order(run):
    samples = [_sample(float(i + 1)) for i in range(5)]
    inner = _Queue(samples)
    calls = []
    policy = run.policy
    many = policy.log_probs_many

    class Counting:
        def model_at(self, v):
            return policy.model_at(v)

        def log_probs_many(self, items, missing=None):
            calls.append(len(items))
            return many(items, missing)

    current = lambda seqs, wanted: [np.zeros(len(s), dtype=np.float32) for s in seqs]  # noqa: E731
    correction = OffPolicyCorrection(
        inner,
        OffPolicyLoss("decoupled"),
        Counting(),
        lambda ids: [(4, 0), (8, 1)],
        current,
        lambda: 2,
        batch=3,
    )
    got = [correction.get() for _ in range(2)]
    assert calls == [3]  # three taken at once, one batched recomputation
    assert correction.qsize() == 3  # one corrected and waiting, two still in TRL's queue
    got += [correction.get() for _ in range(3)]
    assert calls == [3, 2]
    assert got == samples  # the same objects, in queue order
    one = _sample(1.0)
    OffPolicyCorrection(
        _Queue([one]),
        OffPolicyLoss("decoupled"),
        policy,
        lambda ids: [(4, 0), (8, 1)],
        current,
        lambda: 2,
    ).get()
    # corrected as a sample alone would be (a batched float32 forward: up to summation order)
    assert got[0].advantage == pytest.approx(one.advantage, rel=1e-5)
    np.testing.assert_allclose(got[0].old_log_probs, one.old_log_probs, rtol=0, atol=1e-5)


def test_the_current_policy_is_scored_under_trls_tree_attention(run):
    """The trained model carries TRL's packed tree attention, which a plain forward cannot call
    (found by the first ``tis`` run); the current policy's scores equal a plain model's, and the
    model gets its attention and its training mode back."""
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

    register_tree_attention()
    plain = _model_with(run, 2)
    trained = AutoModelForCausalLM.from_config(copy.deepcopy(run.config), dtype=torch.float32)
    trained.load_state_dict(run.weights[2], strict=False)
    trained.set_attn_implementation(TREE_ATTENTION)
    trained.train()
    with pytest.raises(TypeError, match="tree_kv_index"):
        token_log_probs(trained, IDS)  # what the run met
    got = current_policy_fn(trained)([IDS, IDS[:5]], [np.arange(10) > 0, np.arange(5) > 0])
    close(got[0][1:], token_log_probs(plain, IDS)[1:])
    close(got[1][1:], token_log_probs(plain, IDS[:5])[1:])
    assert trained.config._attn_implementation == TREE_ATTENTION and trained.training


@pytest.mark.parametrize("mode, scored", [("decoupled", 3), ("off", 3), ("tis", 5)])
def test_the_drift_is_scored_on_one_sample_in_drift_every_unless_tis_needs_all(run, mode, scored):
    asked = []

    def current(seqs, wanted):
        asked.extend(seqs)
        return [np.zeros(len(s), dtype=np.float32) for s in seqs]

    correction = OffPolicyCorrection(
        _Queue([_sample() for _ in range(5)]),
        OffPolicyLoss(mode),
        run.policy,
        lambda ids: [(4, 0), (8, 1)],
        current,
        lambda: 2,
        batch=5,
        drift_every=2,
    )
    [correction.get() for _ in range(5)]
    assert len(asked) == scored  # samples 0, 2, 4 (or all five for tis's ratio)
    stats = correction.take_stats()
    # each scored sample: 3 tokens from v0 (2 behind), 3 from v1 (1 behind)
    assert stats["offpolicy/tokens_lag2"] == stats["offpolicy/tokens_lag1"] == 3 * scored


def test_a_version_not_kept_leaves_its_samples_as_made_and_the_batch_goes_on(run):
    """Found by CI: a batch spanning more versions than the history keeps stopped training with
    ``VersionNotKeptError``. Now each version is rebuilt once, oldest first, and the samples of a
    version it cannot rebuild are left as TRL made them while the rest are corrected."""
    samples = [_sample(1.0) for _ in range(3)]
    for k, s in enumerate(samples):
        s.input_ids[9] = 100 + k  # a tool token (unmasked) that tells the samples apart
    turns = {100: [(4, 0), (8, 1)], 101: [(4, 7), (8, 7)], 102: [(8, 2)]}  # v7: never published
    current = lambda seqs, wanted: [np.zeros(len(x), dtype=np.float32) for x in seqs]  # noqa: E731
    correction = OffPolicyCorrection(
        _Queue(samples),
        OffPolicyLoss("decoupled"),
        run.policy,
        lambda ids: turns[ids[9]],
        current,
        lambda: 2,
    )
    got = [correction.get() for _ in range(3)]
    assert correction.take_stats()["offpolicy/uncorrected"] == 1.0
    assert (got[1].old_log_probs == -2.0).all() and got[1].advantage == 1.0  # v7: as made
    assert not (got[0].old_log_probs[1:8][[0, 1, 2, 4, 5, 6]] == -2.0).any()  # v0, v1: corrected
    assert not (got[2].old_log_probs[5:8] == -2.0).any()  # v2: corrected


def test_a_tied_model_is_rebuilt_without_its_unpublished_lm_head(tmp_path):
    """SmolLM2 ties its LM head to the embedding, so no version publishes ``lm_head.weight``;
    the version's model takes the tie (a lost helper once made this a NameError)."""
    folder = make_char_qwen3(str(tmp_path / "model"), vocab_size=128, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pub = DeltaPublisher(str(tmp_path / "bucket"), run_id="tied")
    pub.publish(model.named_parameters(), step=0)
    pub.flush()
    pub.close()
    history = VersionHistory(DeltaSubscriber(str(tmp_path / "bucket")), keep=1)
    history.update()
    config = AutoConfig.from_pretrained(folder)
    policy = GeneratingPolicy(lambda: AutoModelForCausalLM.from_config(config), history)
    got = policy.log_probs(IDS, np.arange(10) * 0)
    bf16 = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
    want = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    want.load_state_dict(bf16, strict=False)
    close(got[1:], token_log_probs(want.eval(), IDS)[1:])
