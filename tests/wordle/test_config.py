"""The Space's configuration (``spaces/wordle-env/server/config.py``).

Covers: defaults, values read from environment variables, and clear errors naming the
variable, the accepted range and the value found.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import pytest


@pytest.fixture()
def config_module(space_server: ModuleType) -> ModuleType:
    return importlib.import_module(f"{space_server.__name__}.config")


def test_defaults(config_module: ModuleType) -> None:
    config = config_module.load_config({})
    assert (config.max_sessions, config.port, config.web_interface) == (256, 7860, False)
    assert not config.mcp and config.max_ui_connections == 8
    assert not config.ws_compression
    assert config.ws_hard_limit_bytes == 4 * config.max_message_bytes


def test_values_from_the_environment(config_module: ModuleType) -> None:
    config = config_module.load_config(
        {
            "WORDLE_MAX_SESSIONS": "8",
            "WORDLE_IDLE_TIMEOUT_S": "2.5",
            "WORDLE_MAX_MESSAGE_BYTES": "4096",
            "PORT": "8001",
            "ENABLE_WEB_INTERFACE": "no",
            "WORDLE_WS_COMPRESSION": "on",
            "WORDLE_LOG_LEVEL": "WARNING",
        }
    )
    assert config.ws_compression
    assert (config.max_sessions, config.idle_timeout_s, config.max_message_bytes) == (8, 2.5, 4096)
    assert (config.port, config.web_interface, config.log_level) == (8001, False, "warning")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("WORDLE_MAX_SESSIONS", "many"),
        ("WORDLE_MAX_SESSIONS", "0"),
        ("WORDLE_IDLE_TIMEOUT_S", "-1"),
        ("WORDLE_MAX_MESSAGE_BYTES", "12"),
        ("PORT", "70000"),
        ("ENABLE_WEB_INTERFACE", "maybe"),
        ("WORDLE_ENABLE_WEB", "maybe"),
        ("WORDLE_ENABLE_MCP", "sometimes"),
        ("WORDLE_MAX_UI_CONNECTIONS", "0"),
        ("WORDLE_LOG_LEVEL", "loud"),
    ],
)
def test_bad_values_name_the_variable(config_module: ModuleType, name: str, value: str) -> None:
    with pytest.raises(config_module.ConfigError, match=name) as info:
        config_module.load_config({name: value})
    assert "found" in str(info.value)


def test_web_and_mcp_switches(config_module: ModuleType) -> None:
    load = config_module.load_config
    assert load({"WORDLE_ENABLE_WEB": "1"}).web_interface
    assert load({"ENABLE_WEB_INTERFACE": "true"}).web_interface  # openenv's own name
    assert not load({"WORDLE_ENABLE_WEB": "0", "ENABLE_WEB_INTERFACE": "true"}).web_interface
    assert load({"WORDLE_ENABLE_MCP": "yes"}).mcp
    assert load({"WORDLE_MAX_UI_CONNECTIONS": "3"}).max_ui_connections == 3


def _declared(config_module: ModuleType) -> list[tuple[dataclasses.Field, str]]:
    """Each (field, variable) that ``WordleServerConfig`` declares, fallbacks included."""
    return [
        (f, name)
        for f in dataclasses.fields(config_module.WordleServerConfig)
        for name in f.metadata["env"]
    ]


def _sample(f: dataclasses.Field) -> tuple[str, object]:
    """A valid value for ``f`` other than its default: (the variable's text, the value)."""
    if isinstance(f.default, bool):
        return str(not f.default).lower(), not f.default
    if f.metadata["within"]:
        high = f.metadata["within"][1]
        return str(high), type(f.default)(high)
    if f.metadata["choices"]:
        return f.metadata["choices"][0].upper(), f.metadata["choices"][0]
    return f"x-{f.name}", f"x-{f.name}"


def test_each_declared_variable_is_read_and_blank_keeps_the_default(
    config_module: ModuleType,
) -> None:
    declared = _declared(config_module)
    assert {f.name for f, _ in declared} == {
        f.name for f in dataclasses.fields(config_module.WordleServerConfig)
    }
    for f, name in declared:
        text, value = _sample(f)
        assert getattr(config_module.load_config({name: text}), f.name) == value, name
        assert getattr(config_module.load_config({name: " "}), f.name) == f.default, name
