"""The rollout fleet: the replicas TRL's rollouts go to, as the trainer sees them.

Owns the pool of replicas with their health and served versions (``pool``), the local HTTP router
TRL talks to (``router``), the episode affinity that keeps a game's turns on one replica
(``affinity``) and the record of which version answered each turn. The per-sample staleness
stamps that use that record are TRL's side, ``trainer.loop.rollout_tagging``.
"""
