"""`make cost` (tools/cost.py): the table for a known shape equals the figures worked out by hand
from the same inputs (parameters from the config's numbers, delta = parameters x density x bytes
a change, anchor = parameters x 2, anchors every ``anchor_every`` versions, retention, the
measured requests a version and a window); a faster step raises the trainer's requests in
proportion and the suggested ``weight_sync_steps`` brings the run under the limit; dense deltas
anchor sooner; parameters from a folder's config.json and safetensors headers; an unknown MODEL
names the accepted forms; the shape table agrees with bench/bench_shapes.py; `make cost` prints
every section. No network, no model download."""

from __future__ import annotations

import ast
import json
import math
import os
import struct
import subprocess

import pytest

from tools import cost

from .conftest import REPO_ROOT

DENSITY, BPC = 0.01, 0.93  # given on the command line, so a bench/results/shapes.json is moot


def table(capsys, *args: str) -> dict:
    assert (
        cost.main(["--json", "--density", str(DENSITY), "--bytes-per-change", str(BPC), *args]) == 0
    )
    return json.loads(capsys.readouterr().out)


def qwen3_06b_params() -> int:
    # Qwen/Qwen3-0.6B config.json: hidden 1024, intermediate 3072, 28 layers, 16 q heads, 8 kv
    # heads, head_dim 128, vocab 151936, tied embeddings; q_norm and k_norm per layer
    h, inter, layers, nq, nkv, hd, vocab = 1024, 3072, 28, 16, 8, 128, 151936
    q, k, v, o = h * nq * hd, h * nkv * hd, h * nkv * hd, nq * hd * h
    mlp = 3 * h * inter  # gate, up, down
    norms = 2 * h + 2 * hd  # input, post-attention; q_norm, k_norm
    return vocab * h + layers * (q + k + v + o + mlp + norms) + h


def test_known_shape_matches_the_hand_computed_table(capsys):
    c = table(capsys, "--model", "qwen3-0.6b", "--step-s", "1", "--replicas", "3", "--hours", "2")
    params = qwen3_06b_params()
    assert c["inputs"]["params"] == params
    assert abs(params - 596e6) < 1e6  # docs/BENCHMARKS.md section 1: 596 M parameters

    v = c["versions"]
    delta, anchor = params * DENSITY * BPC, 2 * params
    assert v["per_minute"] == 60 and v["per_hour"] == 3600
    assert v["delta_bytes"] == pytest.approx(delta)
    assert v["anchor_bytes"] == anchor
    # 40 deltas of 1% at 0.93 B stay under half an anchor: anchor_every (40) decides
    assert 40 * delta < 0.5 * anchor and v["anchor_interval_versions"] == 40
    per_hour = 3600 * delta + 3600 / 40 * anchor
    assert v["uploaded_bytes_per_hour"] == pytest.approx(per_hour)
    assert v["uploaded_bytes_total"] == pytest.approx(2 * per_hour)
    assert v["anchor_parts"] == math.ceil(anchor / 2**29)  # part_bytes 512 MiB

    s = c["storage"]  # keep_anchors 2: two anchors and the 2 x 40 versions from the older one
    assert s["held_bytes"] == pytest.approx(2 * anchor + 80 * delta)
    assert s["peak_bytes"] == pytest.approx(3 * anchor + 81 * delta)

    r = c["requests_per_5min"]  # 300 versions in a window
    assert r["trainer"]["api"] == cost.TRAINER_API_PER_VERSION * 300 + 20 + 5 + 5
    assert r["trainer"]["resolver"] == pytest.approx(800 + 5 * 3)
    assert r["replica"] == {"api": 11, "resolver": 300 * 1 + 300 * 1}  # a poll + the delta each
    assert r["dashboard"] == {"api": 18, "resolver": 164}
    assert r["total"]["api"] == cost.TRAINER_API_PER_VERSION * 300 + 30 + 3 * 11 + 18
    lim = c["limit"]
    assert (lim["api"], lim["resolver"]) == (1000, 5000)
    total = r["total"]
    fits = total["api"] <= 0.9 * lim["api"] and total["resolver"] <= 0.9 * lim["resolver"]
    assert lim["fits"] is fits  # the rule: every unit together under 90% of the free tier

    sp = c["spaces"]
    assert sp["rollout"]["flavor"] == "l4x1" and sp["rollout"]["count"] == 3
    assert sp["usd_per_hour"] == pytest.approx(3 * 0.80) and sp["usd_total"] == pytest.approx(4.80)
    assert "requires a paid plan" in c["sources"]["paid_plan"]


def test_a_faster_step_raises_requests_in_proportion_and_the_suggested_k_fits(capsys):
    prices = cost.load_prices()
    base = cost.Inputs(params=qwen3_06b_params(), step_s=2.0, density=DENSITY, bytes_per_change=BPC)
    fast = cost.Inputs(params=base.params, step_s=0.5, density=DENSITY, bytes_per_change=BPC)
    per_version = {
        i.step_s: cost.requests(i)["trainer"]["api"] - cost.TRAINER_API_FIXED for i in (base, fast)
    }
    assert per_version[0.5] == pytest.approx(4 * per_version[2.0])  # 4x the versions
    assert cost.requests(fast)["total"]["api"] > cost.requests(base)["total"]["api"]

    k = cost.k_to_fit(fast, prices)
    assert k is not None and k > 1
    limit = fast.headroom * prices["rate_limits"]["tiers"]["free"]["api"]
    at_k = cost.requests(cost.Inputs(**{**fast.__dict__, "k": k}))["total"]
    below = cost.requests(cost.Inputs(**{**fast.__dict__, "k": k - 1}))["total"]
    assert at_k["api"] <= limit < below["api"]
    assert at_k["resolver"] <= fast.headroom * 5000

    c = table(capsys, "--model", "qwen3-0.6b", "--step-s", "0.5")
    assert c["limit"]["k_to_fit"] == k and c["limit"]["requests_at_k"]["api"] == at_k["api"]


