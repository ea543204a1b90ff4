"""The trainer's bucket weight transfer under an adaptive publish cadence (issue 58): with
``PublisherConfig(adaptive_cadence=True, hub_plan=<small>)`` on a memory:// and a folder bucket and
a simulated clock, the cadence raises k and skips syncs. A skipped sync still reads TRL's tensor
stream to its end (under FSDP2 that stream is a collective: a sync that stopped reading would
hang every rank), the published versions are numbered without gaps, a follower reconstructs each
published version bit for bit equal to the trainer's weights at the sync that published it (not at
a later skipped one), and the step metrics and the run summary report ``publish_every``. Print
the figures with ``-s``."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import numpy as np

from deltasync.publisher import DeltaPublisher, PublisherConfig
from deltasync.status import TRAINER_METRICS_PATH, TrainerMetrics
from deltasync.store import Store
from deltasync.subscriber import DeltaSubscriber, HeldWeights
from trainer.loop import metrics as metrics_module
from trainer.loop.bucket_transfer import BucketWeightTransfer
from trainer.loop.metrics import BucketMetricsCallback
from trainer.summary import bucket_summary

from .test_bucket_transfer import bits, model, sgd_step

STEP_S = 5.0  # simulated seconds a step: 60 syncs per 5-minute window
PLAN = "100"  # a token of 100 API requests per 5 minutes: k = 1 would need ~5x that
CEILING = 4  # the trainer's bound (max_staleness // 2)


def streamed(m, timeout_s: float = 10.0):
    """TRL's stream as a rank under FSDP2 produces it: a producer thread hands each tensor over
    a queue of one and blocks until it is taken (a collective the other ranks wait in). Returns
    the iterator and the producer, which ends only when the stream was read to its end."""
    q: queue.Queue = queue.Queue(maxsize=1)
    end = object()

    def produce():
        for item in m.named_parameters():
            q.put(item, timeout=timeout_s)  # queue.Full: the stream was left unread
        q.put(end, timeout=timeout_s)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()

    def items():
        while (item := q.get(timeout=timeout_s)) is not end:
            yield item

    return items(), producer


def test_skipped_syncs_read_the_stream_number_versions_without_gaps_and_follow_bit_for_bit(
    uri, monkeypatch
):
    cfg = PublisherConfig(
        adaptive_cadence=True,
        hub_plan=PLAN,
        max_publish_every=CEILING,
        anchor_every=1000,
        keep_anchors=5,
    )
    pub = DeltaPublisher(uri, config=cfg)
    clock = [0.0]
    pub.cadence.clock = lambda: clock[0]
    m = model()
    waited = []
    t = BucketWeightTransfer(pub, step_fn=lambda: step, first_apply_fn=waited.append)
    cb = BucketMetricsCallback(Store(uri), "run", pub)
    lines: list[str] = []  # the terminal's step lines
    monkeypatch.setattr(metrics_module.tqdm, "write", lines.append)
    sub, held = DeltaSubscriber(uri), HeldWeights()
    at_version: dict[int, dict] = {}  # version -> the trainer's bits at the sync that published it
    published_at: list[int] = []  # the syncs that published
    step = 0
    for step in range(1, 121):  # 10 simulated minutes
        sgd_step(m)
        before = t.last_version
        stream, producer = streamed(m)
        t.send_weights(stream)
        producer.join(timeout=10)
        assert not producer.is_alive(), f"sync {step}: TRL's stream was not read to its end"
        if t.last_version != before:  # this sync published
            published_at.append(step)
            at_version[t.last_version] = bits(m)
            pub.flush()
            sub.sync(held)
            assert held.version == t.last_version
            for n, b in at_version[t.last_version].items():
                assert np.array_equal(held.tensors[n], b), (step, n)
        cb.on_log(None, SimpleNamespace(global_step=step), None, logs={"loss": 0.1, "reward": 0.5})
        clock[0] += STEP_S
    last_sync_bits = bits(m)
    k = pub.publish_every
    summary_cadence = pub.cadence.summary()
    print(
        f"\nk over the run {pub.cadence.ks}; {len(published_at)} of 120 syncs published at "
        f"{published_at}; {pub.cadence.deferred} due publishes deferred; (API, resolver) "
        f"requests {pub.store.requests.snapshot()}"
    )
    t.destroy()
    cb.flush()

    assert waited == [0]  # the first sync published v0 and waited for its commit
    assert t.syncs == 120 and t.skipped == 120 - len(published_at) > 0
    assert 1 < k <= CEILING and max(pub.cadence.ks) <= CEILING
    versions = [e.version for e in pub.published]
    assert versions == list(range(len(published_at)))  # numbered per publish, no gaps
    manifest = sub.read_manifest()
    assert manifest.latest.version == versions[-1] == t.last_version
    assert {e.step for e in pub.published} <= set(published_at)
    # a fresh follower rebuilds the last version from the bucket alone, bit for bit equal to the
    # trainer's weights at the sync that published it
    fresh = HeldWeights()
    DeltaSubscriber(uri).sync(fresh)
    assert fresh.version == t.last_version
    for n, b in at_version[t.last_version].items():
        assert np.array_equal(fresh.tensors[n], b), n
    if published_at[-1] != 120:  # the last sync was skipped: its changes are not served yet
        assert any(not np.array_equal(fresh.tensors[n], b) for n, b in last_sync_bits.items())

    steps = TrainerMetrics.model_validate_json(Store(uri).read_bytes(TRAINER_METRICS_PATH)).steps
    assert len(steps) == 120
    assert steps[0].publish_every == 1 and steps[-1].publish_every == k
    assert {s.publish_every for s in steps} <= set(pub.cadence.ks)
    # the terminal's step line says the cadence each step
    assert len(lines) == 120 and lines[-1].endswith(f" every={k}"), lines[-1]
    assert [s.version for s in steps][-1] == t.last_version
    summary = bucket_summary(Store(uri), pub, lambda: t.last_version)
    assert summary["versions_published"] == versions
    block = summary["publish_cadence"]
    assert block["publish_every"] == summary_cadence["publish_every"]
    assert block["publish_every"]["last"] == k and block["publish_every"]["max"] <= CEILING
    assert block["publish_every"]["changes"] >= 1 and block["rate_limited"] == 0
    assert block["throttles"] == 0


def test_without_a_cadence_every_sync_publishes_and_reports_none(uri):
    pub = DeltaPublisher(uri, config=PublisherConfig(adaptive_cadence=False))
    assert pub.cadence is None
    m = model()
    t = BucketWeightTransfer(pub)
    cb = BucketMetricsCallback(Store(uri), "run", pub)
    for step in range(1, 4):
        sgd_step(m)
        t.send_weights(iter(m.named_parameters()))
        pub.flush()
        cb.on_log(None, SimpleNamespace(global_step=step), None, logs={"loss": 0.1})
    t.destroy()
    cb.flush()
    assert t.skipped == 0 and [e.version for e in pub.published] == [0, 1, 2]
    steps = TrainerMetrics.model_validate_json(Store(uri).read_bytes(TRAINER_METRICS_PATH)).steps
    assert [s.publish_every for s in steps] == [None, None, None]
    assert bucket_summary(Store(uri), pub, lambda: 2)["publish_cadence"] is None
