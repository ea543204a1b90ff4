"""``RolloutConfig.from_env`` reads what the fields declare: each field with ``metadata["env"]``
is read from its variable (or a fallback), parsed by the field's type, keeps its own default when
the variable is unset or blank, and a value that does not parse raises ConfigError naming it.
The expectations come from the declarations, not from a second list of names and defaults.
``ROLLOUT_DTYPE`` (auto: float32 on the CPU build where bf16 is emulated, else bfloat16) reaches
vLLM's ``--dtype``, which ``VLLM_EXTRA_ARGS`` may not set."""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, fields

import pytest

from rollout.config import ConfigError, RolloutConfig

REQUIRED = {"BUCKET": "file:///tmp/b", "MODEL": "Qwen/Qwen3-0.6B"}
HINTS = typing.get_type_hints(RolloutConfig)
DECLARED = [f for f in fields(RolloutConfig) if "env" in f.metadata]


def _names(f: Field) -> tuple[str, ...]:
    names = f.metadata["env"]
    return (names,) if isinstance(names, str) else names


def _base(hint):
    optional = typing.get_args(hint)
    return optional[0] if type(None) in optional else hint


def _sample(f: Field) -> tuple[str, object]:
    """A valid value for field ``f`` other than its default: (the variable's text, the value)."""
    kind = _base(HINTS[f.name])
    if f.name == "apply_path":  # the one string with fixed choices
        return "reload", "reload"
    if f.name == "adapter":  # fixed choices too
        return "lora", "lora"
    if f.name == "net":  # a link profile (deltasync.link)
        return "spaces", "spaces"
    if f.name == "dtype":  # auto, bfloat16 or float32
        return "float32", "float32"
    if f.name == "run_public_key":  # an Ed25519 public key: base64 of 32 bytes
        return "A" * 43 + "=", "A" * 43 + "="
    if kind is bool:
        return str(not f.default).lower(), not f.default
    if kind in (int, float):
        value = kind(f.default * 2) if f.default not in (None, MISSING) else kind(0.5)
        return str(value), value
    if kind is str:
        return f"x-{f.name}", f"x-{f.name}"
    return "--enforce-eager --max-num-seqs 4", ("--enforce-eager", "--max-num-seqs", "4")


def _default(f: Field):
    return f.default_factory() if f.default is MISSING else f.default


def test_every_field_declares_its_variable():
    undeclared = [f.name for f in fields(RolloutConfig) if "env" not in f.metadata]
    assert undeclared == []


@pytest.mark.parametrize(
    ("f", "name"),
    [(f, name) for f in DECLARED for name in _names(f)],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_each_declared_variable_is_read_by_the_field_type(f: Field, name: str):
    text, value = _sample(f)
    env = {k: v for k, v in REQUIRED.items() if k not in _names(f)} | {name: text}
    assert getattr(RolloutConfig.from_env(env), f.name) == value


@pytest.mark.parametrize("blank", [None, "", "  "])
def test_unset_or_blank_variables_keep_the_declared_defaults(blank):
    env = dict(REQUIRED)
    if blank is not None:
        env |= {n: blank for f in DECLARED if f.name not in ("bucket", "model") for n in _names(f)}
    cfg = RolloutConfig.from_env(env)
    for f in DECLARED:
        if f.default is not MISSING or f.default_factory is not MISSING:
            assert getattr(cfg, f.name) == _default(f), f.name


@pytest.mark.parametrize(
    "f", [f for f in DECLARED if _base(HINTS[f.name]) is not str], ids=lambda f: f.name
)
def test_a_value_that_does_not_parse_names_the_variable(f: Field):
    name = _names(f)[0]
    with pytest.raises(ConfigError, match=f"{name}: expected .*, found .*unset it") as info:
        RolloutConfig.from_env({**REQUIRED, name: '"unclosed' if f.default == () else "maybe"})
    assert "unclosed" in str(info.value) or "maybe" in str(info.value)


def test_replica_id_and_public_url_fall_back_to_the_space():
    space = {**REQUIRED, "SPACE_ID": "me/rollout", "SPACE_HOST": "me-rollout.hf.space"}
    cfg = RolloutConfig.from_env(space)
    assert (cfg.replica_id, cfg.public_url) == ("me--rollout", "https://me-rollout.hf.space")
    cfg = RolloutConfig.from_env(
        {**space, "REPLICA_ID": "r1", "ROLLOUT_PUBLIC_URL": "http://10.0.0.2:7860/"}
    )
    assert (cfg.replica_id, cfg.public_url) == ("r1", "http://10.0.0.2:7860")
    assert RolloutConfig.from_env(REQUIRED).public_url is None


def test_deprecated_deltasync_store_still_names_the_bucket_with_a_warning(caplog):
    """The run root's environment name is BUCKET; DELTASYNC_STORE (its name before) is read for
    one release, with a DeprecationWarning and a log line, and refused when it disagrees."""
    with pytest.warns(DeprecationWarning, match="DELTASYNC_STORE is deprecated.*set BUCKET"):
        cfg = RolloutConfig.from_env({"DELTASYNC_STORE": "file:///tmp/old", "MODEL": "m"})
    assert cfg.bucket == "file:///tmp/old"
    assert any("set BUCKET instead" in r.getMessage() for r in caplog.records)
    with pytest.warns(DeprecationWarning):  # both, the same: accepted
        same = {"DELTASYNC_STORE": "file:///tmp/b", "BUCKET": "file:///tmp/b", "MODEL": "m"}
        assert RolloutConfig.from_env(same).bucket == "file:///tmp/b"
    with pytest.raises(ConfigError, match="expected one bucket.*unset DELTASYNC_STORE"):
        RolloutConfig.from_env(
            {"DELTASYNC_STORE": "file:///a", "BUCKET": "file:///b", "MODEL": "m"}
        )


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"NET": "moon"}, "NET='moon': expected local, spaces, slow"), ({"SYNC_EVERY": "0"}, ">= 1")],
)
def test_a_simulated_link_and_a_forced_lag_are_checked(env, expected):
    with pytest.raises(ConfigError, match=expected):
        RolloutConfig.from_env({**REQUIRED, **env})
    cfg = RolloutConfig.from_env({**REQUIRED, "NET": "80:25", "SYNC_EVERY": "4"})
    assert (cfg.net, cfg.sync_every) == ("80:25", 4)


