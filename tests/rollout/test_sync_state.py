"""The sync loop's states (``rollout.state``): their values are the heartbeat's ``status``
strings, the transition table allows a replica's life (first anchor, deltas, errors, a recovery,
stop) and refuses what makes no sense (OK before anything was applied, anything after stop), and
a real loop against a fake engine moves only along the table and stays ``stopped`` once stopped."""

from __future__ import annotations

import json
import typing

import pytest

from deltasync.status import ReplicaHeartbeat, heartbeat_path
from rollout import sync_loop
from rollout.state import TRANSITIONS, SyncState, SyncStateError, check_transition
from rollout.sync_loop import SyncLoop

from .rollout_helpers import FakeEngine, Trainer

S = SyncState


def test_states_are_the_heartbeat_status_strings():
    allowed = typing.get_args(ReplicaHeartbeat.model_fields["status"].annotation)
    assert sorted(s.value for s in SyncState) == sorted(allowed)
    assert set(TRANSITIONS) == set(SyncState)
    assert json.dumps({"status": S.RECOVERING}) == '{"status": "recovering"}'
    assert f"{S.OK}" == "ok" and S.ERROR == "error"


def test_a_replica_life_is_legal():
    life = [
        S.STARTING,
        S.ERROR,  # the bucket is unreadable (a refused token)
        S.STARTING,  # readable again; nothing served yet
        S.RECOVERING,  # the first anchor
        S.OK,
        S.SYNCING,  # a delta
        S.RECOVERING,  # its apply failed inside vLLM: full reload
        S.SYNCING,  # reloaded, a newer version is out
        S.OK,
        S.ERROR,  # a corrupt delta refused
        S.ERROR,  # still no clean path
        S.RECOVERING,  # re-anchored
        S.OK,
        S.STOPPED,
        S.STOPPED,  # stop() twice
    ]
    for old, new in zip(life, life[1:], strict=False):
        check_transition(old, new)


@pytest.mark.parametrize(
    "old, new",
    [
        (S.STARTING, S.OK),  # OK needs an applied version
        (S.OK, S.STARTING),
        (S.SYNCING, S.STARTING),
        (S.STOPPED, S.OK),
        (S.STOPPED, S.ERROR),
    ],
)
def test_illegal_transitions_raise(old, new):
    with pytest.raises(SyncStateError) as e:
        check_transition(old, new)
    msg = str(e.value)
    assert repr(old.value) in msg and repr(new.value) in msg and "expected one of" in msg
    assert all(s.value in msg for s in TRANSITIONS[old])


def test_a_loop_moves_along_the_table_and_refuses_changes_after_stop(
    char_model_dir, tmp_path, monkeypatch
):
    moves = []

    def recording(old, new):
        check_transition(old, new)
        if new is not old:
            moves.append((old.value, new.value))

    monkeypatch.setattr(sync_loop, "check_transition", recording)
    bucket = str(tmp_path / "bucket")
    tr = Trainer(char_model_dir, bucket)
    shapes = {n: a.shape for n, a in tr.bits.items()}
    loop = SyncLoop(bucket, FakeEngine(shapes), "r0", stage_dir=str(tmp_path / "stage"))
    tr.publish()
    assert loop.poll_once().kind == "anchor"
    tr.publish_many(1)
    assert loop.poll_once().kind == "delta"
    loop.stop()
    loop.stop()
    assert moves == [
        ("starting", "recovering"),
        ("recovering", "ok"),
        ("ok", "syncing"),
        ("syncing", "ok"),
        ("ok", "stopped"),
    ]
    with pytest.raises(SyncStateError, match="'stopped' cannot change to 'ok'"):
        loop.poll_once()
    hb = json.loads(loop.store.read_bytes(heartbeat_path("r0")))
    assert hb["status"] == "stopped" and hb["held_version"] == 1
    tr.close()
