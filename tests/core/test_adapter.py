"""Adapter runs (``deltasync.adapter``, ``Manifest.adapter``): the manifest records the adapter and
a full-weight manifest's JSON has no trace of it; a publisher refuses to resume a run with another
adapter (or of the other kind) and refuses non-PEFT tensor names; the base digest is the same from
torch tensors, numpy arrays and a checkpoint folder (fp32 or bf16, tied embeddings stored or not)
and ``check_base`` refuses another base, saying how to fix it; ``write_peft_folder`` writes a
folder that safetensors loads bit for bit, atomically."""

import enum
import json
import os

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from deltasync import adapter as ad
from deltasync.bf16 import to_bf16_bits
from deltasync.errors import AdapterMismatchError, ModelMismatchError, WrongBaseModelError
from deltasync.manifest import MANIFEST_PATH, AdapterInfo, Manifest
from deltasync.publisher import DeltaPublisher
from deltasync.sharded import ShardedPublisher
from deltasync.store import Store

LORA_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def lora_info(r=8, base_digest="0123456789abcdef", **cfg) -> AdapterInfo:
    peft = {"r": r, "lora_alpha": 16, "target_modules": {"v_proj", "q_proj"}, "peft_type": "LORA"}
    return AdapterInfo(
        kind="lora", peft_config={**peft, **cfg}, base_model="tiny", base_digest=base_digest
    )


