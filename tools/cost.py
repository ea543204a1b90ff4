"""What a run costs before it starts: `make cost MODEL=... [STEP_S=1] [REPLICAS=1] [HOURS=1]`.

Prints, for a model and an optimizer step time: versions a minute, bytes a version (delta and
anchor) and an hour, the bucket's storage under retention, Hub requests per 5 minutes against the
rate limit (and the ``weight_sync_steps`` k that fits), and the Spaces' hardware and price.
Arithmetic on measured figures, not a run; every figure names where it comes from.

MODEL: a folder (``*.safetensors`` headers counted exactly, else ``config.json``: hidden,
layers, intermediate, vocab, heads, tied embeddings) or a known shape (``SHAPES``; a hub id such
as ``Qwen/Qwen3-0.6B`` matches by its last part). Stdlib only (the defaults of deltasync's
PublisherConfig and the deploy tool's DeployConfig are read from their source), so ``make cost``
needs no setup.

    python -m tools.cost --model qwen3-8b --step-s 1 --replicas 2 --hours 10 [--json]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import json
import math
import operator
import os
import struct
import sys
from dataclasses import dataclass

TOOLS = os.path.dirname(os.path.abspath(__file__))
PRICES_PATH = os.path.join(TOOLS, "hub_prices.json")
PUBLISHER_CONFIG_PY = os.path.join(TOOLS, "..", "shared", "deltasync", "publisher_config.py")
SPACE_CONFIG_PY = os.path.join(TOOLS, "space_config.py")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: operator.pow}


def _number(node: ast.expr):
    """A literal, or arithmetic on literals (``512 * 2**20``)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_number(node.left), _number(node.right))
    return ast.literal_eval(node)


