"""A stochastic Wordle solver whose games are the warm start's supervised transcripts.

The solver keeps the answers still consistent with every feedback row (``rules.feedback`` of the
project's own rules). The first guess is drawn from the ``n_openers`` best words of the whole
answer list (scored by how common their distinct letters are); every later guess is, by default,
a uniformly random consistent answer (``top_k=None``), or one of the ``top_k`` best-scored ones.
Randomness matters: a GRPO group needs different games from one policy, and a teacher that picks
among a few best words teaches a narrow, partly arbitrary preference that the student cannot learn
from the board alone (round 2: its SFT loss floor was that randomness, and the student did not
read the feedback). The uniform teacher's lesson is exactly "play a word that fits the board",
and it leaves GRPO room to learn which consistent words are better (its own win rate is 0.93;
against the top-3 teacher, the student's consistent share 0.47 vs 0.34: docs/BENCHMARKS.md
section 6).

Measured with ``python -m trainer.task.wordle.solver`` (4,000 games, 2-core machine): see the note
in docs/BENCHMARKS.md (win rate about 0.95, about 4 guesses per game).
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
    top_k: int | None = None,
    n_openers: int = 7,
    explore: float = 0.0,
):
    """Play ``game`` to its end with the stochastic solver; yields each move's result.

    An explored move first draws one number it does not use: the draw of a removed option (a
    repeated word, never used by a run). It is kept so that a seed plays the games it played
    before, and the default warm start stays the one every recorded run trained from (without
    it, the default drew other teacher games and its model won 0.36 of the held-out games, not
    0.41; docs/JOURNAL.md, "The teacher's draw").

    Args:
        game: a fresh :class:`~wordle_env.game.WordleGame`.
        rng: the random source (seed it for reproducible games).
        top_k: the solver picks uniformly among this many best consistent words; None: among all
            of them.
        n_openers: the first guess is drawn from this many best openers.
        explore: probability that a later guess is a random answer not yet played instead (a
            weak player's move): games then look like a learner's own, longer and less consistent.

    Yields:
        ``(guess, MoveResult, explored, options)`` for every move, the last one ends the game;
        ``options`` are the words the guess was drawn from, uniformly: the teacher's whole
        distribution for that move (the warm start's soft target); empty for an explored move.
    """
    candidates = list(wordlists.answers())
    while not game.done:
        explored = bool(game.guesses) and rng.random() < explore
        if not game.guesses:
            options = openers()[:n_openers]
        elif explored:  # not a lesson: no options
            rng.random()  # the draw of a removed option, kept: the teacher's games stay the same
            options, guess = (), rng.choice(wordlists.answers())
            while guess in game.guesses:
                guess = rng.choice(wordlists.answers())
        elif top_k is None:
            options = tuple(candidates)
        else:
            options = tuple(w for _, w in _scores(candidates)[:top_k])
        if options:
            guess = rng.choice(options)
        result = game.play(f"[{guess}]")
        yield guess, result, explored, options
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
