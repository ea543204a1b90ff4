"""The dashboard's states and messages (``dashboard.data``, ``dashboard.problems``): empty,
missing, half-written, damaged and unreadable run roots become ``waiting``/``error`` run views
(``RunView``) whose problem kind names what is wrong. The operator's message and the server log
carry the URI, the file and the exception text; the public line and the public summary carry only
the kind: "waiting for the first version", "the manifest does not parse" (an error: waiting does
not mend it), "the run root is not a folder", the store's own line, "the heartbeat of replica X
does not parse"."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from dashboard.data import BucketReader
from dashboard.frames import COLUMNS
from dashboard.problems import ProblemKind, public_error
from deltasync.errors import StoreAuthError
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.status import TRAINER_METRICS_PATH
from deltasync.store import Store


def _assert_public_hides(view, *secrets: str) -> None:
    """Neither the public line nor the public summary shows any of ``secrets``."""
    shown = view.public + "\n" + view.markdown(public=True)
    for secret in secrets:
        assert secret not in shown, (secret, shown)


def test_empty_bucket_is_waiting(tmp_path):
    view = BucketReader(str(tmp_path)).read()
    assert view.state == "waiting"
    assert view.problem.kind is ProblemKind.NOT_PUBLISHED
    assert view.public == "waiting for the first version"
    assert "waiting for the first version" in view.message
    assert str(tmp_path) in view.message
    _assert_public_hides(view, str(tmp_path))
    for name in COLUMNS:
        assert view.frame(name).empty
    assert "WAITING" in view.markdown()


def test_missing_local_folder_is_waiting_and_not_created(tmp_path):
    path = tmp_path / "not-yet"
    view = BucketReader(str(path)).read()
    assert view.state == "waiting" and "does not exist yet" in view.message
    assert view.public == "waiting for the first version"
    assert not path.exists()


def test_payload_without_manifest_is_waiting(tmp_path):
    part = tmp_path / "anchors" / "v0000000000" / "part-0000.safetensors"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 64)
    view = BucketReader(str(tmp_path)).read()
    assert view.state == "waiting"
    assert "1 payload file(s) but no manifest.json" in view.message
    assert "waiting for the first version" in view.message
    assert view.public == "waiting for the first version"


def test_garbage_manifest_is_an_error_then_recovers(tmp_path, recorded_bucket, caplog):
    (tmp_path / MANIFEST_PATH).write_bytes(b'{"schema": "deltasync.manifest/1", "run_')
    reader = BucketReader(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="dashboard"):
        view = reader.read()
    # an error, not "waiting": the trainer writes the manifest whole, so waiting does not mend it
    assert view.state == "error"
    assert view.problem.kind is ProblemKind.MANIFEST_UNPARSABLE
    assert view.problem.kind.state == "error"
    assert view.public == "the manifest does not parse"
    assert "**ERROR**: the manifest does not parse" in view.markdown(public=True)
    assert "WAITING" not in view.markdown(public=True) + view.markdown()
    assert "waiting" not in view.public
    assert f"{tmp_path}/{MANIFEST_PATH}" in view.message and "does not parse" in view.message
    assert "damaged" in view.message  # the operator learns what to do about it
    why = view.message.split("(", 1)[1].split(")", 1)[0]  # the parser's reason, operator only
    assert why and why in caplog.text
    _assert_public_hides(view, str(tmp_path), MANIFEST_PATH, why, ".json")
    assert f"{tmp_path}/{MANIFEST_PATH} does not parse" in caplog.text  # recovered, and logged
    # the next poll reads it again, at the fastest interval (an error is never "nothing new")
    assert reader.read().state == "error"
    assert reader.next_read_delay_s() == reader.min_interval_s

    good = Store(recorded_bucket[0]).read_bytes(MANIFEST_PATH)
    (tmp_path / MANIFEST_PATH).write_bytes(good)
    assert reader.read().state == "ok"
    (tmp_path / MANIFEST_PATH).write_bytes(b"[]")  # damaged after a good one: keep the last good
    view = reader.read()
    assert view.state == "ok" and view.trainer_version == Manifest.from_json(good).latest.version
    assert [w.kind for w in view.warnings] == [ProblemKind.FILE_SKIPPED]
    assert "does not parse" in view.warnings[0].detail
    assert view.public_warnings() == ["1 file(s) skipped this poll (malformed)"]


def test_run_root_that_is_a_file_is_named(tmp_path, recorded_bucket, caplog):
    root = tmp_path / "run-root"
    root.write_text("not a folder")
    reader = BucketReader(str(root))
    with caplog.at_level(logging.WARNING, logger="dashboard"):
        view = reader.read()
    assert view.state == "error"
    assert view.problem.kind is ProblemKind.ROOT_NOT_A_FOLDER
    assert view.public == "the run root is not a folder"
    assert "ERROR**: the run root is not a folder" in view.markdown(public=True)
    assert f"cannot read `{root}`" in view.message and "not a folder" in view.message
    assert str(root) in caplog.text
    _assert_public_hides(view, str(root), "run-root")

    # a root that held a run and was then replaced by a file is named the same way
    uri = recorded_bucket[0]
    reader = BucketReader(uri)
    assert reader.read().state == "ok"
    shutil.rmtree(uri)
    with open(uri, "w") as f:
        f.write("not a folder")
    view = reader.read()
    assert (view.state, view.problem.kind) == ("error", ProblemKind.ROOT_NOT_A_FOLDER)
    assert view.public == "the run root is not a folder"


def test_malformed_heartbeat_names_its_replica(recorded_bucket, caplog):
    uri, _ = recorded_bucket
    store = Store(uri)
    store.write_bytes("replicas/broken.json", json.dumps({"replica_id": "broken"}).encode())
    store.write_bytes("replicas/.tmp-abc123r9.json", b'{"half')  # a write underway: ignored
    with caplog.at_level(logging.WARNING, logger="dashboard"):
        view = BucketReader(uri).read()
    assert view.state == "ok" and view.problem is None
    assert set(view.frame("status").replica) == {"r0", "r1"}
    [w] = view.warnings
    assert (w.kind, w.replica_id) == (ProblemKind.HEARTBEAT_UNPARSABLE, "broken")
    assert "replicas/broken.json" in w.detail and "replicas/broken.json" in view.markdown()
    assert f"{uri}/replicas/broken.json" in caplog.text
    assert view.public_warnings() == ["the heartbeat of replica broken does not parse"]
    assert "the heartbeat of replica broken does not parse" in view.markdown(public=True)
    _assert_public_hides(view, uri, "replicas/", ".json", w.detail.split("(", 1)[1])

    # the trainer's metrics are not a heartbeat: still counted, not named
    store.write_bytes(TRAINER_METRICS_PATH, b"{}")
    view = BucketReader(uri).read()
    assert [w.kind for w in view.warnings] == [
        ProblemKind.HEARTBEAT_UNPARSABLE,
        ProblemKind.FILE_SKIPPED,
    ]
    assert view.public_warnings() == [
        "the heartbeat of replica broken does not parse",
        "1 file(s) skipped this poll (malformed)",
    ]


def test_replica_id_is_shown_as_written_not_as_markdown(recorded_bucket):
    uri, _ = recorded_bucket
    Store(uri).write_bytes("replicas/r_*a*_.json", b"{")
    view = BucketReader(uri).read()
    assert view.public_warnings() == ["the heartbeat of replica r_*a*_ does not parse"]
    assert r"replica r\_\*a\*\_ does not parse" in view.markdown(public=True)


@pytest.mark.parametrize("kind", ["file", "hf-model-repo", "unknown-protocol"])
def test_unreadable_uri_names_it(tmp_path, kind, caplog):
    if kind == "file":
        uri = str(tmp_path / "a-file")
        (tmp_path / "a-file").write_text("not a folder")
    elif kind == "hf-model-repo":
        uri = "hf://someone/some-model"
    else:
        uri = "nosuchproto://bucket/run"
    with caplog.at_level(logging.WARNING, logger="dashboard"):
        view = BucketReader(uri).read()
    assert view.state == "error"
    assert uri in view.message
    assert "cannot read" in view.message
    assert "ERROR" in view.markdown()
    assert uri in caplog.text
    _assert_public_hides(view, uri)
    if kind != "file":  # a URI that is not a store: the storage line as before
        assert view.problem.kind is ProblemKind.STORE_FAILED
        assert view.public == "bucket unreadable: storage error (retrying)"


class _RefusingStore:
    """A store whose every read is refused, as the Hub answers a token without access."""

    def read_if_changed(self, path, tag):
        raise StoreAuthError(
            "hf://buckets/me/run: 403 Forbidden; set HF_TOKEN to a token with read"
        )

    def ls(self, prefix):
        raise AssertionError("not reached: the manifest read fails first")


def test_refused_access_shows_the_stores_own_line(caplog):
    reader = BucketReader("hf://buckets/me/run", store=_RefusingStore())
    with caplog.at_level(logging.WARNING, logger="dashboard"):
        view = reader.read()
    assert (view.state, view.problem.kind) == ("error", ProblemKind.ACCESS_REFUSED)
    assert view.public == StoreAuthError.summary == "bucket unreadable: token lacks access"
    assert "403 Forbidden" in view.message and "403 Forbidden" in caplog.text
    _assert_public_hides(view, "hf://buckets/me/run", "403", "HF_TOKEN")


def test_replica_errors_are_shown_by_kind():
    assert public_error("DeltaCorruptError: /tmp/x/deltas/v5 digest") == "refused a corrupt payload"
    assert "/tmp" not in public_error("OSError: /tmp/secret")
    assert public_error(None) == public_error("") == ""
