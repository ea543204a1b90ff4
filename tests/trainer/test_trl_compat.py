"""TRL CPU workarounds (trainer.loop.trl_compat): the CPU stand-in of the tree-attention kernel equals
plain causal attention per packed segment (bottom-right aligned), and apply() patches TRL."""

import pytest
import torch

from trainer.loop import trl_compat


def reference(q, k, v, scale):
    # q: (Lq, H, D), k/v: (Lk, Hkv, D); causal with q aligned to the end of k
    h, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    lq, lk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + lk - lq)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("segments", [[(5, 5)], [(3, 7), (4, 4), (0, 2), (1, 6)]])
def test_cpu_varlen_attention_matches_reference(segments):
    """Outputs and the gradients of q, k and v both match (the step trains through it)."""
    torch.manual_seed(0)
    h, hkv, d, scale = 4, 2, 8, 0.3
    qs = [torch.randn(lq, h, d, requires_grad=True) for lq, _ in segments]
    ks = [torch.randn(lk, hkv, d, requires_grad=True) for _, lk in segments]
    vs = [torch.randn(lk, hkv, d, requires_grad=True) for _, lk in segments]
    cu_q = torch.tensor([0] + [sum(s[0] for s in segments[: i + 1]) for i in range(len(segments))])
    cu_k = torch.tensor([0] + [sum(s[1] for s in segments[: i + 1]) for i in range(len(segments))])
    out = trl_compat._CpuFlashAttn.flash_attn_varlen_func(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, cu_k, 0, 0, softmax_scale=scale
    )
    want = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs, strict=True)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(out)
    leaves = qs + ks + vs
    got = torch.autograd.grad((out * weights).sum(), leaves)
    expected = torch.autograd.grad((want * weights).sum(), leaves)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_apply_patches_trl_on_cpu():
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    patched = trl_compat.apply()
    if torch.cuda.is_available():
        assert patched == []
    else:
        assert async_grpo_trainer.get_peak_flops_per_device(None, "float32") is None
        assert packing._flash_attn() is trl_compat._CpuFlashAttn


def test_sliding_window_refused():
    z = torch.zeros(2, 1, 4)
    cu = torch.tensor([0, 2])
    with pytest.raises(trl_compat.TRLCompatError, match="sliding"):
        trl_compat._CpuFlashAttn.flash_attn_varlen_func(z, z, z, cu, cu, 2, 2, window_size=(4, 0))


def test_bound_score_queue_reaches_the_rollout_loop_arguments():
    """The setting lands where TRL's worker builds its rollout loop from (checked against the
    loop's real signature), and a TRL that changed shape is refused loudly."""
    from types import SimpleNamespace

    import pytest

    from trainer.loop.trl_compat import TRLCompatError, bound_score_queue

    trainer = SimpleNamespace(rollout_worker=SimpleNamespace(_loop_kwargs={"num_generations": 8}))
    assert bound_score_queue(trainer, groups=1)
    assert trainer.rollout_worker._loop_kwargs == {"num_generations": 8, "score_queue_maxsize": 1}
    assert not bound_score_queue(SimpleNamespace(rollout_worker=None), groups=1)
    with pytest.raises(TRLCompatError, match="score_queue_maxsize"):
        bound_score_queue(SimpleNamespace(rollout_worker=SimpleNamespace()), groups=1)


def test_compact_lm_head_scores_trained_positions_as_the_full_head():
    """After apply(), TRL's fused LM head on CPU scores only positions whose label is trained, and
    their log-probabilities equal log_softmax of the model's own logits there (gradients too)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    if torch.cuda.is_available():
        pytest.skip("the patch applies on CPU only")
    trl_compat.apply()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config)  # float32 parameters
    params = dict(model.named_parameters())
    ids = torch.randint(0, 97, (1, 12))
    labels = torch.full((1, 12), -100)
    labels[0, 5:9] = ids[0, 6:10]  # four trained positions, pre-shifted
    want = model(input_ids=ids).logits.log_softmax(-1)[0, 5:9].gather(1, ids[0, 6:10, None])[:, 0]
    # the reference gradients: of the same sum of log-probabilities through the full head
    want_grads = dict(
        zip(params, torch.autograd.grad(want.sum(), list(params.values())), strict=True)
    )
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    out = model(input_ids=ids, shift_labels=labels, fused_lm_head=True)
    torch.testing.assert_close(out.log_probs[0, 5:9], want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out.log_probs[0, :5]) == 0  # untrained: not scored
    patched = dict(model.named_parameters())  # the same parameter objects after the patch
    assert patched.keys() == params.keys() and all(patched[n] is p for n, p in params.items())
    got_grads = torch.autograd.grad(out.log_probs.sum(), list(params.values()))
    # float32 throughout: the compact head does the same matmul and log-softmax on 4 rows
    # instead of 12, so only summation order differs (measured: at most 5e-7, on gradients up to
    # 3); scoring one position more or less moves every parameter's gradient by 3e-3 or more
    for (name, want_grad), got in zip(want_grads.items(), got_grads, strict=True):
        assert want_grad.abs().max() > 0, name  # every parameter takes part in the score
        torch.testing.assert_close(
            got, want_grad, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
