"""Hypothesis fuzz tests of the wire models, the environment and the live server.

Covers: arbitrary JSON either validates into ``WordleAction`` or raises ``ValidationError``
(never anything else); unknown fields are refused by every wire model; actions,
observations and states survive a JSON round trip; ``WordleEnvironment.step`` never raises
on any text and keeps the game invariants; random frames sent to the real server always get
a well-formed answer on a session that stays usable.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from websockets.sync.client import connect

from wordle_env import rules
from wordle_env.models import (
    WordleAction,
    WordleMessage,
    WordleObservation,
    WordleState,
)

JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=5, max_size=5)
MARKS = st.text(alphabet="GYX", min_size=5, max_size=5)
UNIT = st.floats(min_value=0.0, max_value=1.0)
FIELD_NAMES = {
    WordleAction: set(WordleAction.model_fields),
    WordleObservation: set(WordleObservation.model_fields),
    WordleState: set(WordleState.model_fields),
}


@given(payload=JSON_VALUES | st.dictionaries(st.sampled_from(["message", "metadata"]), JSON_VALUES))
def test_action_validation_accepts_or_raises_validation_error(payload: Any) -> None:
    try:
        action = WordleAction.model_validate(payload)
    except ValidationError:
        return
    assert isinstance(action.message, str)
    assert isinstance(payload, dict) and action.message == payload["message"]


@given(
    model=st.sampled_from(list(FIELD_NAMES)),
    key=st.text(min_size=1, max_size=12),
    value=JSON_SCALARS,
)
def test_unknown_fields_are_refused(model: type, key: str, value: Any) -> None:
    base = {"message": "[crane]"} if model is WordleAction else {}
    if key in FIELD_NAMES[model]:
        return
    try:
        model.model_validate({**base, key: value})
    except ValidationError as error:
        assert any(e["type"] == "extra_forbidden" for e in error.errors())
    else:
        raise AssertionError(f"{model.__name__} accepted the unknown field {key!r}")


@given(message=st.text(max_size=200))
def test_action_round_trip(message: str) -> None:
    action = WordleAction(message=message)
    assert WordleAction.model_validate_json(action.model_dump_json()) == action


OBSERVATIONS = st.builds(
    WordleObservation,
    prompt=st.text(max_size=50),
    messages=st.lists(st.builds(WordleMessage, content=st.text(max_size=50)), max_size=2),
    reply=st.text(max_size=50),
    guesses=st.lists(WORDS, max_size=6),
    feedback=st.lists(MARKS, max_size=6),
    guesses_left=st.integers(0, 6),
    invalid_streak=st.integers(0, 2),
    won=st.booleans(),
    target=st.none() | WORDS,
    error_code=st.none() | st.sampled_from(list(rules.INVALID_MOVE_CODES)),
    error=st.none() | st.text(max_size=50),
    reward_breakdown=st.dictionaries(st.sampled_from(["greens", "yellows"]), UNIT),
    done=st.booleans(),
    reward=st.none() | UNIT,
)


@given(observation=OBSERVATIONS)
def test_observation_round_trip(observation: WordleObservation) -> None:
    again = WordleObservation.model_validate_json(observation.model_dump_json())
    assert again == observation


@given(
    state=st.builds(
        WordleState,
        episode_id=st.none() | st.text(max_size=20),
        step_count=st.integers(0, 100),
        seed=st.none() | st.integers(),
        guesses=st.lists(WORDS, max_size=6),
        target=st.none() | WORDS,
    )
)
def test_state_round_trip(state: WordleState) -> None:
    assert WordleState.model_validate_json(state.model_dump_json()) == state


MESSAGES = st.one_of(
    st.text(max_size=80),
    WORDS.map(lambda w: f"[{w}]"),
    st.sampled_from(["[crane]", "[slate]", "[abbey]", "[babes]", "[CRANE]", "[cranes]"]),
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.sampled_from(["crane", "abbey", "llama"]), messages=st.lists(MESSAGES, max_size=14)
)
def test_environment_never_raises_and_keeps_invariants(
    environment_module: ModuleType, target: str, messages: list[str]
) -> None:
    env = environment_module.WordleEnvironment()
    env.reset(target=target)
    for message in messages:
        observation = env.step(WordleAction(message=message))
        assert observation.guesses_left + len(observation.guesses) == rules.MAX_GUESSES
        assert 0.0 <= observation.reward <= 1.0
        assert observation.won == (target in observation.guesses)
        if observation.error_code is None:
            assert observation.feedback[-1] == rules.feedback(observation.guesses[-1], target)
        if observation.done:
            assert (
                observation.won
                or observation.guesses_left == 0
                or (
                    observation.invalid_streak >= rules.INVALID_MOVES_TO_END
                    or observation.error_code == "game_over"
                )
            )
        else:
            assert observation.target is None


FRAMES = st.one_of(
    st.text(max_size=120),
    JSON_VALUES.map(json.dumps),
    st.builds(
        lambda kind, data: json.dumps({"type": kind, "data": data}),
        st.sampled_from(["reset", "step", "state", "dance", ""]),
        JSON_VALUES,
    ),
    st.text(max_size=60).map(lambda m: json.dumps({"type": "step", "data": {"message": m}})),
)


def _is_close(frame: str) -> bool:
    try:
        parsed = json.loads(frame)
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and parsed.get("type") == "close"


@pytest.mark.slow
def test_random_frames_get_well_formed_answers(wordle_server: Any) -> None:
    with connect(wordle_server.ws_url, max_size=None) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"target": "crane"}}))
        assert json.loads(ws.recv(timeout=30))["type"] == "observation"

        @settings(max_examples=150, deadline=None)
        @given(frame=FRAMES)
        def send_one(frame: str) -> None:
            if _is_close(frame):
                return
            ws.send(frame)
            answer = json.loads(ws.recv(timeout=30))
            assert answer["type"] in ("observation", "error", "state")
            if answer["type"] == "error":
                assert answer["data"]["code"] and answer["data"]["message"]

        send_one()
        ws.send(json.dumps({"type": "state"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "state"
