"""Pydantic wire models of the Wordle environment, on openenv's Action/Observation/State.

Extra fields are forbidden everywhere, so a client and a server of different versions fail
loudly instead of dropping data. The action and the ``prompt``/``messages`` fields match
OpenEnv's TextArena environment (``TextArenaAction(message=...)``,
``observation.messages[0].content``), so clients written for the public Wordle Space work here.

Wire note: openenv 0.3 dropped ``Observation.metadata`` on the wire (0.10 sends it as
``data.metadata``); the shaped-reward breakdown travels as the ``reward_breakdown`` field, which
every version carries, and is also put in ``metadata["reward_breakdown"]`` for in-process users.
"""

from __future__ import annotations

from typing import Literal

from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, ConfigDict, Field

# ``error_code`` values besides ``wordle_env.rules.INVALID_MOVE_CODES``:
NO_ACTIVE_GAME = "no_active_game"  # step before any reset (or on the stateless HTTP /step)
GAME_OVER = "game_over"  # step after the game ended
SESSION_CLOSED = "session_closed"  # step on an environment the server already closed

ErrorCode = Literal[
    "no_guess_found",
    "not_ascii_letters",
    "wrong_length",
    "repeated_guess",
    "not_a_word",
    "no_active_game",
    "game_over",
    "session_closed",
]


class WordleAction(Action):
    """One player message; the guess is the first ``[word]`` in it.

    Attributes:
        message: free text, e.g. ``"[crane]"`` or ``"I think it is [crane]"``.
    """

    message: str = Field(description="Player text; the guess is the first [word] in it.")


class WordleMessage(BaseModel):
    """One message of the game log, shaped like TextArena's messages.

    Attributes:
        sender_id: -1 for the game.
        content: the text.
        category: ``"GAME"``.
    """

    model_config = ConfigDict(extra="forbid")

    sender_id: int = -1
    content: str
    category: str = "GAME"


class WordleObservation(Observation):
    """What the player sees after ``reset`` or ``step``.

    ``reward`` is the game's reward so far (``rules.game_reward``: 1.0 for a win, else partial
    credit of the last accepted guess); it is final when ``done``.

    Attributes:
        prompt: the game instructions (the same for every step).
        messages: one message whose content is the whole transcript so far (prompt, then
            each reply), as TextArena's Wordle sends it; empty when no game is running.
        reply: the game's answer to the last message (the text the step appended).
        guesses: accepted guesses so far, lowercase.
        feedback: ``G``/``Y``/``X`` strings, one per accepted guess.
        guesses_left: accepted guesses still available (0 to 6).
        invalid_streak: invalid moves in a row so far (a second one ends the game).
        won: whether the target was guessed.
        target: the secret word, revealed only once the game is over.
        error_code: why the last message was not accepted (see ``ErrorCode``), else None.
        error: the same as a sentence: what was expected, what was found, how to fix it.
        reward_breakdown: shaped signals of the last move (``rules.RewardBreakdown``
            fields; empty after reset).
    """

    prompt: str = ""
    messages: list[WordleMessage] = Field(default_factory=list)
    reply: str = ""
    guesses: list[str] = Field(default_factory=list)
    feedback: list[str] = Field(default_factory=list)
    guesses_left: int = Field(default=6, ge=0)
    invalid_streak: int = Field(default=0, ge=0)
    won: bool = False
    target: str | None = None
    error_code: ErrorCode | None = None
    error: str | None = None
    reward_breakdown: dict[str, float] = Field(default_factory=dict)


class WordleState(State):
    """Server-side state of one session (``GET``-able through the ``state`` message).

    Attributes:
        episode_id: id of the current game (from ``reset(episode_id=...)`` or a UUID).
        step_count: messages played in the current game, valid or not.
        seed: the seed of the current game, None when the target came from elsewhere.
        guesses: accepted guesses so far.
        feedback: ``G``/``Y``/``X`` strings, one per accepted guess.
        invalid_streak: invalid moves in a row so far.
        game_active: whether a game is running (reset done and not over).
        done: whether the current game is over.
        won: whether the current game was won.
        target: the secret word, revealed only once the game is over.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    seed: int | None = None
    guesses: list[str] = Field(default_factory=list)
    feedback: list[str] = Field(default_factory=list)
    invalid_streak: int = Field(default=0, ge=0)
    game_active: bool = False
    done: bool = False
    won: bool = False
    target: str | None = None
