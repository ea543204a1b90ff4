"""The local model's tokenizer and the Wordle conversation format: what the warm start trains on is
token for token what the rollout renders, every word is one token, and the reward never pays for
stopping early or for a bad move."""

import random

import pytest

from trainer.task.wordle import model as wordle_model
from trainer.task.wordle import warm_start
from trainer.task.wordle.game_env import (
    GRPO_SHARE,
    INVALID_PENALTY,
    MAX_TURNS,
    RESET_TEXT,
    REWARD_VAR,
    STOPPED_EARLY_PENALTY,
    EpisodeStats,
    call_message,
    episode_reward,
    grpo_targets,
    guess_tool,
    held_out_targets,
    make_dataset,
    parse_call,
    prompt_messages,
    reward_kind,
    warm_start_targets,
)
from wordle_env import wordlists
from wordle_env.game import WordleGame


@pytest.fixture(scope="module")
def games():
    return warm_start.solver_games(60, seed=3)


@pytest.fixture(scope="module")
def tokenizer(games):
    from trainer.task.char_model import make_char_tokenizer

    renderer = make_char_tokenizer(wordle_model.chat_template())
    return wordle_model.build_tokenizer([warm_start.render(g, renderer) for g in games])


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_every_answer_is_one_token_and_every_allowed_word_round_trips(tokenizer):
    answers = set(wordlists.answers())
    for word in sorted(wordlists.allowed_guesses()):
        ids = _ids(tokenizer, word)
        assert tokenizer.decode(ids) == word
        if word in answers:
            assert len(ids) == 1, word
    # a word token is matched on word boundaries only: "cranes" is not "crane" + "s"
    assert tokenizer.decode(_ids(tokenizer, "[cranes]")) == "[cranes]"


def test_tool_call_and_prompt_fit_the_turn_and_context(tokenizer):
    call = '<tool_call>\n{"name": "guess", "arguments": {"word": "crane"}}\n</tool_call><|im_end|>'
    ids = _ids(tokenizer, call)
    assert tokenizer.decode(ids, skip_special_tokens=False) == call
    assert len(ids) <= 16
    from trainer.config import GRPOSettings

    assert len(ids) <= GRPOSettings.max_completion_length
    prompt = prompt_messages()
    prompt[-1]["content"] += RESET_TEXT
    first = tokenizer.apply_chat_template(
        prompt,
        tools=[guess_tool()],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        enable_thinking=False,
    )
    assert len(first) <= 400


def test_a_guess_call_is_four_tokens_as_generated_and_as_rendered(tokenizer):
    """The replica decodes 4 tokens per turn (the text before the word, the word, the text after
    it, end of turn), and the chat template's rendering of the same call tokenizes to them too,
    so TRL's rollout (which re-renders each turn) trains on what was sampled."""
    call = '<tool_call>\n{"name": "guess", "arguments": {"word": "crane"}}\n</tool_call><|im_end|>'
    ids = _ids(tokenizer, call)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        wordle_model.CALL_OPEN,
        "crane",
        wordle_model.CALL_CLOSE,
        "<|im_end|>",
    ]
    text = tokenizer.apply_chat_template(
        [*prompt_messages(), call_message("crane")], tools=[guess_tool()], tokenize=False
    )
    assert call in text
    assert parse_call(tokenizer.decode(ids, skip_special_tokens=False)) == "crane"


def test_transcript_is_prefix_consistent_with_rollout_rendering(games, tokenizer):
    """At every assistant turn, the prompt the rollout renders (add_generation_prompt) is a token
    prefix of the SFT transcript, and the masked tokens that follow are that turn's reply."""
    for messages in games[:10]:
        full, mask = warm_start.encode_with_mask(warm_start.render(messages, tokenizer), tokenizer)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert sum(mask) > 0
        for i in turns:
            prefix = tokenizer.apply_chat_template(
                messages[:i],
                tools=[guess_tool()],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                enable_thinking=False,
            )
            assert full[: len(prefix)] == prefix
            n = len(prefix)
            assert mask[n - 1] == 0 and mask[n] == 1  # the reply starts right after the prompt
            end = n
            while end < len(mask) and mask[end]:
                end += 1
            reply = tokenizer.decode(full[n:end], skip_special_tokens=False)
            assert reply.endswith("<|im_end|>")
            if messages[i].get("tool_calls"):
                word = messages[i]["tool_calls"][0]["function"]["arguments"]["word"]
                assert parse_call(reply) == word


