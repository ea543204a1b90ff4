"""The Space's OpenEnv environment in-process (``server/wordle_environment.py``).

Covers: seeded resets are deterministic per session and independent of other sessions,
explicit targets, refused reset options, steps before reset / after the end / after close
reported inside the observation, the reward and its breakdown in the observation and its
metadata, and the state hiding the target until the game is over.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from wordle_env import rules, wordlists
from wordle_env.models import WordleAction


def _play(env: object, *messages: str) -> object:
    observation = None
    for message in messages:
        observation = env.step(WordleAction(message=message))  # type: ignore[attr-defined]
    return observation


def test_seeded_reset_is_deterministic_per_session(environment_module: ModuleType) -> None:
    a, b = environment_module.WordleEnvironment(), environment_module.WordleEnvironment()
    # Unseeded games in one session do not shift what a seed plays in another.
    for _ in range(3):
        a.reset()
        _play(a, "[crane]")
    a.reset(seed=11)
    b.reset(seed=11)
    target = wordlists.target_for_seed(11)
    probe = "crane" if target != "crane" else "slate"
    first_a, first_b = _play(a, f"[{probe}]"), _play(b, f"[{probe}]")
    assert first_a.feedback == first_b.feedback == [rules.feedback(probe, target)]
    final = _play(a, f"[{target}]")
    assert final.won and final.target == target and final.reward == 1.0
    assert not _play(b, "[qwert]").done  # b's game is its own: one invalid move, still running


def test_explicit_target_and_reward_breakdown(environment_module: ModuleType) -> None:
    env = environment_module.WordleEnvironment()
    first = env.reset(target="abbey", episode_id="ep-1")
    assert (first.done, first.reward, first.guesses_left, first.target) == (False, 0.0, 6, None)
    assert first.messages[0].content == first.prompt
    observation = _play(env, "[babes]")
    assert observation.feedback == ["YYGGX"] and observation.reward == pytest.approx(0.6)
    assert observation.reward_breakdown == observation.metadata["reward_breakdown"]
    assert observation.reward_breakdown["greens"] == pytest.approx(0.4)
    assert env.state.episode_id == "ep-1" and env.state.target is None
    assert env.state.guesses == ["babes"] and env.state.step_count == 1
    observation = _play(env, "[abbey]")
    assert observation.done and observation.won and observation.target == "abbey"
    assert env.state.target == "abbey" and not env.state.game_active


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"seed": "7"}, "seed must be an integer"),
        ({"seed": True}, "seed must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": -1}, "seed must be an integer"),
        ({"seed": 2**63}, "seed must be an integer"),
        ({"seed": 10**5000}, r"seed must be an integer .* of about 5001 digits"),
        ({"seed": {"a": [1]}}, "seed must be an integer"),
        ({"target": "qwert"}, "target must be"),
        ({"target": 12345}, "target must be"),
        ({"seed": 1, "target": "crane"}, "either seed or target"),
        ({"episode_id": 5}, "episode_id must be"),
        ({"episode_id": "x" * 300}, "episode_id must be"),
        ({"episode_id": "\ud800"}, "episode_id must be"),
        ({"sed": 1}, "unknown reset option"),
    ],
)
def test_bad_reset_options_raise_with_a_clear_message(
    environment_module: ModuleType, options: dict[str, object], match: str
) -> None:
    env = environment_module.WordleEnvironment()
    with pytest.raises(environment_module.WordleResetError, match=match):
        env.reset(**options)
    # The environment is still usable afterwards.
    assert env.reset(target="crane").guesses_left == 6


def test_step_before_reset_after_end_and_after_close(environment_module: ModuleType) -> None:
    env = environment_module.WordleEnvironment()
    before = _play(env, "[crane]")
    assert (before.error_code, before.done, before.reward) == ("no_active_game", True, 0.0)
    env.reset(target="crane")
    _play(env, "[crane]")
    after = _play(env, "[slate]")
    assert (after.error_code, after.done, after.reward, after.guesses) == (
        "game_over",
        True,
        1.0,
        ["crane"],
    )
    env.reset(target="crane")
    env.close()
    closed = _play(env, "[slate]")
    assert (closed.error_code, closed.done) == ("session_closed", True)
    with pytest.raises(environment_module.WordleResetError, match="closed"):
        env.reset()


def test_invalid_moves_are_reported_in_the_observation(environment_module: ModuleType) -> None:
    env = environment_module.WordleEnvironment()
    env.reset(target="crane")
    first = _play(env, "[cranes]")
    assert (first.error_code, first.done, first.guesses_left, first.invalid_streak) == (
        "wrong_length",
        False,
        6,
        1,
    )
    assert first.reward_breakdown["valid_format"] == 0.0
    second = _play(env, "[zzzzz]")
    assert (second.error_code, second.done, second.target) == ("not_a_word", True, "crane")


def test_metadata_names_the_environment(environment_module: ModuleType) -> None:
    metadata = environment_module.WordleEnvironment().get_metadata()
    assert metadata.name == "wordle"
    assert metadata.readme_content is not None and "sdk: docker" in metadata.readme_content
