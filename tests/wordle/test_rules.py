"""Wordle rules (``wordle_env.rules``) and word lists (``wordle_env.wordlists``).

Covers: table-driven feedback including repeated letters, ``[word]`` extraction, move
validity, the reward formula and its shaped breakdown, the shipped word lists, the seed ->
target map, and that these modules import nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from wordle_env import rules, wordlists


@pytest.mark.parametrize(
    ("target", "guess", "expected"),
    [
        ("crane", "crane", "GGGGG"),
        ("crane", "moist", "XXXXX"),
        ("crane", "nacre", "YYYYG"),
        # Repeated letters: greens first, then yellows left to right, one per unmatched copy.
        ("abbey", "babes", "YYGGX"),
        ("abbey", "kebab", "XYGYY"),
        ("abbey", "bobby", "YXGXG"),
        ("apple", "ppppp", "XGGXX"),
        ("hello", "lolly", "XYGGX"),
        ("speed", "erase", "YXXYY"),
        ("speed", "geese", "XYGYX"),
        ("robot", "ooooo", "XGXGX"),
        ("eerie", "eeeee", "GGXXG"),
        ("llama", "allay", "YGYYX"),
    ],
)
def test_feedback_table(target: str, guess: str, expected: str) -> None:
    assert rules.feedback(guess, target) == expected


@pytest.mark.parametrize(
    ("guess", "target"),
    [("Crane", "crane"), ("crane", "cran"), ("cr ne", "crane"), ("", ""), ("crané", "crane")],
)
def test_feedback_rejects_non_lowercase_or_mismatched_words(guess: str, target: str) -> None:
    with pytest.raises(ValueError, match="found"):
        rules.feedback(guess, target)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("[crane]", "crane"),
        ("I think it is [Crane].", "crane"),
        ("first [slate] then [crane]", "slate"),
        ("no brackets here", None),
        ("", None),
        ("[]", None),
        ("[cr ne]", None),
        ("[cranes]", "cranes"),
        ("[héllo]", "héllo"),
        ("[12345]", "12345"),
        ("[[crane]]", "crane"),
    ],
)
def test_extract_guess(message: str, expected: str | None) -> None:
    assert rules.extract_guess(message) == expected


ALLOWED = frozenset({"crane", "slate", "abbey", "babes"})


@pytest.mark.parametrize(
    ("token", "previous", "code"),
    [
        (None, [], rules.NO_GUESS_FOUND),
        ("héllo", [], rules.NOT_ASCII_LETTERS),
        ("12345", [], rules.NOT_ASCII_LETTERS),
        ("cranes", [], rules.WRONG_LENGTH),
        ("abc", [], rules.WRONG_LENGTH),
        ("crane", ["crane"], rules.REPEATED_GUESS),
        ("qwert", [], rules.NOT_A_WORD),
        ("crane", ["slate"], None),
    ],
)
def test_check_guess(token: str | None, previous: list[str], code: str | None) -> None:
    verdict = rules.check_guess(token, previous, ALLOWED)
    if code is None:
        assert verdict is None
    else:
        assert verdict is not None and verdict.code == code
        assert "expected" in verdict.reason and "found" in verdict.reason


def test_invalid_reason_does_not_echo_a_huge_token() -> None:
    verdict = rules.check_guess("a" * 50_000, [], ALLOWED)
    assert verdict is not None and verdict.code == rules.WRONG_LENGTH
    assert len(verdict.reason) < 300 and "50000" in verdict.reason


@pytest.mark.parametrize(
    ("won", "last", "expected"),
    [
        (True, "GGGGG", 1.0),
        (False, None, 0.0),
        (False, "XXXXX", 0.0),
        (False, "GXXXX", 0.2),
        (False, "YXXXX", 0.1),
        (False, "GGYYX", 0.6),
        (False, "GGGGY", 0.9),
    ],
)
def test_game_reward(won: bool, last: str | None, expected: float) -> None:
    assert rules.game_reward(won, last) == pytest.approx(expected)


def test_reward_breakdown_of_valid_invalid_and_winning_moves() -> None:
    valid = rules.reward_breakdown("babes", rules.feedback("babes", "abbey"), 0.6)
    assert valid.as_dict() == {
        "greens": pytest.approx(0.4),
        "yellows": pytest.approx(0.4),
        "valid_format": 1.0,
        "valid_guess": 1.0,
        "correct": 0.0,
        "game_reward": 0.6,
    }
    # Well formed but not a word: format 1, guess 0, no letters scored.
    not_a_word = rules.reward_breakdown("qwert", None, 0.0)
    assert (not_a_word.valid_format, not_a_word.valid_guess, not_a_word.greens) == (1.0, 0.0, 0.0)
    assert rules.reward_breakdown(None, None, 0.0).valid_format == 0.0
    assert rules.reward_breakdown("cranes", None, 0.0).valid_format == 0.0
    assert rules.reward_breakdown("abbey", "GGGGG", 1.0).correct == 1.0
    # as_dict is spelled out by hand: it must name exactly the dataclass fields.
    assert list(valid.as_dict()) == [f.name for f in dataclasses.fields(rules.RewardBreakdown)]


def test_word_lists_are_well_formed_and_nested() -> None:
    answers = wordlists.answers()
    allowed = wordlists.allowed_guesses()
    assert list(answers) == sorted(set(answers))
    assert set(answers) <= allowed
    assert len(allowed) > len(answers) > 2000
    assert all(len(w) == rules.WORD_LENGTH and rules.is_lower_ascii_word(w) for w in allowed)
    assert {"crane", "abbey", "apple"} <= set(answers)


def test_target_for_seed_is_deterministic_and_spread() -> None:
    targets = [wordlists.target_for_seed(seed) for seed in range(500)]
    assert targets == [wordlists.target_for_seed(seed) for seed in range(500)]
    assert set(targets) <= set(wordlists.answers())
    assert len(set(targets)) > 400  # 500 draws from ~3,500 words: few collisions
    assert wordlists.target_for_seed(-1) in wordlists.answers()
    assert wordlists.target_for_seed(2**80) in wordlists.answers()


@pytest.mark.parametrize("seed", ["1", 1.0, True, None])
def test_target_for_seed_refuses_non_int_seeds(seed: object) -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        wordlists.target_for_seed(seed)  # type: ignore[arg-type]


def test_target_for_seed_is_the_same_in_a_fresh_process() -> None:
    code = (
        "import json; from wordle_env import wordlists; "
        "print(json.dumps([wordlists.target_for_seed(s) for s in range(20)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert json.loads(out.stdout) == [wordlists.target_for_seed(s) for s in range(20)]


def test_rules_game_and_wordlists_import_nothing_heavy() -> None:
    code = (
        "import sys, json; import wordle_env.rules, wordle_env.wordlists, "
        "wordle_env.game; "
        "print(json.dumps(sorted(m for m in ('openenv', 'torch', 'vllm', 'pydantic', "
        "'fastapi', 'gradio', 'numpy') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert json.loads(out.stdout) == []