def test_solver_games_avoid_evaluation_words_and_play_to_the_end(games):
    held_out = held_out_targets()
    for messages in games:
        words = [
            m["tool_calls"][0]["function"]["arguments"]["word"]
            for m in messages
            if m.get("tool_calls")
        ]
        assert words and len(set(words)) == len(words)  # no repeated guess
        assert "Game over." in messages[-2]["content"]
        assert all(w in wordlists.allowed_guesses() for w in words)
        if "You win" in messages[-2]["content"]:  # the last guess is the target
            assert words[-1] not in held_out and words[-1] not in grpo_targets()


def test_warm_start_grpo_and_evaluation_play_three_disjoint_sets_of_targets():
    """The warm start's teacher, GRPO's dataset and the evaluation never share a target word, and
    together they cover every answer; GRPO gets about one in GRPO_SHARE of the rest."""
    held_out, grpo, warm = held_out_targets(), grpo_targets(), set(warm_start_targets())
    assert not held_out & grpo and not held_out & warm and not grpo & warm
    assert held_out | grpo | warm == set(wordlists.answers())
    assert 0.8 / GRPO_SHARE < len(grpo) / (len(grpo) + len(warm)) < 1.2 / GRPO_SHARE
    seeds = make_dataset(300)["seed"]
    played = [wordlists.target_for_seed(s) for s in seeds]
    assert set(played) <= grpo and len(set(played)) > 200  # many distinct words, all GRPO's


def test_the_teacher_plays_each_of_its_targets_once_before_any_again(monkeypatch):
    import wordle_env.game
    from trainer.task.wordle import game_env

    pool = game_env.warm_start_targets()[:10]
    monkeypatch.setattr(game_env, "warm_start_targets", lambda: list(pool))
    targets = []

    class RecordingGame(WordleGame):
        def __init__(self, target, *args, **kwargs):
            targets.append(target)
            super().__init__(target, *args, **kwargs)

    monkeypatch.setattr(wordle_env.game, "WordleGame", RecordingGame)
    assert len(warm_start.solver_games(25, seed=9)) == 25
    assert sorted(targets[:10]) == sorted(pool) and sorted(targets[10:20]) == sorted(pool)
    assert set(targets[20:]) <= set(pool) and len(set(targets[20:])) == 5


@pytest.mark.parametrize(
    "text,word",
    [
        ('<tool_call>\n{"name": "guess", "arguments": {"word": "crane"}}\n</tool_call>', "crane"),
        ('<tool_call>{"name": "guess", "arguments": {"word": ""}}</tool_call>', ""),
        ('<tool_call>\n{"name": "arose"}}\n</tool_call>', None),
        ('<tool_call>\n{"name": "guess", "arguments": {"word": 5}}\n</tool_call>', None),
        ("crane", None),
        ('"}}\n</tool_call>', None),
    ],
)
def test_parse_call(text, word):
    assert parse_call(text) == word


def _play(words: list[str], target: str = "crane") -> EpisodeStats:
    """Stats of an episode that sends ``words`` through the real game rules."""
    from types import SimpleNamespace

    game, stats = WordleGame(target), EpisodeStats()
    for w in words:
        r = game.play(f"[{w}]")
        obs = SimpleNamespace(
            done=game.done,
            won=game.won,
            guesses=list(game.guesses),
            feedback=list(game.marks),
            error_code=None if r.invalid is None else r.invalid.code,
        )
        stats.record(obs)
    return stats


def test_reward_never_pays_for_stopping_early_or_bad_moves():
    rng = random.Random(0)
    pool = sorted(wordlists.allowed_guesses() - {"crane"})
    for _ in range(200):
        words = rng.sample(pool, 6)
        full = _play(words)
        for k in range(1, 6):  # stopping after k guesses (the model wrote no further call)
            assert episode_reward(_play(words[:k])) < episode_reward(full)
        bad = _play(words[:2] + ["zzzzz"])  # an invalid move, then the model stops
        assert episode_reward(bad) < episode_reward(_play(words[:2]))
    assert episode_reward(_play(["slate", "crane"])) == 1.0
    assert episode_reward(_play([])) < 0  # no move at all is worse than any move


