"""The trainer's bucket weight transfer (trainer.loop.bucket_transfer) with a real DeltaPublisher and a
real DeltaSubscriber on memory:// and file:// stores: versions advance, replicas follow bit for
bit, a step with no change publishes an empty delta, and a restart continues the sequence."""

import numpy as np
import torch

from deltasync.bf16 import to_bf16_bits
from deltasync.publisher import DeltaPublisher
from deltasync.subscriber import DeltaSubscriber, HeldWeights
from trainer.loop.bucket_transfer import BucketWeightTransfer


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def sgd_step(m, lr=1e-2):
    loss = m(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in m.parameters():
            p -= lr * p.grad
            p.grad = None


def bits(m):
    return {n: to_bf16_bits(p) for n, p in m.named_parameters()}


def test_syncs_publish_versions_that_replicas_follow(uri):
    m = model()
    waited = []
    t = BucketWeightTransfer(DeltaPublisher(uri), step_fn=lambda: 7, first_apply_fn=waited.append)
    t.init_weight_transfer()
    sub, held = DeltaSubscriber(uri), HeldWeights()
    for _ in range(3):
        t.pause()
        t.send_weights(iter(m.named_parameters()))
        t.resume()
        sgd_step(m)
    assert waited == [0]  # called once, after the first publish was committed
    t.send_weights(iter(m.named_parameters()))
    t.destroy()
    assert t.last_version == 3
    sub.sync(held)
    assert held.version == 3
    for n, b in bits(m).items():
        assert np.array_equal(held.tensors[n], b)
    assert {e.step for e in sub.read_manifest().versions} == {7}


def test_no_change_publishes_an_empty_delta(uri):
    m = model()
    t = BucketWeightTransfer(DeltaPublisher(uri))
    t.send_weights(iter(m.named_parameters()))
    t.publisher.flush()  # else the two versions may coalesce into one anchor
    t.send_weights(iter(m.named_parameters()))  # nothing changed since
    t.destroy()
    entry = DeltaSubscriber(uri).read_manifest().latest
    assert entry.version == 1 and entry.delta is not None
    assert entry.changed == 0 and entry.delta.files  # a valid, empty delta: replicas advance
    held = HeldWeights()
    DeltaSubscriber(uri).sync(held)
    assert held.version == 1


def test_restart_continues_the_sequence(uri):
    m = model()
    t = BucketWeightTransfer(DeltaPublisher(uri, run_id="r"))
    for _ in range(2):
        t.send_weights(iter(m.named_parameters()))
        t.publisher.flush()
        sgd_step(m)
    t.destroy()
    t2 = BucketWeightTransfer(DeltaPublisher(uri, run_id="r"))
    t2.send_weights(iter(m.named_parameters()))
    t2.destroy()
    m2 = DeltaSubscriber(uri).read_manifest()
    assert [v.version for v in m2.versions] == [0, 1, 2]
    assert m2.latest.anchor is not None and m2.latest.delta is None