def dataclass_defaults(path: str, cls: str, names: tuple[str, ...]) -> dict:
    """The defaults of fields ``names`` of dataclass ``cls`` in ``path``, read from its source
    without importing it (deltasync's package needs numpy and zstandard; ``make cost`` needs no
    setup), so the table follows the code's defaults."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    (node,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    found = {
        a.target.id: _number(a.value)
        for a in node.body
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and a.target.id in names
    }
    assert set(found) == set(names), f"{path}: {cls} lacks {set(names) - set(found)}"
    return found


PUBLISHER = dataclass_defaults(
    PUBLISHER_CONFIG_PY,
    "PublisherConfig",
    ("anchor_every", "keep_anchors", "anchor_replay_fraction", "part_bytes"),
)
DEPLOY = dataclass_defaults(
    SPACE_CONFIG_PY,
    "DeployConfig",
    ("poll_interval_s", "rollout_hardware", "wordle_hardware", "dashboard_hardware"),
)
WINDOW_S = 300.0  # the Hub's fixed rate-limit window

# (hidden, intermediate, layers, q heads, kv heads, head_dim, vocab, tied): each model's
# config.json; the same tuple as bench/bench_shapes.py's MODELS (a test keeps them equal)
SHAPES = {
    "smollm2-135m": (576, 1536, 30, 9, 3, 64, 49152, True),  # HuggingFaceTB/SmolLM2-135M
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
}
# Qwen3 has per-head RMSNorms on q and k (q_norm, k_norm: head_dim each, per layer)
QK_NORM = {"qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"}

# The delta's size: changed elements x bytes per change. bench/results/shapes.json
# (bench/bench_shapes.py: "density", "bytes_per_change", per model) when this checkout has one,
# else the figures docs/BENCHMARKS.md section 8 records from it.
CODEC_DEFAULT = {
    "density": 0.01,
    "bytes_per_change": 0.93,
    "source": (
        "docs/BENCHMARKS.md section 8 (bench/bench_shapes.py, H100 box, 2026-11-24): 1.0% of the "
        "bf16 elements change a step, 0.93 B a change at Qwen3-0.6B shapes (0.92 at Qwen3-8B); "
        "a real model (SmolLM2-135M, section 11) measured 0.76-0.88 B a change"
    ),
}
SHAPES_JSON = os.path.join("bench", "results", "shapes.json")

# Hub requests per unit, measured (docs/SCALE.md "Hub request budget", docs/BENCHMARKS.md
# section 13). Per version the trainer makes two batch_bucket_files calls (payload parts with
# the due retention deletes, then manifest.json), each one /batch: the Xet write token is kept
# while valid (deltasync.hub_store; measured 2.00 a version at the local Hub, was 4).
TRAINER_API_PER_VERSION = 2
# resolver per version: the manifest read before each commit, the HEADs of retention deletes;
# measured 800 per 5 min at a 1 s step (300 versions; section 13)
TRAINER_RESOLVER_PER_VERSION = 800 / 300
# per 5 minutes: metrics/trainer.json every 30 s (2 API each) = 20, the fleet's listing of
# replicas/ once a minute = 5, and at start the lease (2), one listing, the bucket check and
# huggingface_hub's /api/agent-harnesses (the first window); SCALE.md's fleet table: 151 API
# at a 10 s step = 30 x 4 + 20 + 5 + 5 + the lease release
TRAINER_API_FIXED = 20 + 5 + 5
TRAINER_RESOLVER_PER_REPLICA = 5  # the fleet reads each replica's heartbeat once a minute
# each replica: the bucket check + a heartbeat at most every 60 s (2 API each) = 11 (SCALE.md)
REPLICA_API = 11
# the dashboard: the largest of its measured windows (18 API: feed, 10 s step; 164 resolver:
# SCALE.md's fleet table); it reads at most every 5 s whatever the step
DASHBOARD_API, DASHBOARD_RESOLVER = 18, 164
REQUEST_SOURCE = (
    "docs/SCALE.md 'Hub request budget' and docs/BENCHMARKS.md section 13 (huggingface_hub "
    "2.4.0): trainer 2 API a version (2 batches, the Xet write token kept; 4 before) + 30 fixed, 2.67 resolver "
    "a version + 5 a replica; replica 11 API, resolver = its polls + the delta parts; dashboard "
    "18 / 164. Measured at a 1 s step with a token per batch: trainer 1,178 API, a replica 589 resolver"
)
# a replica's GPU holds the weights in at most this share of its memory (the rest: vLLM's KV
# cache and activations); its host holds a bf16 copy of the weights and stages a new anchor
GPU_WEIGHT_SHARE = 0.5
HOST_WEIGHT_COPIES = 2


class CostError(ValueError):
    """What the user asked cannot be costed (an unknown MODEL, a bad number)."""


# --------------------------------------------------------------------------------- parameters
def params_of_shape(shape: tuple, qk_norm: bool = False, qkv_bias: bool = False) -> int:
    """Parameters of a Llama/Qwen-style decoder: embedding (and an untied LM head), per layer
    q/k/v/o, gate/up/down and two RMSNorms (Qwen3: q_norm and k_norm too), a final norm."""
    h, inter, layers, nq, nkv, hd, vocab, tied = shape
    attn = h * nq * hd + 2 * h * nkv * hd + nq * hd * h
    if qkv_bias:
        attn += nq * hd + 2 * nkv * hd
    layer = attn + 3 * h * inter + 2 * h + (2 * hd if qk_norm else 0)
    return vocab * h * (1 if tied else 2) + layers * layer + h


def safetensors_params(paths: list[str]) -> int:
    """Elements of every tensor named in the files' headers (8-byte length + JSON), read only."""
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                total += math.prod(meta["shape"])
    return total


