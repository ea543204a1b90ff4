"""The board the trainer adds to each tool reply: its constraints follow the environment's rules,
every item is one token of the local tokenizer, consistency is judged by the rules, and the
spelling init makes the board score the words that fit it above those that do not."""

import random

import pytest

from trainer.task.wordle import board
from trainer.task.wordle import model as wordle_model
from trainer.task.wordle.game_env import EpisodeStats, tool_reply
from wordle_env import rules, wordlists
from wordle_env.game import WordleGame


def _played(target: str, words: list[str]) -> WordleGame:
    game = WordleGame(target)
    for w in words:
        game.play(f"[{w}]")
    return game


def test_constraints_follow_the_feedback_rows():
    game = _played("crane", ["react"])  # feedback YYGYX
    c = board.constraints(game.guesses, game.marks)
    assert c.known == ((3, "a"),)
    assert c.present == ("c", "e", "r")
    assert c.absent == ("t",)
    # a letter grey in one place but green elsewhere is not absent ("eerie" on "crane": e5 green)
    game = _played("crane", ["eerie"])
    c = board.constraints(game.guesses, game.marks)
    assert (5, "e") in c.known and "e" not in c.absent


def test_tool_reply_keeps_the_environment_text_and_adds_the_board():
    game = _played("crane", ["react", "slate"])
    reply = tool_reply("ENV TEXT", False, game.guesses, game.marks)
    assert reply.startswith("ENV TEXT\n")
    assert "Letters: s1 grey, l2 grey, a3 green, t4 grey, e5 green,\n" in reply
    assert "Tried: react, slate." in reply
    assert "s not in word" in reply and "a at 3" in reply
    # nothing to decide once the game is over; before the first guess there is no board
    assert tool_reply("ENV TEXT", True, game.guesses, game.marks) == "ENV TEXT Game over."
    assert tool_reply("ENV TEXT", False) == "ENV TEXT"


@pytest.mark.parametrize("seed", range(20))
def test_consistency_agrees_with_the_candidates_the_rules_leave(seed):
    """A guess is consistent exactly when the environment's feedback of every earlier guess
    against it equals the feedback that guess got: the set of consistent answers is the set a
    solver keeps."""
    rng = random.Random(seed)
    answers = wordlists.answers()
    target = rng.choice(answers)
    game = _played(target, rng.sample(answers, 2))
    consistent = {w for w in answers if board.is_consistent(w, game.guesses, game.marks)}
    if not game.won:
        assert target in consistent
    for w in rng.sample(answers, 200):
        fits = all(rules.feedback(g, w) == m for g, m in zip(game.guesses, game.marks, strict=True))
        assert (w in consistent) == (fits and w not in game.guesses)


def test_episode_stats_count_consistent_later_guesses():
    class Obs:  # the fields of a WordleObservation that EpisodeStats reads
        def __init__(self, game):
            self.done, self.won, self.error_code = game.done, game.won, None
            self.guesses, self.feedback = list(game.guesses), list(game.marks)

    game, stats = WordleGame("crane"), EpisodeStats()
    for w in ["react", "trace", "crane"]:  # trace: c at 4 would be green -> inconsistent
        game.play(f"[{w}]")
        stats.record(Obs(game))
    assert (stats.checked, stats.consistent) == (2, 1)


def test_every_board_item_is_one_token(tokenizer):
    game = _played("fuzzy", ["crane", "split", "bogey", "wimpy"])
    text = board.render(game.guesses, game.marks)
    pieces = [tokenizer.decode([i]) for i in tokenizer(text, add_special_tokens=False).input_ids]
    assert "".join(pieces) == text
    items = set(board.item_tokens())
    shown = [p for p in pieces if p in items]
    c = board.constraints(game.guesses, game.marks)
    assert len(shown) == 5 + len(c.known) + len(c.present) + len(c.absent)
    assert len(items) == 5 * 26 * 3 + 5 * 26 + 26 + 26


def test_spelling_init_scores_fitting_words_above_the_rest(tokenizer):
    """Before any training, the mean of a board's item embeddings dotted with the answers' output
    rows ranks the words consistent with that board above the others (the point of the init)."""
    import torch

    model = wordle_model.build_model(tokenizer, seed=0, hidden_size=192, layers=1)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    answers = wordlists.answers()
    answer_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list(answers)))
    rng = random.Random(1)
    wins = 0
    for _ in range(20):
        game = _played(rng.choice(answers), rng.sample(answers, 2))
        text = board.render(game.guesses, game.marks)
        ids = [i for i in tokenizer(text).input_ids if tokenizer.decode([i]) in board.item_tokens()]
        scores = head[answer_ids] @ embed[ids].mean(0)
        fits = torch.tensor([board.is_consistent(w, game.guesses, game.marks) for w in answers])
        if fits.any() and (~fits).any():
            wins += bool(scores[fits].mean() > scores[~fits].mean())
    assert wins >= 18
    random_model = wordle_model.build_model(tokenizer, seed=0, hidden_size=192, init="random")
    assert not torch.equal(
        random_model.get_output_embeddings().weight[answer_ids], head[answer_ids]
    )
