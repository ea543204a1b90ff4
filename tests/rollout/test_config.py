"""``RolloutConfig.from_env`` reads what the fields declare: each field with ``metadata["env"]``
is read from its variable (or a fallback), parsed by the field's type, keeps its own default when
the variable is unset or blank, and a value that does not parse raises ConfigError naming it.
The expectations come from the declarations, not from a second list of names and defaults."""

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