def config_params(cfg: dict, where: str) -> int:
    """Parameters from a transformers config.json (dense decoders; text_config when nested)."""
    cfg = cfg.get("text_config", cfg)
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise CostError(
            f"{where}: a mixture-of-experts config; its parameters are not counted from the "
            "config here: put the model's *.safetensors in the folder (their headers are counted)"
        )
    try:
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        shape = (
            h,
            cfg["intermediate_size"],
            cfg["num_hidden_layers"],
            heads,
            cfg.get("num_key_value_heads") or heads,
            cfg.get("head_dim") or h // heads,
            cfg["vocab_size"],
            cfg.get("tie_word_embeddings", True),
        )
    except KeyError as e:
        raise CostError(
            f"{where}: no {e.args[0]!r}; expected hidden_size, intermediate_size, "
            "num_hidden_layers, num_attention_heads and vocab_size (or *.safetensors beside it)"
        ) from None
    kind = str(cfg.get("model_type", ""))
    bias = bool(cfg.get("attention_bias", kind == "qwen2"))
    return params_of_shape(shape, qk_norm=kind.startswith("qwen3"), qkv_bias=bias)


def shape_key(model: str) -> str | None:
    """The SHAPES entry a name or hub id means: exact, by its last part, or with a suffix such
    as -instruct / -base."""
    name = model.rstrip("/").split("/")[-1].lower()
    if name in SHAPES:
        return name
    return next((k for k in SHAPES if name.startswith(k + "-")), None)


