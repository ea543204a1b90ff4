"""TRL CPU workarounds (trainer.trl_compat): the CPU stand-in of the tree-attention kernel equals
plain causal attention per packed segment (bottom-right aligned), and apply() patches TRL."""

import pytest
import torch

from trainer import trl_compat


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


@pytest.mark.parametrize("segments", [[(5, 5)], [(3, 7), (4, 4), (1, 6)]])
def test_cpu_varlen_attention_matches_reference(segments):
    torch.manual_seed(0)
    h, hkv, d, scale = 4, 2, 8, 0.3
    qs = [torch.randn(lq, h, d) for lq, _ in segments]
    ks = [torch.randn(lk, hkv, d) for _, lk in segments]
    vs = [torch.randn(lk, hkv, d) for _, lk in segments]
    cu_q = torch.tensor([0] + [sum(s[0] for s in segments[: i + 1]) for i in range(len(segments))])
    cu_k = torch.tensor([0] + [sum(s[1] for s in segments[: i + 1]) for i in range(len(segments))])
    out = trl_compat._CpuFlashAttn.flash_attn_varlen_func(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, cu_k, 0, 0, softmax_scale=scale
    )
    want = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs, strict=True)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


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

    from trainer.trl_compat import TRLCompatError, bound_score_queue

    trainer = SimpleNamespace(rollout_worker=SimpleNamespace(_loop_kwargs={"num_generations": 8}))
    assert bound_score_queue(trainer, groups=1)
    assert trainer.rollout_worker._loop_kwargs == {"num_generations": 8, "score_queue_maxsize": 1}
    assert not bound_score_queue(SimpleNamespace(rollout_worker=None), groups=1)
    with pytest.raises(TRLCompatError, match="score_queue_maxsize"):
        bound_score_queue(SimpleNamespace(rollout_worker=SimpleNamespace()), groups=1)