def lora_tensors(r=8, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((r, 16)).astype(np.float32)
    b = rng.standard_normal((16, r)).astype(np.float32)
    return {
        LORA_KEY.format("A"): ad.float_to_bf16_bits(a),
        LORA_KEY.format("B"): ad.float_to_bf16_bits(b),
    }


def base_model(tied=True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(32, 16, generator=g)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.norm.weight": torch.ones(16),
        "lm_head.weight": embed if tied else torch.randn(32, 16, generator=g),
    }


# ------------------------------------------------------------------------------------- manifest
def test_adapter_info_normalizes_and_validates_the_peft_config():
    info = lora_info()
    assert info.peft_config["target_modules"] == ["q_proj", "v_proj"]  # a set, as JSON keeps it
    lora = enum.Enum("PeftType", {"LORA": "LORA"}, type=str)  # PEFT's config enums are str
    assert lora_info(peft_type=lora.LORA).peft_config["peft_type"] == "LORA"
    with pytest.raises(ValidationError, match="adapter_config.json"):
        lora_info(runtime=object())
    for bad in ({"r": 0}, {"r": "8"}, {"lora_alpha": None}, {"target_modules": []}):
        with pytest.raises(ValidationError):
            lora_info(**bad)
    with pytest.raises(ValidationError):  # strict like the other manifest models
        AdapterInfo(kind="ia3", peft_config=info.peft_config, base_model="x", base_digest="y")


def test_manifest_json_has_adapter_only_in_an_adapter_run(tmp_path):
    full, lora = Store(str(tmp_path / "full")), Store(str(tmp_path / "lora"))
    with DeltaPublisher(full) as pub:
        pub.publish([("w", np.ones(4, np.uint16))], step=0)
    assert "adapter" not in json.loads(full.read_bytes(MANIFEST_PATH))
    assert Manifest.from_json(full.read_bytes(MANIFEST_PATH)).adapter is None
    info = lora_info()
    with DeltaPublisher(lora, adapter=info) as pub:
        pub.publish(lora_tensors().items(), step=0)
        pub.flush()
        pub.publish(lora_tensors(seed=1).items(), step=1)
    m = Manifest.from_json(lora.read_bytes(MANIFEST_PATH))
    assert len(m.versions) == 2 and m.adapter == info
    assert json.loads(lora.read_bytes(MANIFEST_PATH))["adapter"]["kind"] == "lora"


# ------------------------------------------------------------------------------------ publisher
def _run(root, info) -> None:
    with DeltaPublisher(root, adapter=info) as pub:
        pub.publish(lora_tensors().items(), step=0)


@pytest.mark.parametrize(
    "first, again",
    [
        (lora_info(), lora_info(r=4)),
        (lora_info(), lora_info(base_digest="fedcba9876543210")),
        (lora_info(), lora_info(lora_alpha=32)),
        (lora_info(), None),
        (None, lora_info()),
    ],
    ids=["rank", "base", "alpha", "adapter-run-resumed-full", "full-run-resumed-adapter"],
)
def test_resume_with_another_adapter_is_refused(tmp_path, first, again):
    root = str(tmp_path / "run")
    if first is None:
        with DeltaPublisher(root) as pub:
            pub.publish([("w", np.ones(4, np.uint16))], step=0)
    else:
        _run(root, first)
    with pytest.raises(AdapterMismatchError) as e:
        DeltaPublisher(root, adapter=again)
    assert "expected" in str(e.value) and "new run root" in str(e.value)
    assert Manifest.from_json(Store(root).read_bytes(MANIFEST_PATH)).adapter == first


def test_resume_with_the_same_adapter_continues(tmp_path):
    root = str(tmp_path / "run")
    _run(root, lora_info(base_model_name_or_path="/cache/a/tiny"))
    same = lora_info(base_model_name_or_path="/other/path/tiny")  # a path is not the base
    with DeltaPublisher(root, adapter=same) as pub:
        assert pub.publish(lora_tensors(seed=2).items(), step=1) == 1
    assert Manifest.from_json(Store(root).read_bytes(MANIFEST_PATH)).adapter == same


def test_adapter_run_refuses_full_model_names(tmp_path):
    with DeltaPublisher(str(tmp_path / "run"), adapter=lora_info()) as pub:
        with pytest.raises(ModelMismatchError, match="get_peft_model_state_dict"):
            pub.publish([("model.layers.0.self_attn.q_proj.weight", np.ones(4, np.uint16))])


def test_sharded_publisher_refuses_an_adapter(tmp_path):
    with pytest.raises(ValueError, match="DeltaPublisher"):
        ShardedPublisher(str(tmp_path / "run"), adapter=lora_info())


def test_a_reader_of_the_other_kind_is_refused(tmp_path):
    root = str(tmp_path / "run")
    _run(root, lora_info())
    m = Manifest.from_json(Store(root).read_bytes(MANIFEST_PATH))
    assert ad.run_adapter(m, "lora", root) == lora_info()
    with pytest.raises(AdapterMismatchError, match="ADAPTER=lora"):
        ad.run_adapter(m, None, root)


# ---------------------------------------------------------------------------------- base digest
def test_numpy_rounding_matches_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g) * 10.0 ** torch.randint(-30, 30, (4096,), generator=g)
    edge = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.4e38, float("inf"), -float("inf")])
    x = torch.cat([x, edge, torch.tensor([1.00390625, 1.01171875, -1.00390625])])  # ties
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ad.float_to_bf16_bits(x.numpy()), want)
    half = x[:100].to(torch.float16)
    want16 = half.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ad.float_to_bf16_bits(half.numpy()), want16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_digest_is_the_same_from_tensors_arrays_and_the_checkpoint(tmp_path, dtype):
    model = {n: t.to(dtype) for n, t in base_model().items()}
    from_torch = ad.base_digest_of(model)
    arrays = {n: to_bf16_bits(t) for n, t in model.items()}
    if dtype == torch.float32:
        arrays = {n: t.numpy() for n, t in model.items()}
    assert ad.base_digest_of(list(arrays.items())) == from_torch
    stored = {n: t for n, t in model.items() if n != "lm_head.weight"}  # tied: not stored
    save_file({n: t.contiguous() for n, t in stored.items()}, str(tmp_path / "model.safetensors"))
    assert ad.base_digest_of_folder(str(tmp_path)) == from_torch
    # a trainer that loaded the fp32 checkpoint as bf16 computes the same digest
    assert ad.base_digest_of({n: t.float().to(torch.bfloat16) for n, t in model.items()}) == (
        from_torch
    )


