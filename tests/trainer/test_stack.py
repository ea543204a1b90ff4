"""The run stack (``trainer.stack.RunStack``) and the summary (``trainer.summary``) without a
training run: the stack starts its parts in order and stops them in reverse, whether a child
fails to start or training raises, and hands the router's URL back instead of writing it into the
settings; the summary of a recorded bucket says what the run published and whether the replica
holds the trainer's weights bit for bit."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from deltasync.publisher import DeltaPublisher
from deltasync.status import TRAINER_METRICS_PATH, StepMetrics, TrainerMetrics
from deltasync.store import Store
from trainer import stack as stack_module
from trainer.config import TrainConfig
from trainer.fleet.pool import ReplicaPool
from trainer.fleet.router import FleetRouter
from trainer.local import children
from trainer.loop.learning_curve import HeldOutEvals
from trainer.loop.trained_weights import FullWeights
from trainer.summary import build_summary


class FakeChild:
    """A child server that records its stop; ``fails``: its health check raises."""

    def __init__(self, name: str, stopped: list[str], fails: bool = False):
        self.name, self.stopped, self.fails = name, stopped, fails
        self.url = "http://127.0.0.1:9"  # nothing listens: the pool marks it unhealthy

    def wait_healthy(self, timeout_s: float) -> None:
        if self.fails:
            raise children.ChildFailedError(f"{self.name} exited (fake)")

    def stop(self) -> None:
        self.stopped.append(self.name)


@pytest.fixture()
def stopped(monkeypatch):
    """The stack's parts with fake children; returns the list their stops are recorded in."""
    order: list[str] = []
    monkeypatch.setattr(stack_module.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(
        children, "start_env_server", lambda server, logs: FakeChild("wordle", order)
    )
    monkeypatch.setattr(
        children, "start_replica", lambda *a, **k: FakeChild("replica", order, _FAIL["replica"])
    )
    monkeypatch.setattr(children, "start_dashboard", lambda *a: FakeChild("dashboard", order))
    for cls, name in (
        (ReplicaPool, "pool"),
        (FleetRouter, "router"),
        (DeltaPublisher, "publisher"),
    ):
        method = "close" if cls is DeltaPublisher else "stop"
        original = getattr(cls, method)

        def recorded(self, _original=original, _name=name):
            if _name not in order:  # the publisher's close is idempotent: record the first
                order.append(_name)
            return _original(self)

        monkeypatch.setattr(cls, method, recorded)
    _FAIL["replica"] = False
    return order


_FAIL = {"replica": False}


def _cfg(tmp_path) -> TrainConfig:
    return TrainConfig.from_flags(
        runs_root=str(tmp_path / "runs"), run_id="stack", dashboard_port=9
    )


def test_the_stack_returns_the_routers_url_and_stops_in_reverse_on_an_error_in_training(
    tmp_path, stopped
):
    cfg = _cfg(tmp_path)
    before = copy.deepcopy(cfg)
    with pytest.raises(RuntimeError, match="training failed"):
        with stack_module.RunStack(cfg, FullWeights()) as stack:
            url = stack.start(str(tmp_path / "model")).url
            assert url.startswith("http://127.0.0.1:") and stack.router is not None
            assert stopped == []
            raise RuntimeError("training failed")
    assert stopped == ["router", "pool", "dashboard", "replica", "publisher", "wordle"]
    assert cfg == before  # nothing was written into the settings (the URL was returned)


def test_a_child_that_fails_to_start_stops_what_started_in_reverse(tmp_path, stopped):
    _FAIL["replica"] = True
    with pytest.raises(children.ChildFailedError, match="replica exited"):
        with stack_module.RunStack(_cfg(tmp_path), FullWeights()) as stack:
            stack.start(str(tmp_path / "model"))
    # the pool and the router never started: nothing of theirs to stop
    assert stopped == ["dashboard", "replica", "publisher", "wordle"]


def test_the_summary_of_a_recorded_run(tmp_path):
    """Two published versions of a small model, the metrics the trainer wrote, and the fleet's
    figures give the summary a user reads; ``replica_bit_exact`` holds only when the replica
    serves the final version and its digest is the trainer's."""
    cfg = _cfg(tmp_path)
    model = torch.nn.Linear(4, 3)
    store = Store(cfg.run.bucket_uri())
    publisher = DeltaPublisher(store, run_id="stack")
    publisher.publish(model.named_parameters(), step=0)
    publisher.flush()  # each version committed (a pending publish is replaced by a newer one)
    with torch.no_grad():
        model.weight[0, 0] += 0.5
    publisher.publish(model.named_parameters(), step=1)
    publisher.close()
    steps = [StepMetrics(step=1, version=1, reward=0.25, turns_mean=3.0)]
    metrics = TrainerMetrics(run_id="stack", steps=steps)
    store.write_bytes(TRAINER_METRICS_PATH, metrics.model_dump_json().encode())
    served = {"version": 1}
    stack = stack_module.RunStack(cfg, FullWeights())
    stack.store, stack.publisher = store, publisher
    stack.pool = SimpleNamespace(replica_rows=lambda: [{"url": "r0", "served": 12}])
    stack.router = SimpleNamespace(max_request_s=1.234, affinity=SimpleNamespace(hits=7))
    stack.replica_version = lambda: served["version"]
    evals = HeldOutEvals(cfg.eval, cfg.task(), None, None, record=lambda *a: None)
    evals.blocks = {
        "before": {"reward_mean": 0.5, "per_seed": [0.5, 0.4, 0.6]},
        "after": {"reward_mean": 0.6, "per_seed": [0.6, 0.5, 0.6]},
    }
    tagger = SimpleNamespace(
        summary=lambda: {"staleness": {0: 10, 1: 30}, "train_games": 40, "per_sample_tags": 40}
    )
    metrics_cb = SimpleNamespace(summary=lambda: {"step_s_median": 2.0, "stale_fraction": 0.0})
    weights = FullWeights()
    digest = weights.trained_digest(SimpleNamespace(model=model))
    start = {"initial_model": "m", "warm_start_s": 1.04, "train_s": 20.0}

    def summary():
        return build_summary(cfg, start, digest, [stack, tagger, metrics_cb, evals, weights])

    s = summary()
    assert (s["run_id"], s["versions_published"], s["anchors"]) == ("stack", [0, 1], [0])
    assert s["final_version"] == 1 and s["replica_bit_exact"] is True
    assert (s["reward_first5"], s["turns_mean"], s["steps"]) == (0.25, 3.0, 1)
    assert s["staleness"] == {0: 10, 1: 30} and s["train_games_per_s"] == 2.0
    assert s["eval_paired"]["games"] == 3 and s["eval_paired"]["reward_diff"] == 0.0667
    assert (s["adapter"], s["replica_env"], s["grpo"]["learning_rate"]) == (None, {}, 2e-4)
    assert s["fleet"] == [{"url": "r0", "served": 12}] and s["sticky_turns"] == 7
    assert "wall_s" not in s  # run() writes it, once, last
    served["version"] = 0  # the replica still on the first version
    assert summary()["replica_bit_exact"] is False
    served["version"] = 1
    with torch.no_grad():
        model.weight[0, 1] += 0.5  # the trainer moved on: its digest is no longer the bucket's
    digest = weights.trained_digest(SimpleNamespace(model=model))
    assert summary()["replica_bit_exact"] is False
