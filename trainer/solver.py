"""A stochastic Wordle solver whose games are the warm start's supervised transcripts.

The solver keeps the answers still consistent with every feedback row (``rules.feedback`` of the
project's own rules) and picks, at random, one of the ``top_k`` best of them, scored by how common
their distinct letters are among the remaining candidates. The first guess is drawn from the
``n_openers`` best words of the whole answer list. Randomness matters: a GRPO group needs
different games from one policy, and a deterministic teacher would teach one game per word.

Measured with ``python -m trainer.solver`` (4,000 games, 2-core machine): see the note in
docs/BENCHMARKS.md (win rate about 0.95, about 4 guesses per game).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache

from wordle_env import rules, wordlists
from wordle_env.game import WordleGame


def _scores(candidates: Sequence[str]) -> list[tuple[float, str]]:
    """(score, word) pairs, best first: the summed frequency of each word's distinct letters
    among ``candidates``."""
    freq = Counter(c for w in candidates for c in set(w))
    return sorted(((sum(freq[c] for c in set(w)), w) for w in candidates), reverse=True)


@lru_cache(maxsize=1)
def openers(n: int = 8) -> tuple[str, ...]:
    """The ``n`` best first guesses over the whole answer list."""
    return tuple(w for _, w in _scores(wordlists.answers())[:n])


def solver_guesses(
    game: WordleGame,
    rng: random.Random,
    top_k: int = 3,
    n_openers: int = 5,
    explore: float = 0.0,
):
    """Play ``game`` to its end with the stochastic solver; yields each move's result.

    Args:
        game: a fresh :class:`~wordle_env.game.WordleGame`.
        rng: the random source (seed it for reproducible games).
        top_k: the solver picks uniformly among this many best consistent words.
        n_openers: the first guess is drawn from this many best openers.
        explore: probability that a later guess is a random answer not yet played instead (a
            weak player's move): games then look like a learner's own, longer and less consistent.

    Yields:
        ``(guess, MoveResult, explored)`` for every move, the last one ends the game.
    """
    candidates = list(wordlists.answers())
    while not game.done:
        explored = bool(game.guesses) and rng.random() < explore
        if not game.guesses:
            guess = rng.choice(openers()[:n_openers])
        elif explored:
            guess = rng.choice(wordlists.answers())
            while guess in game.guesses:
                guess = rng.choice(wordlists.answers())
        else:
            best = _scores(candidates)[:top_k]
            guess = rng.choice(best)[1]
        result = game.play(f"[{guess}]")
        yield guess, result, explored
        if result.marks is not None:
            candidates = [
                w for w in candidates if w != guess and rules.feedback(guess, w) == result.marks
            ]


def main() -> None:
    """Play 4,000 games and print the win rate and mean guesses (a figure for the docs)."""
    import time

    rng = random.Random(0)
    t0 = time.perf_counter()
    wins, guesses, n = 0, 0, 4000
    pool = wordlists.answers()
    for _ in range(n):
        game = WordleGame(rng.choice(pool))
        for _ in solver_guesses(game, rng):
            pass
        wins += game.won
        guesses += len(game.guesses)
    dt = time.perf_counter() - t0
    print(f"{n} games in {dt:.1f}s: win rate {wins / n:.3f}, guesses per game {guesses / n:.2f}")


if __name__ == "__main__":
    main()
