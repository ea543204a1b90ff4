"""``dashboard.config.parse_config``: each flag defaults to the Space variable its
``DashboardConfig`` field declares (``metadata["env"]``), else to the field's default. The
expectations come from the declarations, not from a second list of names and defaults."""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, fields

import pytest

from dashboard.config import DashboardConfig, parse_config

HINTS = typing.get_type_hints(DashboardConfig)
FIELDS = fields(DashboardConfig)


def _sample(f: Field) -> tuple[str, object]:
    """A valid value for field ``f`` other than its default: (the variable's text, the value)."""
    kind = HINTS[f.name]
    if kind is str:
        return f"x-{f.name}", f"x-{f.name}"
    return str(kind(f.default * 3)), kind(f.default * 3)


def test_every_setting_declares_a_variable_and_a_help():
    assert all(f.metadata["env"] and f.metadata["help"] for f in FIELDS)


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.metadata["env"])
def test_each_variable_feeds_its_setting_and_a_flag_overrides_it(f: Field):
    text, value = _sample(f)
    env = {"BUCKET": "b", f.metadata["env"]: text}
    assert getattr(parse_config([], env=env), f.name) == value
    flag = "--" + f.name.replace("_", "-")
    assert getattr(parse_config([flag, "7"], env=env), f.name) == HINTS[f.name]("7")


@pytest.mark.parametrize("blank", [None, "", " "])
def test_unset_or_blank_variables_keep_the_declared_defaults(blank):
    env = {} if blank is None else {f.metadata["env"]: blank for f in FIELDS}
    cfg = parse_config(["--bucket", "b"], env=env)
    for f in FIELDS:
        if f.default is not MISSING:
            assert getattr(cfg, f.name) == f.default, f.name


@pytest.mark.parametrize("f", [f for f in FIELDS if HINTS[f.name] is not str], ids=lambda f: f.name)
def test_a_variable_that_does_not_parse_is_named(f: Field, capsys):
    var = f.metadata["env"]
    with pytest.raises(SystemExit) as e:
        parse_config([], env={"BUCKET": "b", var: "soon"})
    assert e.value.code == 2
    assert f"{var}: expected a {HINTS[f.name].__name__}, found 'soon'" in capsys.readouterr().err


def test_help_shows_each_variable_and_default(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["--help"], env={})
    assert e.value.code == 0  # help printed, not an error
    text = " ".join(capsys.readouterr().out.split())
    for f in FIELDS:
        shown = "" if f.default is MISSING else f", else {f.default}"
        assert f"(default: ${f.metadata['env']}{shown})" in text
