"""Configuration of the Wordle Space: every environment variable it reads, read here only.

| variable                       | field                 | default   |
|--------------------------------|-----------------------|-----------|
| ``WORDLE_MAX_SESSIONS``        | ``max_sessions``      | 256       |
| ``WORDLE_IDLE_TIMEOUT_S``      | ``idle_timeout_s``    | 600       |
| ``WORDLE_MAX_MESSAGE_BYTES``   | ``max_message_bytes`` | 65536     |
| ``WORDLE_HOST``                | ``host``              | 0.0.0.0   |
| ``PORT``                       | ``port``              | 7860      |
| ``WORDLE_ENABLE_WEB``          | ``web_interface``     | false     |
| ``WORDLE_ENABLE_MCP``          | ``mcp``               | false     |
| ``WORDLE_MAX_UI_CONNECTIONS``  | ``max_ui_connections``| 8         |
| ``WORDLE_WS_COMPRESSION``      | ``ws_compression``    | false     |
| ``WORDLE_LOG_LEVEL``           | ``log_level``         | info      |

``PORT`` is the name Hugging Face Spaces and most hosts use. ``WORDLE_ENABLE_WEB`` turns on
openenv's Gradio UI at ``/web`` (one game shared by every visitor, so it is off by
default); openenv's own switch ``ENABLE_WEB_INTERFACE`` is read when
``WORDLE_ENABLE_WEB`` is not set. ``WORDLE_ENABLE_MCP`` turns on openenv's MCP routes
(``/mcp``), which Wordle does not use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ConfigError(ValueError):
    """An environment variable has a value the server cannot use."""


@dataclass(frozen=True)
class WordleServerConfig:
    """Settings of one server process.

    Attributes:
        max_sessions: concurrent WebSocket sessions (games) allowed; the next connection gets
            a ``CAPACITY_REACHED`` error frame and is closed.
        idle_timeout_s: seconds a session may wait for the client's next message before the
            server closes it (error frame ``SESSION_EXPIRED``, then close code 1000).
        max_message_bytes: largest accepted WebSocket text frame or HTTP request body, bytes.
            Larger frames get a ``MESSAGE_TOO_LARGE`` error frame (the session stays usable)
            up to 4x this size, beyond which uvicorn drops the connection (close code 1009);
            larger HTTP bodies get 413.
        host: interface to bind.
        port: TCP port to bind.
        web_interface: serve openenv's Gradio playground at ``/web`` (and its
            WebSocket ``/ws/ui``); one game shared by every visitor.
        mcp: serve openenv's MCP routes (``/mcp``, HTTP and WebSocket); off: 404.
        max_ui_connections: concurrent ``/ws/ui`` connections of the web UI.
        ws_compression: offer permessage-deflate on WebSockets. Off by default: observations
            are a few KB and CPU, not bandwidth, is what limits a 2-vCPU Space.
        log_level: uvicorn log level.
    """

    max_sessions: int = 256
    idle_timeout_s: float = 600.0
    max_message_bytes: int = 65536
    host: str = "0.0.0.0"
    port: int = 7860
    web_interface: bool = False
    mcp: bool = False
    max_ui_connections: int = 8
    ws_compression: bool = False
    log_level: str = "info"

    @property
    def ws_hard_limit_bytes(self) -> int:
        """Frame size beyond which uvicorn itself drops the connection (close code 1009)."""
        return 4 * self.max_message_bytes


def _int(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], found {raw!r}") from None
    if not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], found {value}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number in [{low}, {high}], found {raw!r}") from None
    if not low <= value <= high:
        raise ConfigError(f"{name} must be a number in [{low}, {high}], found {value}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{name} must be one of {_TRUE + _FALSE}, found {raw!r}")


def load_config(env: Mapping[str, str] | None = None) -> WordleServerConfig:
    """Read the server settings from ``env`` (default: ``os.environ``).

    Raises:
        ConfigError: a variable is set to an unusable value; the message names it, the
            accepted range and the value found.
    """
    env = os.environ if env is None else env
    log_level = env.get("WORDLE_LOG_LEVEL", "info").strip().lower() or "info"
    if log_level not in _LOG_LEVELS:
        raise ConfigError(f"WORDLE_LOG_LEVEL must be one of {_LOG_LEVELS}, found {log_level!r}")
    return WordleServerConfig(
        max_sessions=_int(env, "WORDLE_MAX_SESSIONS", 256, 1, 100_000),
        idle_timeout_s=_float(env, "WORDLE_IDLE_TIMEOUT_S", 600.0, 0.1, 7 * 24 * 3600.0),
        max_message_bytes=_int(env, "WORDLE_MAX_MESSAGE_BYTES", 65536, 256, 16 * 1024 * 1024),
        host=env.get("WORDLE_HOST", "0.0.0.0").strip() or "0.0.0.0",
        port=_int(env, "PORT", 7860, 1, 65535),
        web_interface=_bool(
            env,
            "WORDLE_ENABLE_WEB"
            if (env.get("WORDLE_ENABLE_WEB") or "").strip()
            else "ENABLE_WEB_INTERFACE",
            False,
        ),
        mcp=_bool(env, "WORDLE_ENABLE_MCP", False),
        max_ui_connections=_int(env, "WORDLE_MAX_UI_CONNECTIONS", 8, 1, 10_000),
        ws_compression=_bool(env, "WORDLE_WS_COMPRESSION", False),
        log_level=log_level,
    )
