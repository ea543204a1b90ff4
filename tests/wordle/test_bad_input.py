"""Bad input against the real server, frame by frame over raw WebSockets.

Covers: empty, non-JSON, wrong-shape JSON, binary, over-deep and surrogate-laden frames,
bad reset options and oversized frames each get a clear error frame and leave the session
usable; empty / non-ASCII / huge-but-allowed guesses, steps before reset and after the end
come back as observations; a frame over the hard limit ends only its own connection; another
session playing meanwhile is unaffected and the server stays healthy.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

pytestmark = pytest.mark.slow

DEEP = "[" * 5000 + "]" * 5000
BAD_FRAMES: list[tuple[str, str | bytes, str]] = [
    ("empty", "", "INVALID_JSON"),
    ("not-json", "[crane]]", "INVALID_JSON"),
    ("json-list", "[1, 2]", "INVALID_MESSAGE"),
    ("json-string", '"step"', "INVALID_MESSAGE"),
    ("json-null", "null", "INVALID_MESSAGE"),
    ("binary", b"\x00\xff{}", "INVALID_MESSAGE"),
    ("deep", DEEP, "INVALID_JSON"),
    (
        "deep-in-action",
        '{"type":"step","data":{"message":' + "[" * 500 + "]" * 500 + "}}",
        "INVALID_JSON",
    ),
    ("lone-surrogate", '{"type":"step","data":{"message":"\\ud800[crane]"}}', "INVALID_JSON"),
    ("no-type", "{}", "UNKNOWN_TYPE"),
    ("unknown-type", '{"type": "dance"}', "UNKNOWN_TYPE"),
    ("type-not-a-string", '{"type": ["step"]}', "UNKNOWN_TYPE"),
    ("step-without-data", '{"type": "step"}', "VALIDATION_ERROR"),
    ("data-not-an-object", '{"type": "step", "data": "[crane]"}', "VALIDATION_ERROR"),
    ("message-not-a-string", '{"type": "step", "data": {"message": 5}}', "VALIDATION_ERROR"),
    ("message-missing", '{"type": "step", "data": {}}', "VALIDATION_ERROR"),
    (
        "extra-action-field",
        '{"type": "step", "data": {"message": "[x]", "guess": "x"}}',
        "VALIDATION_ERROR",
    ),
    ("reset-data-a-list", '{"type": "reset", "data": [1]}', "VALIDATION_ERROR"),
    ("reset-seed-a-string", '{"type": "reset", "data": {"seed": "7"}}', "EXECUTION_ERROR"),
    ("reset-unknown-option", '{"type": "reset", "data": {"level": 3}}', "EXECUTION_ERROR"),
    ("reset-unknown-target", '{"type": "reset", "data": {"target": "qwert"}}', "EXECUTION_ERROR"),
    (
        "over-the-cap",
        json.dumps({"type": "step", "data": {"message": "[crane]" + "a" * 70_000}}),
        "MESSAGE_TOO_LARGE",
    ),
]


def _send(ws: ClientConnection, frame: str | bytes) -> dict[str, Any]:
    ws.send(frame)
    return json.loads(ws.recv(timeout=30))


def _step(ws: ClientConnection, message: str) -> dict[str, Any]:
    return _send(ws, json.dumps({"type": "step", "data": {"message": message}}))


def _reset(ws: ClientConnection, **options: Any) -> dict[str, Any]:
    return _send(ws, json.dumps({"type": "reset", "data": options}))


@pytest.mark.parametrize(
    ("frame", "code"), [c[1:] for c in BAD_FRAMES], ids=[c[0] for c in BAD_FRAMES]
)
def test_bad_frame_gets_an_error_and_the_session_survives(
    wordle_server: Any, frame: str | bytes, code: str
) -> None:
    with connect(wordle_server.ws_url, max_size=None) as ws:
        _reset(ws, target="crane")
        answer = _send(ws, frame)
        assert answer["type"] == "error" and answer["data"]["code"] == code
        assert answer["data"]["message"]
        # The same game goes on: slate vs crane.
        after = _step(ws, "[slate]")
        assert after["type"] == "observation"
        assert after["data"]["observation"]["feedback"] == ["XXGXG"]


@pytest.mark.parametrize(
    ("message", "error_code"),
    [
        ("", "no_guess_found"),
        ("   ", "no_guess_found"),
        ("[crané]", "not_ascii_letters"),
        ("Привет [слово] 😀", "not_ascii_letters"),
        ("😀" * 1000, "no_guess_found"),
        ("[" + "a" * 60_000 + "]", "wrong_length"),
        ("\x00[crane\x00]", "no_guess_found"),
    ],
)
def test_bad_guesses_are_invalid_moves(wordle_server: Any, message: str, error_code: str) -> None:
    with connect(wordle_server.ws_url, max_size=None) as ws:
        _reset(ws, target="crane")
        data = _step(ws, message)["data"]
        observation = data["observation"]
        assert observation["error_code"] == error_code and observation["error"]
        assert (data["done"], observation["guesses_left"], observation["invalid_streak"]) == (
            False,
            6,
            1,
        )
        assert len(observation["reply"]) < 1000  # a huge token is not echoed back whole


def test_step_before_reset_and_after_the_end(wordle_server: Any) -> None:
    with connect(wordle_server.ws_url) as ws:
        before = _step(ws, "[crane]")["data"]
        assert before["observation"]["error_code"] == "no_active_game" and before["done"]
        _reset(ws, target="crane")
        assert _step(ws, "[crane]")["data"]["reward"] == 1.0
        after = _step(ws, "[slate]")["data"]
        assert after["observation"]["error_code"] == "game_over"
        assert (after["done"], after["reward"]) == (True, 1.0)
        # Still usable: a new game starts.
        assert _reset(ws, target="abbey")["data"]["observation"]["guesses_left"] == 6


def test_frame_over_the_hard_limit_ends_only_its_connection(wordle_server: Any) -> None:
    with connect(wordle_server.ws_url) as bystander:
        _reset(bystander, target="abbey")
        assert _step(bystander, "[babes]")["data"]["observation"]["feedback"] == ["YYGGX"]
        with connect(wordle_server.ws_url, max_size=None) as offender:
            _reset(offender, target="crane")
            offender.send(json.dumps({"type": "step", "data": {"message": "a" * 300_000}}))
            with pytest.raises(ConnectionClosed) as info:
                offender.recv(timeout=30)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1009
        # The bystander's game goes on, and the server is healthy.
        final = _step(bystander, "[abbey]")["data"]
        assert final["done"] and final["observation"]["won"]
    with urllib.request.urlopen(f"{wordle_server.url}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "healthy"}