def test_no_k_fits_when_the_fixed_requests_alone_pass_the_limit():
    # 100 replicas x 11 API exceed 900 whatever the trainer does
    i = cost.Inputs(params=10**8, step_s=1.0, replicas=100)
    assert cost.k_to_fit(i, cost.load_prices(), k_max=50) is None


def test_dense_deltas_anchor_before_anchor_every():
    i = cost.Inputs(params=10**9, density=0.1, bytes_per_change=BPC)
    d, a = 10**9 * 0.1 * BPC, 2 * 10**9
    # the publisher anchors at the n-th version when the n - 1 deltas before pass half an anchor
    n = next(n for n in range(1, 100) if (n - 1) * d > 0.5 * a)
    assert cost.anchor_interval(i) == n < 40


def test_parameters_from_a_folder(tmp_path):
    h, inter, layers, nq, nkv, vocab = 576, 1536, 30, 9, 3, 49152  # SmolLM2-135M's config
    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                hidden_size=h,
                intermediate_size=inter,
                num_hidden_layers=layers,
                num_attention_heads=nq,
                num_key_value_heads=nkv,
                vocab_size=vocab,
                tie_word_embeddings=True,
            )
        )
    )
    hd = h // nq
    layer = h * nq * hd + 2 * h * nkv * hd + nq * hd * h + 3 * h * inter + 2 * h
    expected = vocab * h + layers * layer + h
    assert cost.count_params(str(tmp_path)) == (expected, "config.json", None)
    assert cost.count_params("smollm2-135m")[0] == expected
    assert cost.count_params("HuggingFaceTB/SmolLM2-135M-Instruct")[0] == expected

    # safetensors beside it win: their headers are counted, the tensors never read
    header = {"__metadata__": {}, "a": {"shape": [7, 11]}, "b": {"shape": [13]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    assert cost.count_params(str(tmp_path))[0] == 7 * 11 + 13


def test_an_unknown_model_names_the_accepted_forms(capsys):
    assert cost.main(["--model", "llama-9000"]) == 2
    err = capsys.readouterr().err
    assert "MODEL='llama-9000'" in err and "folder" in err and "config.json" in err
    for name in ("smollm2-135m", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"):
        assert name in err
    with pytest.raises(cost.CostError, match="mixture-of-experts"):
        cost.config_params({"num_experts": 8, "hidden_size": 8}, "x/config.json")


def test_shapes_agree_with_bench_shapes():
    path = os.path.join(REPO_ROOT, "bench", "bench_shapes.py")
    tree = ast.parse(open(path).read())
    (node,) = (
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "MODELS"
    )
    bench = ast.literal_eval(node)
    shared = set(bench) & set(cost.SHAPES)
    assert shared == {"qwen3-0.6b", "qwen3-8b"}
    assert all(bench[k] == cost.SHAPES[k] for k in shared)


def test_the_rollout_flavor_has_bf16_and_room():
    prices = cost.load_prices()
    name, hw = cost.rollout_flavor(cost.count_params("smollm2-135m")[0], prices)
    assert hw["bf16"] and not name.startswith("t4")  # cheaper T4s have no bf16
    params = cost.count_params("qwen3-8b")[0]
    name, hw = cost.rollout_flavor(params, prices)
    assert 2 * params / 1e9 <= cost.GPU_WEIGHT_SHARE * hw["gpu_gb"]
    cheaper = [
        h
        for h in prices["spaces"]["hardware"].values()
        if h.get("bf16") and h["usd_per_hour"] < hw["usd_per_hour"]
    ]
    assert all(
        2 * params / 1e9 > cost.GPU_WEIGHT_SHARE * h["gpu_gb"] or 4 * params / 1e9 > h["ram_gb"]
        for h in cheaper
    )


def test_make_cost_prints_every_section():
    out = subprocess.run(
        ["make", "-s", "cost", "MODEL=qwen3-0.6b", "STEP_S=0.5", "REPLICAS=2", "HOURS=3"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for section in (
        "versions a minute",
        "delta a version",
        "anchor",
        "uploaded an hour",
        "Bucket storage (keep_anchors 2",
        "Hub requests per 5 minutes",
        "trainer",
        "each replica",
        "dashboard",
        "fits: NO",
        "weight_sync_steps",
        "Spaces (prices: https://huggingface.co/docs/hub/spaces-gpus",
        "requires a paid plan",
        "Sources",
    ):
        assert section in text, section
    assert "2 replica(s), 3 h" in text

    bad = subprocess.run(
        ["make", "-s", "cost", "MODEL=nope"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "qwen3-1.7b" in bad.stderr