def test_a_game_the_call_cap_cut_pays_for_its_invalid_moves_not_for_stopping():
    """Seven calls with two invalid moves apart (five guesses): TRL refuses the model's next call,
    the game is not over, and the model did not stop; stopping one call earlier does pay."""
    words = sorted(wordlists.allowed_guesses() - {"crane"})[:5]
    moves = [words[0], "zzzzz", words[1], "zzzzz", *words[2:]]
    assert len(moves) == MAX_TURNS
    cut = _play(moves)
    assert not cut.done and (cut.accepted, cut.invalid) == (5, 2)
    assert episode_reward(cut) == pytest.approx(cut.best_credit - 2 * INVALID_PENALTY)
    early = _play(moves[:-1])
    assert episode_reward(early) == pytest.approx(
        early.best_credit - 2 * INVALID_PENALTY - STOPPED_EARLY_PENALTY
    )


def test_game_reward_pays_what_the_game_pays_less_the_invalid_moves():
    """``kind="game"``: the game's own reward (the last accepted row's credit, 1 for a win), so a
    player that stops while its last row is good keeps it; invalid moves still cost."""
    rng = random.Random(1)
    pool = sorted(wordlists.allowed_guesses() - {"crane"})
    for _ in range(200):
        words = rng.sample(pool, rng.randint(1, 6))
        game = WordleGame("crane")
        for w in words:
            game.play(f"[{w}]")
        assert episode_reward(_play(words), "game") == pytest.approx(game.reward)
        if len(words) >= 2:
            bad = _play(words[:2] + ["zzzzz"])
            assert episode_reward(bad, "game") == pytest.approx(
                episode_reward(_play(words[:2]), "game") - INVALID_PENALTY
            )
    assert episode_reward(_play(["slate", "crane"]), "game") == 1.0
    # stopping before any accepted guess costs what two invalid moves that end a game cost
    assert episode_reward(_play([]), "game") == pytest.approx(-STOPPED_EARLY_PENALTY)
    assert episode_reward(_play(["zzzzz", "qqqqq"]), "game") == pytest.approx(-2 * INVALID_PENALTY)
    good_then_worse = _play(["crank", "fuzzy"])  # the game pays the last row, not the best
    assert episode_reward(good_then_worse, "game") < episode_reward(_play(["crank"]), "game")


def test_an_unknown_reward_kind_says_which_ones_exist(monkeypatch):
    with pytest.raises(ValueError, match="best, game"):
        episode_reward(_play(["slate"]), "last")
    monkeypatch.setenv(REWARD_VAR, "lats")
    with pytest.raises(ValueError, match="--reward"):
        reward_kind()
    monkeypatch.setenv(REWARD_VAR, "game")
    assert reward_kind() == "game"


def test_call_message_renders_as_the_rollout_parses_it(tokenizer):
    messages = prompt_messages() + [call_message("crane")]
    text = warm_start.render(messages, tokenizer)
    assert parse_call(text.rsplit("<|im_start|>assistant", 1)[1]) == "crane"


def test_soft_targets_are_the_teachers_options_at_each_called_word(tokenizer):
    """The warm start's soft target at each trained call is the set the solver drew the word
    from: it holds the played word, its position is the called word's own token, and every option
    of a later call fits every earlier feedback row."""
    from trainer.task.wordle import board
    from trainer.task.wordle.game_env import solver_conversation

    rng, checked = random.Random(7), 0
    for target in random.Random(8).sample(wordlists.answers(), 15):
        messages = solver_conversation(WordleGame(target), rng, explore=0.3)
        text = warm_start.render(messages, tokenizer)
        ids, mask = warm_start.encode_with_mask(
            text, tokenizer, warm_start._trained_turns(messages)
        )
        targets = warm_start.soft_targets(ids, mask, messages, tokenizer)
        calls = [m for m in messages if m.get("tool_calls") and m["train"]]
        assert len(targets) == len(calls)
        for (pos, option_ids), call in zip(targets, calls, strict=True):
            word = call["tool_calls"][0]["function"]["arguments"]["word"]
            assert tokenizer.decode([ids[pos]]) == word
            assert word in tokenizer.convert_ids_to_tokens(option_ids)
        game = WordleGame(target)
        for m in messages:
            if not m.get("tool_calls"):
                continue
            if game.guesses and m["train"]:
                assert all(board.is_consistent(o, game.guesses, game.marks) for o in m["options"])
                checked += 1
            game.play(f"[{m['tool_calls'][0]['function']['arguments']['word']}]")
    assert checked > 10
