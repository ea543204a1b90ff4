"""The Wordle Space's ASGI app, built by openenv's ``create_app``, and its entry point.

Routes all come from openenv: ``/ws`` (stateful sessions, what clients use), ``/reset``,
``/step``, ``/state`` (stateless HTTP), ``/health``, ``/schema``, ``/metadata``, and the
Gradio playground at ``/web`` when ``WORDLE_ENABLE_WEB`` is on. We add three things around
them: ``AccessGuard`` (outermost: the key ``WORDLE_API_KEY`` on every route but ``/health``,
and at most ``WORDLE_MAX_SESSIONS_PER_CLIENT`` sessions per client), ``MessageGuard`` (size
caps, idle expiry, MCP off unless ``WORDLE_ENABLE_MCP``, a cap on the web UI's ``/ws/ui``) and
an exception handler that turns bad ``reset`` options into HTTP 422.

Run: ``python -m server.app`` from ``spaces/wordle-env`` (settings: ``server/config.py``).
"""

from __future__ import annotations

import gc
import os

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.types import ConcurrencyConfig

from wordle_env.models import WordleAction, WordleObservation, WordleState

from .access_guard import AccessGuard
from .config import WordleServerConfig, load_config
from .message_guard import MessageGuard
from .wordle_environment import WordleEnvironment, WordleResetError


async def _index() -> JSONResponse:
    """``GET /`` without the web UI: what this server is and where to connect."""
    return JSONResponse(
        {
            "name": "wordle",
            "sessions": "WebSocket /ws (openenv protocol; see /schema)",
            "health": "/health",
            "web_ui": "off (WORDLE_ENABLE_WEB=1 serves the shared playground at /web)",
        }
    )


async def _reset_error_response(request: Request, exc: Exception) -> JSONResponse:
    """HTTP ``/reset`` with unusable options: 422 with our message (else it would be a 500)."""
    return JSONResponse(status_code=422, content={"detail": str(exc)})


def build_app(config: WordleServerConfig) -> FastAPI:
    """Build the app for ``config``.

    openenv's ``create_app`` reads ``ENABLE_WEB_INTERFACE`` from the process environment
    itself; we export the value ``config`` resolved (default off) so that the setting has one
    source.
    """
    os.environ["ENABLE_WEB_INTERFACE"] = "true" if config.web_interface else "false"
    app = create_app(
        WordleEnvironment,
        WordleAction,
        WordleObservation,
        env_name="wordle",
        state_cls=WordleState,
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=config.max_sessions,
            session_timeout=config.idle_timeout_s,
        ),
    )
    app.add_exception_handler(WordleResetError, _reset_error_response)
    if not config.web_interface:  # with it, openenv redirects / to /web/
        app.add_api_route("/", _index, methods=["GET"], include_in_schema=False)
    app.add_middleware(
        MessageGuard,
        max_message_bytes=config.max_message_bytes,
        idle_timeout_s=config.idle_timeout_s,
        ws_paths=("/ws", "/mcp") if config.mcp else ("/ws",),
        mcp_enabled=config.mcp,
        max_ui_connections=config.max_ui_connections,
    )
    app.add_middleware(  # added last, so outermost: a request without the key reaches nothing
        AccessGuard,
        api_key=config.api_key,
        max_sessions_per_client=config.max_sessions_per_client,
        forwarded_hops=config.forwarded_hops,
        session_paths=("/ws", "/mcp") if config.mcp else ("/ws",),
    )
    return app


config = load_config()
app = build_app(config)
# The imports above (gradio, fastmcp, pydantic schemas) leave ~250k long-lived objects; a
# full collection over them stalls every session for ~200 ms. Freezing moves them out of the
# collector's reach, so only objects created while serving are ever scanned.
gc.collect()
gc.freeze()


def main() -> None:
    """Serve ``app`` with uvicorn on ``config.host:config.port``."""
    print(f"wordle-env: {config}", flush=True)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        ws_max_size=config.ws_hard_limit_bytes,
        ws_per_message_deflate=config.ws_compression,
        log_level=config.log_level,
    )


if __name__ == "__main__":
    main()