def count_params(model: str) -> tuple[int, str, str | None]:
    """(parameters, how they were counted, the SHAPES key or None)."""
    if os.path.isdir(model):
        tensors = sorted(glob.glob(os.path.join(model, "*.safetensors")))
        if tensors:
            return safetensors_params(tensors), f"{len(tensors)} safetensors header(s)", None
        cfg_path = os.path.join(model, "config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                return config_params(json.load(f), cfg_path), "config.json", None
    else:
        key = shape_key(model)
        if key is not None:
            return params_of_shape(SHAPES[key], qk_norm=key in QK_NORM), "shape table", key
    raise CostError(
        f"MODEL={model!r}: not a folder holding *.safetensors or config.json, nor a known shape. "
        f"Give a model folder, or one of: {', '.join(SHAPES)} (a hub id such as Qwen/Qwen3-0.6B "
        "matches by its last part)"
    )


def codec_figures(key: str | None, path: str = SHAPES_JSON) -> dict:
    """Density and bytes per change: this checkout's bench/results/shapes.json (the model's own
    entry, else the largest model measured) when present, else CODEC_DEFAULT."""
    try:
        with open(path) as f:
            models = json.load(f)["models"]
    except (OSError, ValueError, KeyError):
        return dict(CODEC_DEFAULT)
    real = {k: v for k, v in models.items() if k != "local" and v.get("bytes_per_change")}
    if not real:
        return dict(CODEC_DEFAULT)
    name = key if key in real else max(real, key=lambda k: real[k]["params"])
    r = real[name]
    return {
        "density": r["density"],
        "bytes_per_change": r["bytes_per_change"],
        "source": f"{path} ({name}: bench/bench_shapes.py's density and bytes_per_change)",
    }


# ------------------------------------------------------------------------------------ the model
@dataclass
class Inputs:
    """What a cost table is computed from.

    Attributes:
        params: the model's parameters (elements, each 2 bytes in bf16).
        step_s: seconds an optimizer step takes.
        replicas: rollout Spaces following the bucket.
        hours: hours the run lasts (for the totals).
        k: ``weight_sync_steps``: optimizer steps between publishes.
        density: share of the bf16 elements that change a version.
        bytes_per_change: delta bytes per changed element.
        tier: rate-limit tier of the account the units' tokens belong to.
        headroom: share of the limit the run may use (the rest: deploys, the user's own calls).
    """

    params: int
    step_s: float = 1.0
    replicas: int = 1
    hours: float = 1.0
    k: int = 1
    density: float = CODEC_DEFAULT["density"]
    bytes_per_change: float = CODEC_DEFAULT["bytes_per_change"]
    tier: str = "free"
    headroom: float = 0.9
    anchor_every: int = PUBLISHER["anchor_every"]
    keep_anchors: int = PUBLISHER["keep_anchors"]
    anchor_replay_fraction: float = PUBLISHER["anchor_replay_fraction"]
    part_bytes: int = PUBLISHER["part_bytes"]
    poll_interval_s: float = DEPLOY["poll_interval_s"]

    def __post_init__(self):
        if self.step_s <= 0 or self.hours <= 0 or self.replicas < 0 or self.k < 1:
            raise CostError(
                f"expected step_s > 0, hours > 0, replicas >= 0 and k >= 1, found step_s="
                f"{self.step_s}, hours={self.hours}, replicas={self.replicas}, k={self.k}"
            )
        if not 0 < self.density <= 1 or self.bytes_per_change <= 0:
            raise CostError(
                f"expected 0 < density <= 1 and bytes_per_change > 0, found {self.density}, "
                f"{self.bytes_per_change}"
            )


def delta_bytes(i: Inputs) -> float:
    """One version's delta. With k > 1 a version folds k steps: up to k times the changes."""
    return i.params * min(1.0, i.density * i.k) * i.bytes_per_change


def anchor_interval(i: Inputs) -> int:
    """Versions from one anchor to the next: ``anchor_every``, or sooner when the deltas since
    the last anchor pass ``anchor_replay_fraction`` of an anchor (the publisher's rule: at the
    n-th version after an anchor it anchors when the n - 1 deltas before exceed it)."""
    d, a = delta_bytes(i), 2 * i.params
    return min(i.anchor_every, math.floor(i.anchor_replay_fraction * a / d) + 2)


def polls_between(t_s: float, p_s: float) -> int:
    """A replica's manifest polls in the t_s after a change: p_s, then doubling up to
    max(5, p_s) while nothing changes (rollout.sync_loop); at least one."""
    cap, t, gap, n = max(5.0, p_s), 0.0, p_s, 0
    while t + gap <= t_s + 1e-9:
        t += gap
        n += 1
        gap = min(2 * gap, cap)
    return max(n, 1)


def requests(i: Inputs) -> dict[str, dict[str, float]]:
    """Hub requests per 5-minute window, per unit and in all (``REQUEST_SOURCE``)."""
    interval_s = i.step_s * i.k
    v5 = WINDOW_S / interval_s
    delta_parts = math.ceil(delta_bytes(i) / i.part_bytes)
    if interval_s >= i.poll_interval_s:
        polls = v5 * polls_between(interval_s, i.poll_interval_s)
    else:  # several versions a poll: it fetches each one's delta
        polls = WINDOW_S / i.poll_interval_s
    units = {
        "trainer": {
            "api": TRAINER_API_PER_VERSION * v5 + TRAINER_API_FIXED,
            "resolver": TRAINER_RESOLVER_PER_VERSION * v5
            + TRAINER_RESOLVER_PER_REPLICA * i.replicas,
        },
        "replica": {"api": REPLICA_API, "resolver": polls + v5 * delta_parts},
        "dashboard": {"api": DASHBOARD_API, "resolver": DASHBOARD_RESOLVER},
    }
    units["total"] = {
        kind: units["trainer"][kind]
        + i.replicas * units["replica"][kind]
        + units["dashboard"][kind]
        for kind in ("api", "resolver")
    }
    return units


def limits(tier: str, prices: dict) -> dict[str, int]:
    tiers = prices["rate_limits"]["tiers"]
    if tier not in tiers:
        raise CostError(f"tier {tier!r}: expected one of {', '.join(tiers)}")
    return tiers[tier]


def fits(i: Inputs, prices: dict) -> bool:
    lim, total = limits(i.tier, prices), requests(i)["total"]
    return all(total[kind] <= i.headroom * lim[kind] for kind in ("api", "resolver"))


def k_to_fit(i: Inputs, prices: dict, k_max: int = 10_000) -> int | None:
    """The smallest ``weight_sync_steps`` at which the run's requests fit the tier's limit
    (times ``headroom``); None when the fixed requests alone do not fit."""
    for k in range(1, k_max + 1):
        if fits(dataclasses.replace(i, k=k), prices):
            return k
    return None


def rollout_flavor(params: int, prices: dict, name: str | None = None) -> tuple[str, dict]:
    """The rollout Space's flavor: ``name``, else the cheapest bf16 GPU flavor whose GPU memory
    holds the bf16 weights in GPU_WEIGHT_SHARE of it and whose RAM holds HOST_WEIGHT_COPIES."""
    hw = prices["spaces"]["hardware"]
    if name is not None:
        if name not in hw:
            raise CostError(f"rollout hardware {name!r}: expected one of {', '.join(hw)}")
        return name, hw[name]
    w_gb = 2 * params / 1e9
    ok = [
        (h["usd_per_hour"], n)
        for n, h in hw.items()
        if h.get("bf16")
        and w_gb <= GPU_WEIGHT_SHARE * h["gpu_gb"]
        and HOST_WEIGHT_COPIES * w_gb <= h["ram_gb"]
    ]
    if not ok:
        raise CostError(
            f"no Space flavor in {PRICES_PATH} holds {w_gb:.1f} GB of bf16 weights in "
            f"{GPU_WEIGHT_SHARE:.0%} of its GPU memory: the replica needs a bigger machine"
        )
    n = min(ok)[1]
    return n, hw[n]


def load_prices(path: str = PRICES_PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def cost(
    i: Inputs, prices: dict, rollout_hardware: str | None = None, model: str = ""
) -> dict[str, dict]:
    """Every figure of the table, as one JSON-serialisable dict."""
    vpm = 60 / (i.step_s * i.k)
    vph = 60 * vpm
    d, a, n = delta_bytes(i), 2 * i.params, anchor_interval(i)
    per_hour = vph * d + vph / n * a
    k_fit = k_to_fit(i, prices)
    pro = dataclasses.replace(i, tier="pro")
    flavor, fhw = rollout_flavor(i.params, prices, rollout_hardware)
    hw = prices["spaces"]["hardware"]
    wordle, dash = DEPLOY["wordle_hardware"], DEPLOY["dashboard_hardware"]
    usd_h = i.replicas * fhw["usd_per_hour"] + hw[wordle]["usd_per_hour"] + hw[dash]["usd_per_hour"]
    lim = limits(i.tier, prices)
    return {
        "inputs": {"model": model, **dataclasses.asdict(i)},
        "versions": {
            "per_minute": vpm,
            "per_hour": vph,
            "delta_bytes": d,
            "anchor_bytes": a,
            "anchor_interval_versions": n,
            "delta_parts": math.ceil(d / i.part_bytes),
            "anchor_parts": math.ceil(a / i.part_bytes),
            "uploaded_bytes_per_hour": per_hour,
            "anchor_share": vph / n * a / per_hour,
            "uploaded_bytes_total": per_hour * i.hours,
            "replica_download_bytes_per_hour": vph * d,
        },
        "storage": {
            "held_bytes": i.keep_anchors * (a + n * d),
            "peak_bytes": (i.keep_anchors + 1) * a + (i.keep_anchors * n + 1) * d,
            "reached_after_versions": i.keep_anchors * n,
        },
        "requests_per_5min": requests(i),
        "limit": {
            "tier": i.tier,
            **lim,
            "headroom": i.headroom,
            "fits": fits(i, prices),
            "k_to_fit": k_fit,
            "requests_at_k": requests(dataclasses.replace(i, k=k_fit))["total"] if k_fit else None,
            "pro": {
                **limits("pro", prices),
                "fits": fits(pro, prices),
                "k_to_fit": k_to_fit(pro, prices),
            },
        },
        "spaces": {
            "rollout": {"flavor": flavor, **fhw, "count": i.replicas},
            "wordle": {"flavor": wordle, **hw[wordle]},
            "dashboard": {"flavor": dash, **hw[dash]},
            "usd_per_hour": usd_h,
            "usd_total": usd_h * i.hours,
        },
        "sources": {
            "codec": None,  # filled by main
            "requests": REQUEST_SOURCE,
            "rate_limits": f"{prices['rate_limits']['source']}; {prices['rate_limits']['source_date']}",
            "spaces": f"{prices['spaces']['source']}, read {prices['retrieved']}",
            "paid_plan": prices["spaces"]["paid_plan_note"],
            "retention": "deltasync PublisherConfig: anchor_every, keep_anchors, anchor_replay_fraction",
        },
    }


# ------------------------------------------------------------------------------------ printing
def _b(n: float) -> str:
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n:.0f} B"


def _req(r: dict) -> str:
    return f"{r['api']:,.0f} API / {r['resolver']:,.0f} resolver"


def render(c: dict, how: str) -> str:
    i, v, s, r, lim, sp = (
        c["inputs"],
        c["versions"],
        c["storage"],
        c["requests_per_5min"],
        c["limit"],
        c["spaces"],
    )
    k = i["k"]
    out = [
        f"deltasync cost: {i['model']} ({i['params']:,} parameters, {how}), step {i['step_s']:g} s, "
        f"weight_sync_steps {k}, {i['replicas']} replica(s), {i['hours']:g} h",
        "",
        "Versions and bytes",
        f"  versions a minute        {v['per_minute']:,.1f}",
        f"  delta a version          {_b(v['delta_bytes'])} ({100 * min(1, i['density'] * k):.2f}% "
        f"of elements x {i['bytes_per_change']:.2f} B a change; {v['delta_parts']} part(s))",
        f"  anchor                   {_b(v['anchor_bytes'])} (parameters x 2 B; "
        f"{v['anchor_parts']} part(s)), every {v['anchor_interval_versions']} versions "
        f"(anchor_every {i['anchor_every']}, or when the deltas since pass "
        f"{i['anchor_replay_fraction']:g} of an anchor)",
        f"  uploaded an hour         {_b(v['uploaded_bytes_per_hour'])} (anchors "
        f"{v['anchor_share']:.0%} of it; {_b(v['uploaded_bytes_per_hour'] / 3600)}/s sustained); "
        f"{_b(v['uploaded_bytes_total'])} in {i['hours']:g} h",
        f"  each replica downloads   {_b(v['replica_download_bytes_per_hour'])} an hour "
        "(following; a new or far-behind replica fetches an anchor first)",
        "",
        f"Bucket storage (keep_anchors {i['keep_anchors']}: those anchors + every version since "
        "the oldest of them)",
        f"  held                     {_b(s['held_bytes'])} (after {s['reached_after_versions']} "
        "versions)",
        f"  peak                     {_b(s['peak_bytes'])} (one version after a new anchor, until "
        "the dropped versions' deletes ride the next batch)",
        "",
        f"Hub requests per 5 minutes (counted per account: every unit on one user's tokens shares "
        f"it; {lim['tier']} tier {lim['api']:,} API / {lim['resolver']:,} resolver)",
        f"  trainer                  {_req(r['trainer'])}",
        f"  each replica             {_req(r['replica'])}",
        f"  dashboard                {_req(r['dashboard'])}",
        f"  total                    {_req(r['total'])}",
    ]
    target = f"{lim['headroom']:.0%} of the {lim['tier']} tier's limit"
    if lim["fits"]:
        out.append(f"  fits: yes, under {target}")
    elif lim["k_to_fit"]:
        out.append(
            f"  fits: NO, over {target}; weight_sync_steps {lim['k_to_fit']} fits "
            f"({_req(lim['requests_at_k'])}: a version every {lim['k_to_fit'] * i['step_s']:g} s)"
        )
    else:
        out.append(
            f"  fits: NO, over {target} at any weight_sync_steps: the fixed requests alone pass it "
            "(fewer replicas on one account, or a higher tier)"
        )
    pro = lim["pro"]
    out.append(
        f"  PRO tier ({pro['api']:,} / {pro['resolver']:,}): "
        + (
            "fits"
            if pro["fits"]
            else f"weight_sync_steps {pro['k_to_fit']} fits"
            if pro["k_to_fit"]
            else "does not fit"
        )
    )
    ro, wo, da = sp["rollout"], sp["wordle"], sp["dashboard"]
    out += [
        "",
        f"Spaces (prices: {c['sources']['spaces']})",
        f"  rollout x{ro['count']:<3}             {ro['flavor']} ({ro['name']}, {ro['gpu_gb']} GB GPU, "
        f"{ro['ram_gb']} GB RAM) ${ro['usd_per_hour']:.2f}/h each; chosen: the cheapest bf16 "
        f"flavor with the weights in {GPU_WEIGHT_SHARE:.0%} of its GPU memory and "
        f"{HOST_WEIGHT_COPIES} copies in RAM",
        f"  wordle                   {wo['flavor']} ({wo['name']}) ${wo['usd_per_hour']:.2f}/h",
        f"  dashboard                {da['flavor']} ({da['name']}) ${da['usd_per_hour']:.2f}/h",
        f"  total                    ${sp['usd_per_hour']:.2f} an hour, ${sp['usd_total']:.2f} for "
        f"{i['hours']:g} h (the trainer's machine and bucket storage not included)",
        f"  note: {c['sources']['paid_plan']}",
        "",
        "Sources",
        f"  bytes a change, density: {c['sources']['codec']}",
        f"  requests: {c['sources']['requests']}",
        f"  rate limits: {c['sources']['rate_limits']}",
    ]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--model", required=True, help=f"a model folder or one of {', '.join(SHAPES)}")
    p.add_argument("--step-s", type=float, default=1.0, help="seconds an optimizer step takes")
    p.add_argument("--replicas", type=int, default=1, help="rollout Spaces")
    p.add_argument("--hours", type=float, default=1.0, help="hours the run lasts")
    p.add_argument("--k", type=int, default=1, help="weight_sync_steps: steps between publishes")
    p.add_argument(
        "--density", type=float, help="share of elements changed a step (default: measured)"
    )
    p.add_argument("--bytes-per-change", type=float, help="delta bytes a changed element")
    p.add_argument("--tier", default="free", help="free, pro, team or enterprise")
    p.add_argument("--headroom", type=float, default=0.9, help="share of the limit the run may use")
    p.add_argument("--rollout-hardware", help="a Space flavor (default: the cheapest that fits)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        params, how, key = count_params(a.model)
        codec = codec_figures(key)
        if a.density is not None or a.bytes_per_change is not None:
            codec["source"] = (
                "given: "
                + ", ".join(
                    f"{n} {x}"
                    for n, x in (("density", a.density), ("bytes_per_change", a.bytes_per_change))
                    if x is not None
                )
                + f"; otherwise {codec['source']}"
            )
        i = Inputs(
            params=params,
            step_s=a.step_s,
            replicas=a.replicas,
            hours=a.hours,
            k=a.k,
            density=a.density if a.density is not None else codec["density"],
            bytes_per_change=(
                a.bytes_per_change if a.bytes_per_change is not None else codec["bytes_per_change"]
            ),
            tier=a.tier,
            headroom=a.headroom,
        )
        prices = load_prices()
        c = cost(i, prices, a.rollout_hardware, model=a.model)
    except CostError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c["sources"]["codec"] = codec["source"]
    c["inputs"]["counted_from"] = how
    print(json.dumps(c, indent=1) if a.json else render(c, how))
    return 0


if __name__ == "__main__":
    sys.exit(main())
