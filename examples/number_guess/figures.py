"""The number-guessing task's own figures: counts of one episode read from its messages
(:func:`episode_counts`), summed over a training step's games or over the held-out episodes of an
evaluation, and the figures made of them (:func:`step_figures`, :func:`eval_figures`), declared
in :data:`FIGURES` for the step line, the summary and the dashboard.

A guess *follows the feedback* when it lies in the range every earlier answer left (above each
number answered ``higher``, below each ``lower``); the first guess of a game is not checked.
"""

from __future__ import annotations

from collections import Counter

from deltasync.status import TaskFigure
from examples.number_guess.env import parse_reply


def episode_counts(completion: list) -> dict[str, int]:
    """One episode's counts from its messages after the prompt (the tool replies): ``guesses``
    in range, ``out_of_range`` moves, ``solved`` (0 or 1), ``checked`` guesses (the 2nd on) and
    those ``consistent`` with the feedback before them."""
    counts = Counter(guesses=0, out_of_range=0, solved=0, checked=0, consistent=0)
    low, high = float("-inf"), float("inf")
    for message in completion:
        parsed = parse_reply(message.get("content")) if message.get("role") == "tool" else None
        if parsed is None:
            continue
        feedback, number = parsed
        if feedback == "out_of_range":
            counts["out_of_range"] += 1
            continue
        if counts["guesses"]:
            counts["checked"] += 1
            counts["consistent"] += int(low < number < high)
        counts["guesses"] += 1
        counts["solved"] += int(feedback == "correct")
        if feedback == "higher":
            low = max(low, number)
        elif feedback == "lower":
            high = min(high, number)
    return dict(counts)


def step_figures(counts: dict[str, int], games: int) -> dict:
    """The figures of ``games`` episodes from their summed :func:`episode_counts` (None where
    nothing was counted)."""
    moves = counts.get("guesses", 0) + counts.get("out_of_range", 0)
    checked = counts.get("checked", 0)
    return {
        "solved_rate": round(counts.get("solved", 0) / games, 4) if games else None,
        "consistent_rate": round(counts.get("consistent", 0) / checked, 4) if checked else None,
        "guesses_mean": round(moves / games, 3) if games else None,
        "out_of_range_rate": round(counts.get("out_of_range", 0) / moves, 4) if moves else None,
    }


def eval_figures(episodes: list) -> dict:
    """An evaluation's figures (``Task.eval_figures``): :func:`step_figures` of its held-out
    episodes (``trainer.task.base.ToolEpisode``: their messages after the prompt)."""
    total: Counter = Counter()
    for episode in episodes:
        total.update(episode_counts(episode.messages))
    return step_figures(dict(total), len(episodes))


def _share(name: str, label: str, better: bool = True, **where) -> TaskFigure:
    return TaskFigure(name=name, label=label, unit="share", higher_is_better=better, **where)


# In the order the step line, the summary and the dashboard show them; the headline ones are drawn
# on the learning curve.
FIGURES = (
    _share("solved_rate", "solved", headline=True),
    _share("consistent_rate", "follows the feedback", headline=True),
    TaskFigure(name="guesses_mean", label="guesses a game", unit="guesses", higher_is_better=None),
    _share("out_of_range_rate", "out of range", better=False),
)
