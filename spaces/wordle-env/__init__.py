"""Wordle for the trainer and the wordle-env Space: rules, word lists, wire models, client.

Import the submodule you need; this package imports nothing itself, so ``import
wordle_env.rules`` stays light (standard library only):

- ``rules``: feedback with the duplicate-letter rule, ``[word]`` extraction, move validity,
  the reward formula and the shaped-reward breakdown. No third-party imports.
- ``wordlists``: the shipped answer and allowed-guess lists, and the seed -> target mapping.
- ``game``: ``WordleGame``, one game as a state machine over the rules (no I/O).
- ``models``: the Pydantic wire models (imports openenv, which is heavy).
- ``client``: ``WordleEnv``, the OpenEnv WebSocket client (imports openenv).
"""