def test_base_digest_from_a_peft_model_and_a_sharded_checkpoint(tmp_path):
    model = base_model(tied=False)
    names = list(model)
    save_file({n: model[n] for n in names[:2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: model[n] for n in names[2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    peft_named = [
        ("base_model.model.model.embed_tokens.weight", model["model.embed_tokens.weight"]),
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", model[names[1]]),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", torch.ones(8)),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight", torch.ones(8)),
        ("base_model.model.model.norm.weight", model["model.norm.weight"]),
        ("base_model.model.lm_head.original_module.weight", model["lm_head.weight"]),
        ("base_model.model.lm_head.modules_to_save.default.weight", torch.zeros(32, 16)),
    ]
    want = ad.base_digest_of_folder(str(tmp_path))
    assert ad.base_digest_of(ad.base_named_tensors(peft_named)) == want
    assert ad.base_digest_of(model) == want


def test_base_digest_changes_with_one_element_and_ignores_integer_buffers():
    model = base_model()
    want = ad.base_digest_of(model)
    assert ad.base_digest_of({**model, "position_ids": torch.arange(8)}) == want
    bumped = dict(model)
    bumped["model.norm.weight"] = model["model.norm.weight"].clone()
    bumped["model.norm.weight"][3] = 1.5
    assert ad.base_digest_of(bumped) != want


def test_base_digest_of_a_damaged_or_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="MODEL"):
        ad.base_digest_of_folder(str(tmp_path))
    save_file(base_model(tied=False), str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelMismatchError, match="download it again"):
        ad.base_digest_of_folder(str(tmp_path))


def test_check_base_refuses_another_base_and_says_how_to_fix():
    right = ad.base_digest_of(base_model())
    wrong = ad.base_digest_of(base_model(tied=False))
    info = lora_info(base_digest=right)
    ad.check_base(info, right)
    with pytest.raises(WrongBaseModelError) as e:
        ad.check_base(info, wrong, served="/models/other")
    msg = str(e.value)
    assert right in msg and wrong in msg and "/models/other" in msg
    assert "start the replica with the base model the adapter was trained on" in msg


# ---------------------------------------------------------------------------------- PEFT folder
def test_peft_folder_round_trips_bit_exact(tmp_path):
    tensors, info = lora_tensors(), lora_info()
    dst = ad.write_peft_folder(tensors, info, str(tmp_path / "policy-v3"))
    assert sorted(os.listdir(dst)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert os.listdir(tmp_path) == ["policy-v3"]  # no temporary folder left
    assert json.loads((tmp_path / "policy-v3" / "adapter_config.json").read_text()) == (
        info.peft_config
    )
    # numpy's safetensors reader needs ml_dtypes for BF16; torch's (what vLLM and PEFT use) and
    # deltasync's own reader load it, both bit for bit
    loaded = load_file(os.path.join(dst, "adapter_model.safetensors"))
    assert set(loaded) == set(tensors)
    for n, bits in tensors.items():
        assert loaded[n].dtype == torch.bfloat16
        assert np.array_equal(loaded[n].view(torch.int16).numpy().view(np.uint16), bits)
    raw = {n: v for n, _, v in ad.read_safetensors(os.path.join(dst, "adapter_model.safetensors"))}
    assert all(np.array_equal(raw[n], tensors[n]) for n in tensors)
    # torch tensors in, the same bits out
    again = ad.write_peft_folder(
        {n: torch.from_numpy(b.view(np.int16)).view(torch.bfloat16) for n, b in tensors.items()},
        info,
        str(tmp_path / "policy-v4"),
    )
    assert (tmp_path / "policy-v4" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "policy-v3" / "adapter_model.safetensors"
    ).read_bytes()
    with pytest.raises(FileExistsError, match="unloaded"):
        ad.write_peft_folder(tensors, info, again)


def test_peft_folder_is_atomic(tmp_path, monkeypatch):
    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(ad.os, "rename", crash)
    with pytest.raises(OSError, match="killed"):
        ad.write_peft_folder(lora_tensors(), lora_info(), str(tmp_path / "policy-v1"))
    assert os.listdir(tmp_path) == []  # no dst, and the temporary folder was removed
