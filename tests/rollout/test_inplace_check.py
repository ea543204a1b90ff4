"""The in-place apply's check (``rollout.worker_apply.checked_patch``): every touched vLLM
parameter's int16 bit sum must move by what the checkpoint-coordinate patches say
(``rollout.apply_plan.sum_deltas``).

vLLM's own loader is GPU-only, so a real torch module stands in for the served model, with a
fused ``qkv_proj`` (q, k and v rows one after another, as vLLM stores them), a transposed
(non-contiguous) parameter, and the patches a real publisher -> subscriber chain produced. A
faithful scatter passes; a scatter that ignores the layout's strides (the failure of vLLM #57130)
or drops values is caught before anything is served."""

import numpy as np
import pytest
import torch

from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.subscriber import DeltaSubscriber, HeldWeights, merge_patches
from rollout.apply_plan import DEFAULT_PACKED_MODULES, param_name, sum_deltas
from rollout.worker_apply import InPlaceCheckError, bit_sums, checked_patch

P = "model.layers.0."
SHAPES = {
    P + "self_attn.q_proj.weight": (32, 16),
    P + "self_attn.k_proj.weight": (8, 16),
    P + "self_attn.v_proj.weight": (8, 16),
    P + "mlp.down_proj.weight": (16, 24),  # stored transposed below: non-contiguous
    "model.norm.weight": (16,),
}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16).copy()


class Served(torch.nn.Module):
    """The served model's parameters in vLLM's layout."""

    def __init__(self, ckpt: dict[str, np.ndarray], device: str = "cpu"):
        super().__init__()

        def t(name):
            return torch.from_numpy(ckpt[name].view(np.int16).copy()).view(torch.bfloat16)

        qkv = torch.cat([t(P + f"self_attn.{x}_proj.weight") for x in "qkv"])
        down = t(P + "mlp.down_proj.weight").t().contiguous().t()  # same values, strides (1, 16)
        self.params = {
            P + "self_attn.qkv_proj.weight": qkv,
            P + "mlp.down_proj.weight": down,
            "model.norm.weight": t("model.norm.weight"),
        }
        for n, x in self.params.items():  # moved keeping the strides (to() would keep them too)
            y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
            y.copy_(x)
            self.params[n] = torch.nn.Parameter(y, requires_grad=False)
        for i, p in enumerate(self.params.values()):
            self.register_parameter(f"p{i}", p)

    def named_parameters(self, *args, **kwargs):  # vLLM's names
        return iter(self.params.items())


def scatter(model: Served, patches, honour_strides=True, drop=0) -> None:
    """Apply checkpoint-coordinate patches as vLLM's loader does (fused rows offset by the
    shards before); ``honour_strides=False`` writes as if every parameter were contiguous."""
    offsets = {"q": 0, "k": 32, "v": 40}
    for p in patches:
        target = model.params[param_name(p.name, DEFAULT_PACKED_MODULES)].data
        rows, cols = p.shape if len(p.shape) == 2 else (1, p.shape[0])
        r, c = np.divmod(p.indices, cols)
        leaf = p.name.split(".")[-2]
        if leaf in ("q_proj", "k_proj", "v_proj"):
            r = r + offsets[leaf[0]]
        dev = target.device
        vals = torch.from_numpy(p.values.view(np.int16).copy()).view(torch.bfloat16).to(dev)
        n = len(p.indices) - drop
        r, c = torch.from_numpy(r[:n]).to(dev), torch.from_numpy(c[:n]).to(dev)
        if target.dim() == 1:
            target[c] = vals[:n]
        elif honour_strides:
            target[r, c] = vals[:n]
        else:  # flat positions into the storage, strides ignored
            target.as_strided((target.numel(),), (1,))[r * target.shape[1] + c] = vals[:n]


@pytest.fixture
def chain(tmp_path):
    """(held at v0, merged patches v0 -> v2) from a real publisher and subscriber."""
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}
    uri = str(tmp_path / "bucket")
    cfg = PublisherConfig(anchor_every=100, anchor_replay_fraction=1e9)  # v0 anchor, deltas
    with DeltaPublisher(uri, config=cfg) as pub:
        for step in range(3):
            pub.publish(list(w.items()), step=step)
            pub.flush()
            for t in w.values():
                t += 1e-5 * torch.randn(t.shape, generator=g)  # an RL step: a fraction changes
    sub, held = DeltaSubscriber(uri), HeldWeights()
    sub.sync(held, target=0)
    start = {n: a.copy() for n, a in held.tensors.items()}
    steps = [patches for _, patches in sub.sync(held)]
    return start, held, merge_patches(held, steps)


def test_merged_patches_carry_the_bits_they_replace(chain):
    start, held, merged = chain
    assert merged and all(p.old_values is not None for p in merged)
    assert all(len(p.indices) < 0.5 * np.prod(p.shape) for p in merged)  # sparse, as in RL
    for p in merged:
        assert np.array_equal(p.old_values, start[p.name].reshape(-1)[p.indices])
        assert np.array_equal(p.values, held.tensors[p.name].reshape(-1)[p.indices])


def check_faithful(chain, device):
    start, held, merged = chain
    model = Served(start, device)
    sums = sum_deltas(merged, DEFAULT_PACKED_MODULES)
    assert set(sums) == set(model.params)
    checked = checked_patch(model, sums, lambda: scatter(model, merged))
    assert checked == 3
    want = Served(held.tensors, device)  # the served model now holds the new version exactly
    assert all(torch.equal(model.params[n], want.params[n]) for n in model.params)
    assert bit_sums(model, ["nope"]) == {}


def check_caught(chain, device, fault):
    start, _, merged = chain
    model = Served(start, device)
    assert not model.params[P + "mlp.down_proj.weight"].is_contiguous()
    sums = sum_deltas(merged, DEFAULT_PACKED_MODULES)
    bad = {"strides ignored": {"honour_strides": False}, "values dropped": {"drop": 1}}[fault]
    with pytest.raises(InPlaceCheckError, match="bit sums"):
        checked_patch(model, sums, lambda: scatter(model, merged, **bad))


def test_a_faithful_in_place_apply_passes_the_check(chain):
    check_faithful(chain, "cpu")


def test_sums_kept_from_the_last_apply_stand_in_for_before(chain):
    """With the cache of the last apply's sums, the paused window computes one pass; a change
    to the weights outside the applies (nothing should make one) fails the next check."""
    start, held, merged = chain
    model = Served(start)
    cache = bit_sums(model, model.params)
    assert cache == {
        n: int(p.view(torch.int16).to(torch.int64).sum()) for n, p in model.params.items()
    }
    sums = sum_deltas(merged, DEFAULT_PACKED_MODULES)
    assert checked_patch(model, sums, lambda: scatter(model, merged), cache) == 3
    assert cache == bit_sums(model, model.params)  # now the sums after this apply
    model.params["model.norm.weight"].data[0] += 1  # changed behind the applies' back
    with pytest.raises(InPlaceCheckError):
        checked_patch(model, {"model.norm.weight": 0}, lambda: None, cache)
    assert cache == {}  # unknown weights: nothing cached


@pytest.mark.parametrize("fault", ["strides ignored", "values dropped"])
def test_a_wrong_in_place_apply_is_caught(chain, fault):
    check_caught(chain, "cpu", fault)


@pytest.mark.gpu
def test_the_check_on_cuda(chain):
    """The same sums computed on the GPU, where the in-place path runs."""
    check_faithful(chain, "cuda")
    for fault in ("strides ignored", "values dropped"):
        check_caught(chain, "cuda", fault)