def test_the_served_dtype_is_float32_where_bf16_is_emulated_unless_set(monkeypatch):
    """``ROLLOUT_DTYPE=auto`` follows ``deltasync.cpu_dtype`` on the CPU build (both kinds of
    CPU simulated), bfloat16 on a GPU build; a set value is used as it is and reaches vLLM's
    ``--dtype``; anything else is refused, and so is ``--dtype`` in ``VLLM_EXTRA_ARGS``."""
    import torch  # noqa: F401  (loaded: served_dtype asks deltasync.cpu_dtype in this process)

    from deltasync import cpu_dtype
    from rollout.launch import served_dtype, vllm_command

    assert RolloutConfig.from_env(REQUIRED).dtype == "auto"
    for kind in (("float32", "bf16 emulated: AVX2"), ("bfloat16", "bf16 native: AVX512")):
        monkeypatch.setattr(cpu_dtype, "native_dtype", lambda cuda=None, k=kind: k)
        assert served_dtype("auto", cpu_build=True) == kind
        assert served_dtype("auto", cpu_build=False) == (
            "bfloat16",
            "a GPU build of vLLM: bf16 native",
        )
        assert served_dtype("float32", cpu_build=False) == ("float32", "ROLLOUT_DTYPE=float32")
    cmd = vllm_command("/m/tiny", 8001, dtype="float32")
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    with pytest.raises(ValueError, match="resolve auto"):
        vllm_command("/m/tiny", 8001, dtype="auto")
    with pytest.raises(ConfigError, match="ROLLOUT_DTYPE: expected one of auto, bfloat16, float32"):
        RolloutConfig.from_env({**REQUIRED, "ROLLOUT_DTYPE": "float16"})
    with pytest.raises(ConfigError, match="may not set --dtype.*ROLLOUT_DTYPE"):
        RolloutConfig.from_env({**REQUIRED, "VLLM_EXTRA_ARGS": "--dtype=float16"})


def test_the_launcher_asks_a_child_process_when_torch_is_not_loaded(monkeypatch):
    """The front never loads torch: without it, ``served_dtype`` runs ``python -m
    deltasync.cpu_dtype --json`` (the same choice, with ``DELTASYNC_CPU_DTYPE`` honoured), and a
    bad override stops the start naming the variable."""
    import sys

    from rollout.launch import served_dtype

    monkeypatch.delitem(sys.modules, "torch", raising=False)  # restored after the test
    monkeypatch.setenv("DELTASYNC_CPU_DTYPE", "bfloat16")
    dtype, reason = served_dtype("auto", cpu_build=True)
    assert dtype == "bfloat16" and reason.startswith("DELTASYNC_CPU_DTYPE=bfloat16 (this CPU: ")
    monkeypatch.setenv("DELTASYNC_CPU_DTYPE", "fp8")
    with pytest.raises(RuntimeError, match="DELTASYNC_CPU_DTYPE: expected auto"):
        served_dtype("auto", cpu_build=True)


def test_the_full_weights_check_runs_every_ten_minutes_unless_set():
    assert RolloutConfig.from_env(REQUIRED).check_interval_s == 600.0
    assert RolloutConfig.from_env({**REQUIRED, "CHECK_INTERVAL_S": "0"}).check_interval_s == 0.0
    with pytest.raises(ConfigError, match="CHECK_INTERVAL_S must be >= 0 seconds"):
        RolloutConfig.from_env({**REQUIRED, "CHECK_INTERVAL_S": "-1"})
