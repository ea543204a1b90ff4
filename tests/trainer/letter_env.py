"""A second, different environment for the task seam's test: a single-turn letter puzzle served by
openenv's ``create_app`` on 127.0.0.1 (run as ``python letter_env.py``, ``PORT`` from the
environment).

Episode ``seed`` asks for a 5-letter word containing the letter ``LETTERS[seed % 26]``. One
``step`` scores an answer: reward 1.0 when the last 5-letter word of the message contains the
letter, else 0.0, and the episode is done. The step carries its seed, so openenv's stateless HTTP
``/step`` scores it; ``GET /stats`` says how many answers were scored.
"""

from __future__ import annotations

import os
import re
import string

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LETTERS = string.ascii_lowercase
WORD = re.compile(r"(?<![a-z])[a-z]{5}(?![a-z])")
SCORED = {"answers": 0, "rewarded": 0}


def letter_for(seed: int) -> str:
    """The letter episode ``seed`` asks for."""
    return LETTERS[seed % len(LETTERS)]


class LetterAction(Action):
    """An answer to the puzzle of episode ``seed``."""

    seed: int
    message: str


class LetterObservation(Observation):
    """The puzzle's letter and, after a step, the word that was scored (None: none found)."""

    letter: str = ""
    word: str | None = None


class LetterEnvironment(Environment[LetterAction, LetterObservation, State]):
    """One puzzle per episode; ``step`` scores one answer and ends the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, **kwargs) -> LetterObservation:
        return LetterObservation(letter=letter_for(seed or 0), reward=0.0, done=False)

    def step(self, action: LetterAction, **kwargs) -> LetterObservation:
        letter = letter_for(action.seed)
        words = WORD.findall(action.message.lower())
        word = words[-1] if words else None
        reward = 1.0 if word is not None and letter in word else 0.0
        SCORED["answers"] += 1
        SCORED["rewarded"] += int(reward > 0)
        return LetterObservation(letter=letter, word=word, reward=reward, done=True)

    @property
    def state(self) -> State:
        return State()


app = create_app(LetterEnvironment, LetterAction, LetterObservation, env_name="letter")
app.add_api_route("/stats", lambda: dict(SCORED), methods=["GET"])

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]), log_level="warning")
