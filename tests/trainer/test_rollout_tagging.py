"""Truthful staleness (trainer.loop.rollout_tagging): rollouts are stamped with the TRL version of the
bucket version the replica serves, and consumed samples feed the staleness histogram."""

import queue
from types import SimpleNamespace

import numpy as np

from trainer.loop.rollout_tagging import ReplicaVersionTagger


def _sample(model_version: int) -> SimpleNamespace:
    """A RolloutSample's fields that the tagger reads (one trained token, an empty episode)."""
    return SimpleNamespace(
        model_version=model_version,
        group_id=0,
        completion=[],
        input_ids=np.arange(2),
        completion_mask=np.array([0, 1]),
        metrics={"reward": 0.0},
    )


class FakeWorker:
    def __init__(self):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()
        self.stamped = []
        self.started = self.stopped = False

    def start(self):
        self.started = True

    def stop(self):
        self.stopped = True

    def check_health(self, stale_after_s):
        pass

    def update_model_version(self, v):
        self.stamped.append(v)


def test_tags_follow_the_replica_not_the_trainer():
    inner = FakeWorker()
    state = {"published": None, "replica": None}
    tagger = ReplicaVersionTagger(
        inner, lambda: state["published"], lambda: state["replica"], poll_s=3600
    )
    # TRL: first sync publishes bucket v10 (a restarted run), then model_version = 1
    state["published"] = 10
    tagger.update_model_version(1)
    assert inner.stamped[-1] == 0  # the replica has not applied anything yet
    state["replica"] = 10
    state["published"] = 11
    tagger.update_model_version(2)  # trainer moved on; the replica still serves v10
    assert inner.stamped[-1] == 1
    state["replica"] = 11
    tagger._retag()
    assert inner.stamped[-1] == 2
    assert tagger.tag_for(None) == 0 and tagger.tag_for(9) == 0 and tagger.tag_for(12) == 2


def test_consumed_samples_fill_the_staleness_histogram():
    inner = FakeWorker()
    tagger = ReplicaVersionTagger(inner, lambda: None, lambda: None, poll_s=3600)
    tagger.trl_version = 5
    for v in (5, 4, 4, 2):
        inner.rollout_buffer.put(_sample(v))
    got = [tagger.rollout_buffer.get(timeout=1).model_version for _ in range(4)]
    assert got == [5, 4, 4, 2]
    assert dict(tagger.staleness) == {0: 1, 1: 2, 3: 1}
    assert tagger.rollout_buffer.qsize() == 0  # other queue methods pass through
