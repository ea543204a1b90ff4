"""Configuration of the Wordle Space: every environment variable it reads, read here only.

| variable                           | field                       | default |
|------------------------------------|-----------------------------|---------|
| ``WORDLE_MAX_SESSIONS``            | ``max_sessions``            | 256     |
| ``WORDLE_IDLE_TIMEOUT_S``          | ``idle_timeout_s``          | 600     |
| ``WORDLE_MAX_MESSAGE_BYTES``       | ``max_message_bytes``       | 65536   |
| ``WORDLE_HOST``                    | ``host``                    | 0.0.0.0 |
| ``PORT``                           | ``port``                    | 7860    |
| ``WORDLE_ENABLE_WEB``              | ``web_interface``           | false   |
| ``WORDLE_ENABLE_MCP``              | ``mcp``                     | false   |
| ``WORDLE_MAX_UI_CONNECTIONS``      | ``max_ui_connections``      | 8       |
| ``WORDLE_WS_COMPRESSION``          | ``ws_compression``          | false   |
| ``WORDLE_LOG_LEVEL``               | ``log_level``               | info    |
| ``WORDLE_API_KEY``                 | ``api_key``                 | (none)  |
| ``WORDLE_MAX_SESSIONS_PER_CLIENT`` | ``max_sessions_per_client`` | 128     |
| ``WORDLE_FORWARDED_HOPS``          | ``forwarded_hops``          | 1       |

``PORT`` is the name Hugging Face Spaces and most hosts use. ``WORDLE_ENABLE_WEB`` turns on
openenv's Gradio UI at ``/web`` (one game shared by every visitor, so it is off by
default); openenv's own switch ``ENABLE_WEB_INTERFACE`` is read when
``WORDLE_ENABLE_WEB`` is not set. ``WORDLE_ENABLE_MCP`` turns on openenv's MCP routes
(``/mcp``), which Wordle does not use. ``WORDLE_API_KEY`` (a public Space's secret, set by
``tools/deploy_spaces.py --public``) makes every route but ``/health`` need ``Authorization: Bearer <key>``
(``server/access_guard.py``); it is never printed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ConfigError(ValueError):
    """An environment variable has a value the server cannot use."""


def _env(names: str | tuple[str, ...], default, within=None, choices=None, secret=False):
    """A setting read from the variable ``names`` (a tuple: the first that is set, later names
    are fallbacks), ``default`` when none is; numbers must lie ``within`` (low, high), strings
    with ``choices`` are one of them (lower-cased); a ``secret`` is left out of ``repr`` (the
    server prints its config at start-up)."""
    names = (names,) if isinstance(names, str) else names
    return field(
        default=default,
        repr=not secret,
        metadata={"env": names, "within": within, "choices": choices},
    )


@dataclass(frozen=True)
class WordleServerConfig:
    """Settings of one server process; each declares its variable next to its default (the
    table above).

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
        api_key: when set (not blank), every route but ``/health`` needs ``Authorization:
            Bearer <api_key>``, on HTTP and on the WebSocket handshake (refused with 401
            before the handshake is accepted). Empty: no key (a private Space, where the Hub
            checks the HF token, or a local server). Never printed (``repr``).
        max_sessions_per_client: concurrent ``/ws`` sessions of one client; the next
            handshake is refused with 429 naming this cap. The client is the key when
            ``api_key`` is set (every holder of the key shares this budget), else the
            client's address (``forwarded_hops``). The default 128 keeps the trainer working:
            its GRPO episodes in flight (``per_device_train_batch_size``, 64 by default) plus
            its held-out games at once (``--eval-per-replica`` 16 x up to 4 replicas = 64),
            and leaves half of ``max_sessions`` to everyone else.
        forwarded_hops: trusted proxies in front of the server: the client's address is the
            N-th entry from the right of ``X-Forwarded-For`` (1, the default: the Hub's
            proxy of a Space); 0 ignores the header and uses the TCP peer (a server reached
            directly, where a client could forge the header).
    """

    max_sessions: int = _env("WORDLE_MAX_SESSIONS", 256, within=(1, 100_000))
    idle_timeout_s: float = _env("WORDLE_IDLE_TIMEOUT_S", 600.0, within=(0.1, 7 * 24 * 3600.0))
    max_message_bytes: int = _env("WORDLE_MAX_MESSAGE_BYTES", 65536, within=(256, 16 * 1024**2))
    host: str = _env("WORDLE_HOST", "0.0.0.0")
    port: int = _env("PORT", 7860, within=(1, 65535))
    web_interface: bool = _env(("WORDLE_ENABLE_WEB", "ENABLE_WEB_INTERFACE"), False)
    mcp: bool = _env("WORDLE_ENABLE_MCP", False)
    max_ui_connections: int = _env("WORDLE_MAX_UI_CONNECTIONS", 8, within=(1, 10_000))
    ws_compression: bool = _env("WORDLE_WS_COMPRESSION", False)
    log_level: str = _env("WORDLE_LOG_LEVEL", "info", choices=_LOG_LEVELS)
    api_key: str = _env("WORDLE_API_KEY", "", secret=True)
    max_sessions_per_client: int = _env("WORDLE_MAX_SESSIONS_PER_CLIENT", 128, within=(1, 100_000))
    forwarded_hops: int = _env("WORDLE_FORWARDED_HOPS", 1, within=(0, 16))

    @property
    def ws_hard_limit_bytes(self) -> int:
        """Frame size beyond which uvicorn itself drops the connection (close code 1009)."""
        return 4 * self.max_message_bytes


def _read(f: Field, env: Mapping[str, str]) -> object:
    """Field ``f``'s value: from the first of its variables that is set (not blank), else its
    default; checked against its range (numbers), its choices (strings) or true/false (bools)."""
    name = next((n for n in f.metadata["env"] if (env.get(n) or "").strip()), None)
    if name is None:
        return f.default
    raw, kind = env[name].strip(), type(f.default)
    choices = _TRUE + _FALSE if kind is bool else f.metadata["choices"]
    if choices:
        if raw.lower() not in choices:
            raise ConfigError(f"{name} must be one of {choices}, found {raw!r}")
        return raw.lower() in _TRUE if kind is bool else raw.lower()
    if kind is str:
        return raw
    low, high = f.metadata["within"]
    what = f"{name} must be {'an integer' if kind is int else 'a number'} in [{low}, {high}]"
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{what}, found {raw!r}") from None
    if not low <= value <= high:
        raise ConfigError(f"{what}, found {value}")
    return value


def load_config(env: Mapping[str, str] | None = None) -> WordleServerConfig:
    """Read the server settings from ``env`` (default: ``os.environ``): each field from the
    variable it declares (the table above).

    Raises:
        ConfigError: a variable is set to an unusable value; the message names it, the
            accepted range and the value found.
    """
    env = os.environ if env is None else env
    return WordleServerConfig(**{f.name: _read(f, env) for f in fields(WordleServerConfig)})
