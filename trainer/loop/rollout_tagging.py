"""Truthful staleness: tag rollouts with the policy version that really generated them.

TRL's rollout worker stamps each new rollout group with the version the TRAINER last synced. With
pull-based replicas the server may still serve an older version after a publish, so that stamp
overstates freshness. :class:`ReplicaVersionTagger` wraps TRL's worker and, instead, stamps new
groups with the oldest version the fleet serves (``replica_version_fn``), and then, as the trainer
takes each sample from the queue, re-stamps it with the oldest version that answered any of its
turns (``sample_versions_fn``: the router's record of each answer's ``X-Deltasync-Version``),
translated to TRL's numbering; TRL's ``max_staleness`` then drops samples by their true age. It
also keeps the staleness histogram of every sample the trainer took from the queue; those above
``max_staleness`` are the ones TRL dropped.

It also counts the training games: each episode the trainer kept (not dropped as stale) and that
was scored, once, with the task's counts of it (``Task.episode_counts``, read from the episode's
messages: e.g. Wordle's consistent guesses), per step (:meth:`ReplicaVersionTagger.take_games`) and
in all (``games_total``); and the dropped episodes: kept ones that got no reward (the
environment failed them, e.g. a Wordle server that stayed unreachable: ``reward`` None, which TRL
turns into NaN and trains on with advantage 0), once each, per step and in all
(``dropped_total``).
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("trainer.loop.rollout_tagging")


@dataclass
class GameTally:
    """Training games counted together (one step's, or since the start).

    Attributes:
        games: episodes.
        counts: the task's counts of those episodes, summed (``Task.episode_counts``: e.g.
            Wordle's accepted guesses and invalid moves by code).
        dropped: episodes the environment failed (no reward), not among ``games``.
    """

    games: int = 0
    counts: Counter = field(default_factory=Counter)
    dropped: int = 0


@dataclass
class _Episode:
    """The episode of the last consumed sample: its group, messages, and where the trained tokens
    of its last row start (``lead``: tokens of context before them)."""

    group_id: int
    completion: list
    lead: int
    counted: bool = False


def _lead(sample) -> int:
    """Context tokens before a row's first trained token."""
    return int(np.argmax(np.asarray(sample.completion_mask) > 0))


def _scored(sample) -> bool:
    """Whether the sample's episode got a reward (TRL turns an unscored one into NaN)."""
    reward = sample.metrics.get("reward")
    return isinstance(reward, (int, float)) and math.isfinite(reward)


class _CountingQueue:
    """The rollout queue as TRL's dataset sees it; records each consumed sample's staleness and
    counts its episode."""

    def __init__(self, inner, tagger: ReplicaVersionTagger):
        self._inner = inner
        self._tagger = tagger

    def get(self, *args, **kwargs):
        sample = self._inner.get(*args, **kwargs)
        self._tagger.retag(sample)
        staleness = self._tagger.record(sample.model_version)
        max_staleness = self._tagger.max_staleness
        self._tagger.observe(sample, kept=max_staleness is None or staleness <= max_staleness)
        return sample

    def __getattr__(self, name):  # put_nowait, qsize, ... unchanged
        return getattr(self._inner, name)


class ReplicaVersionTagger:
    """Implements TRL's ``RolloutWorkerProtocol`` around TRL's own worker.

    Args:
        inner: TRL's ``AsyncRolloutWorker``.
        published_version_fn: returns the bucket version of the last publish (after TRL's sync).
        replica_version_fn: returns the bucket version the replica serves, or None.
        poll_s: seconds between replica polls.
        max_staleness: TRL's setting; consumed samples staler than this are the dropped ones.
        sample_versions_fn: a sample's token ids -> the bucket versions that answered its turns
            (``trainer.fleet.affinity.EpisodeAffinity.versions_of``), or None: group tags stand.
        episode_counts: ``f(completion) -> {name: count}`` of one training episode (the task's
            ``episode_counts``), or None: games are counted without figures.
    """

    def __init__(
        self,
        inner,
        published_version_fn: Callable[[], int | None],
        replica_version_fn: Callable[[], int | None],
        poll_s: float = 0.25,
        max_staleness: int | None = None,
        sample_versions_fn: Callable[[list[int]], list[int]] | None = None,
        episode_counts: Callable[[list], dict[str, int]] | None = None,
    ):
        self.max_staleness = max_staleness
        self._episode_counts = episode_counts
        self._sample_versions_fn = sample_versions_fn
        self.per_sample_tags = 0  # samples re-stamped from their own answers' versions
        self.inner = inner
        self.metrics_queue = inner.metrics_queue
        self.rollout_buffer = _CountingQueue(inner.rollout_buffer, self)
        self._published_version_fn = published_version_fn
        self._replica_version_fn = replica_version_fn
        self._poll_s = poll_s
        self._pub: list[int] = []  # bucket versions, ascending
        self._trl: list[int] = []  # the TRL model_version of each
        self.trl_version = 0
        self.replica_version: int | None = None
        self.staleness = Counter()  # TRL versions behind, for each consumed sample
        self.games_total = 0  # training games (kept, scored episodes), each counted once
        self.dropped_total = 0  # kept episodes without a reward (the environment failed them)
        self._games = GameTally()  # since the last take_games()
        self._episode: _Episode | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="replica-version", daemon=True)

    def start(self) -> None:
        self._retag()
        self.inner.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inner.stop()

    def check_health(self, stale_after_s: float) -> None:
        self.inner.check_health(stale_after_s)

    def update_model_version(self, model_version: int) -> None:
        """TRL's call after each sync: remember which bucket version TRL version N is."""
        pub = self._published_version_fn()
        with self._lock:
            self.trl_version = model_version
            if pub is not None and (not self._pub or pub > self._pub[-1]):
                self._pub.append(pub)
                self._trl.append(model_version)
        self._retag()

    def tag_for(self, replica_version: int | None) -> int:
        """TRL version of the newest publish at or before ``replica_version`` (0 if none)."""
        with self._lock:
            if replica_version is None:
                return 0
            i = bisect.bisect_right(self._pub, replica_version)
            return self._trl[i - 1] if i else 0

    @property
    def dropped(self) -> int:
        """Consumed samples TRL discarded as stale (0 when ``max_staleness`` is unknown)."""
        if self.max_staleness is None:
            return 0
        return sum(n for s, n in self.staleness.items() if s > self.max_staleness)

    def left_in_queue(self) -> int:
        """Scored samples still waiting in the rollout queue (approximate, as ``qsize`` is)."""
        return self.rollout_buffer.qsize()

    def retag(self, sample) -> None:
        """Stamp a sample with the TRL version of the oldest bucket version that answered any of
        its turns, where the router remembers them (else its group's stamp stands)."""
        if self._sample_versions_fn is None:
            return
        versions = self._sample_versions_fn([int(t) for t in sample.input_ids])
        if versions:
            sample.model_version = self.tag_for(min(versions))
            self.per_sample_tags += 1

    def record(self, sample_version: int) -> int:
        """Count a consumed sample in the staleness histogram; returns its staleness."""
        staleness = max(0, self.trl_version - int(sample_version))
        self.staleness[staleness] += 1
        return staleness

    def observe(self, sample, kept: bool) -> None:
        """Count the episode of a consumed sample, once, if the trainer ``kept`` one of its rows
        and it was scored.

        TRL makes one or more rows (samples) per episode and puts them into the queue one after
        the other, but the samples do not say which episode they come from. A sample continues
        the previous one's episode when it has the same group and messages and its trained
        tokens start later (a fork row begins at a later turn); the first row of an episode
        starts right after the group's shared prompt, so two episodes with the same messages in
        one group are still told apart.
        """
        ep, lead = self._episode, _lead(sample)
        if (
            ep is None
            or ep.group_id != sample.group_id
            or lead <= ep.lead
            or ep.completion != sample.completion
        ):
            ep = self._episode = _Episode(sample.group_id, sample.completion, lead)
        ep.lead = lead
        if not kept or ep.counted:
            return
        ep.counted = True
        if not _scored(sample):
            with self._lock:
                self.dropped_total += 1
                self._games.dropped += 1
            return
        counts = self._episode_counts(sample.completion) if self._episode_counts else {}
        with self._lock:
            self.games_total += 1
            self._games.games += 1
            self._games.counts.update(counts)

    def summary(self) -> dict:
        """The tagger's part of the run's summary: the staleness histogram of the samples the
        trainer took, how many were dropped as stale, the training games."""
        return {
            "staleness": dict(sorted(self.staleness.items())),
            "staleness_dropped": self.dropped,
            "per_sample_tags": self.per_sample_tags,
            "train_games": self.games_total,
            "dropped_episodes": self.dropped_total,
        }

    def take_games(self) -> GameTally:
        """The training games counted since the last call (the step just logged), and reset."""
        with self._lock:
            games, self._games = self._games, GameTally()
        return games

    def _retag(self) -> None:
        try:
            self.replica_version = self._replica_version_fn()
        except Exception as e:  # a missed poll keeps the previous tag; logged, retried next poll
            log.warning("could not read the replica's version: %r", e)
            return
        self.inner.update_model_version(self.tag_for(self.replica_version))

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._retag()
