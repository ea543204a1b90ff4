"""The ``hf://`` store against the local Hub (tools/local_hub), a separate process on 127.0.0.1
speaking the bucket API, with its Xet CAS over HTTP: the real huggingface_hub client and the
real hf_xet upload and download through it, unchanged.

What a user would check: a publisher's versions reach a subscriber bit for bit through the Hub;
an unchanged poll costs one resolver request whatever the file bridge does with ETags (counted at
the server); a wrong, read-only, out-of-scope or revoked token is refused with the Hub's status
and a typed error; 429 bursts, 503s and dropped connections are waited out with nothing lost; a
publish prints no progress bars; a raw request line without a token is refused.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("hf_xet")

from deltasync.errors import StoreAuthError, StoreBucketNotFoundError  # noqa: E402
from deltasync.publisher import DeltaPublisher, PublisherConfig  # noqa: E402
from deltasync.store import Store  # noqa: E402
from deltasync.subscriber import DeltaSubscriber, HeldWeights  # noqa: E402
from tools.local_hub.process import HubProcess  # noqa: E402

from .conftest import REPO_ROOT  # noqa: E402

SHAPES = {"model.embed_tokens.weight": (256, 64), "lm_head.weight": (256, 64)}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = HubProcess(tmp_path_factory.mktemp("hub")).start()
    from huggingface_hub import HfApi

    api = HfApi(endpoint=h.url, token=h.tokens["me-write"])
    for name in ("run", "other"):
        api.create_bucket(f"me/{name}", private=True, exist_ok=True)
    yield h
    h.stop()


def store(hub, token: str | None, path: str = "run", **kw) -> Store:
    token = token if token is not None else False
    return Store(f"hf://buckets/me/{path}", endpoint=hub.url, token=token, **kw)


def test_versions_reach_a_subscriber_bit_for_bit(hub):
    rng = np.random.default_rng(0)
    bits = {n: rng.integers(0x3C00, 0x3E00, s, dtype=np.uint16) for n, s in SHAPES.items()}
    cfg = PublisherConfig(anchor_every=3)
    pub = DeltaPublisher(store(hub, hub.tokens["me-write"], "run/pub"), config=cfg)
    for step in range(5):
        for a in bits.values():
            a.reshape(-1)[rng.choice(a.size, 50, replace=False)] += 1
        pub.publish(bits.items(), step=step)
        pub.flush()
    sub = DeltaSubscriber(store(hub, hub.tokens["me-read"], "run/pub"))
    held = HeldWeights()
    sub.sync(held)
    assert held.version == 4
    for n, a in bits.items():
        assert np.array_equal(held.tensors[n], a)  # bit for bit
    pub.close()


@pytest.mark.parametrize("resolve_304", [True, False])
@pytest.mark.parametrize("bridge", ["same", "different", "ignore"])
def test_an_unchanged_poll_costs_one_resolver_request(hub, bridge, resolve_304):
    hub.admin("POST", "/admin/settings", {"bridge_etag": bridge, "resolve_304": resolve_304})
    token = hub.new_token("read", name=f"poll-{bridge}-{resolve_304}")
    writer = store(hub, hub.tokens["me-write"])
    writer.write_bytes("poll/manifest.json", b'{"v": 1}')
    reader = store(hub, token)
    data, tag = reader.read_if_changed("poll/manifest.json", None)
    assert data == b'{"v": 1}'
    since = time.time()
    for _ in range(5):
        assert reader.read_if_changed("poll/manifest.json", tag) == (None, tag)
        assert reader.read_bytes("poll/manifest.json") == b'{"v": 1}'
    counted = hub.requests(since)[f"poll-{bridge}-{resolve_304}"]
    assert (counted["resolver"], counted["api"]) == (10, 0)
    writer.write_bytes("poll/manifest.json", b'{"v": 2}')
    assert reader.read_if_changed("poll/manifest.json", tag)[0] == b'{"v": 2}'
    hub.admin("POST", "/admin/settings", {"bridge_etag": "different", "resolve_304": True})


def test_tokens_are_refused_as_the_hub_refuses_them(hub):
    store(hub, hub.tokens["me-write"]).write_bytes("auth/a.json", b"{}")
    with pytest.raises(StoreAuthError, match="401"):
        store(hub, "hf_not_a_token", retries=1).read_bytes("auth/a.json")
    with pytest.raises(StoreAuthError, match="403"):
        store(hub, hub.tokens["me-read"]).write_bytes("auth/b.json", b"{}")
    scoped = hub.new_token("fine-grained", {"bucket:me/other": "write"}, name="other-only")
    with pytest.raises(StoreAuthError, match="403"):
        store(hub, scoped).read_bytes("auth/a.json")
    store(hub, scoped, "other").write_bytes("mine.json", b"1")  # its own bucket: allowed
    assert store(hub, scoped, "other").read_bytes("mine.json") == b"1"
    with pytest.raises(StoreBucketNotFoundError):
        store(hub, hub.tokens["me-write"], "missing").read_bytes("x")
    revocable = hub.new_token("read", name="revocable")
    reader = store(hub, revocable)
    assert reader.read_bytes("auth/a.json") == b"{}"
    hub.admin("POST", "/admin/tokens/revocable/revoke")
    with pytest.raises(StoreAuthError, match="401"):
        store(hub, revocable).read_bytes("auth/a.json")
    hub.admin("POST", "/admin/tokens/revocable/restore")
    assert store(hub, revocable).read_bytes("auth/a.json") == b"{}"


def test_a_raw_request_without_a_token_is_refused(hub):
    for line in (
        b"GET /api/buckets/me/run HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /buckets/me/run/resolve/auth/a.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /api/buckets/me/run/xet-write-token HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /admin/requests HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", hub.port), timeout=5) as s:
            s.sendall(line)
            answer = s.recv(200)
        assert answer.split(b" ")[1] == b"401", (line, answer)


@pytest.mark.parametrize(
    "fault",
    [
        {"kind": "429", "count": 3, "match": "/batch$", "retry_after_s": 1},
        {"kind": "429", "count": 3, "match": "/resolve/", "retry_after_s": 1},
        {"kind": "503", "count": 3},
        {"kind": "drop", "count": 2, "match": "/resolve/"},
    ],
    ids=["429-batch", "429-resolve", "503", "drop"],
)
def test_faults_are_waited_out_and_nothing_is_lost(hub, fault):
    s = store(hub, hub.tokens["me-write"], backoff_s=0.2)
    s.exists("warm")  # the bucket check before the fault
    payload = os.urandom(20_000)
    hub.admin("POST", "/admin/faults", fault)
    s.write_bytes(f"faults/{fault['kind']}.bin", payload)
    assert s.read_bytes(f"faults/{fault['kind']}.bin") == payload
    hub.admin("DELETE", "/admin/faults")


def test_a_publish_prints_no_progress_bars(hub):
    code = (
        "import numpy as np\n"
        "from deltasync.publisher import DeltaPublisher\n"
        "pub = DeltaPublisher('hf://buckets/me/run/quiet')\n"
        "bits = {'w': np.arange(4096, dtype=np.uint16)}\n"
        "for step in range(3):\n"
        "    bits['w'][step] += 1\n"
        "    pub.publish(bits.items(), step=step)\n"
        "    pub.flush()\n"
        "pub.close()\n"
    )
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN=hub.tokens["me-write"])
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "Processing Files" not in out and "New Data Upload" not in out and "it/s" not in out, out


def test_the_rate_limit_counts_api_and_resolver_per_token_as_the_hub_does(hub):
    import httpx

    store(hub, hub.tokens["me-write"]).write_bytes("limits/a.json", b"{}")
    hub.admin("POST", "/admin/settings", {"limits": {"api": 3, "resolver": 4}})
    try:
        token = hub.new_token("read", name="limited")
        other = hub.new_token("read", name="unlimited-neighbour")
        auth = {"Authorization": f"Bearer {token}"}
        api = [httpx.get(f"{hub.url}/api/buckets/me/run", headers=auth) for _ in range(4)]
        assert [r.status_code for r in api] == [200, 200, 200, 429]
        refused = api[-1].headers
        reset = int(refused["retry-after"])
        assert 1 <= reset <= 300 and refused["ratelimit"] == f'"api";r=0;t={reset}'
        assert refused["ratelimit-policy"] == '"fixed window";"api";q=3;w=300'
        # the resolver is its own window: still open for this token
        url = f"{hub.url}/buckets/me/run/resolve/limits/a.json"
        codes = [httpx.get(url, headers=auth).status_code for _ in range(5)]
        assert codes == [302, 302, 302, 302, 429]
        # and another token has windows of its own
        other_auth = {"Authorization": f"Bearer {other}"}
        assert httpx.get(f"{hub.url}/api/buckets/me/run", headers=other_auth).status_code == 200
    finally:
        hub.admin("POST", "/admin/settings", {"limits": {"api": 1000, "resolver": 5000}})


def test_the_publishers_request_count_agrees_with_the_hubs_count_of_its_token(hub):
    """``Store.requests`` (what the publish cadence budgets with) equals the Hub's count of the
    token's API and resolver requests after the start (lease, manifest, orphan listing, the
    bucket check), after each publish and after the close. Not in either count: Xet CAS traffic
    (no Hub request). Outside this test, the two can differ by huggingface_hub's own once-a-day
    ``/api/agent-harnesses`` fetch, and under throttling by the 429s that huggingface_hub's
    ``http_backoff`` retries inside one ``batch_bucket_files`` or listing call (the Store counts
    one attempt per call it makes)."""
    token = hub.new_token("write", name="publisher-count")
    s = store(hub, token, "run/count")
    rng = np.random.default_rng(1)
    bits = {n: rng.integers(0x3C00, 0x3E00, sh, dtype=np.uint16) for n, sh in SHAPES.items()}
    cfg = PublisherConfig(anchor_every=3, keep_anchors=1)  # retention deletes too
    pub = DeltaPublisher(s, config=cfg)
    assert pub.cadence is not None  # on by default on hf://

    def agree(when: str) -> tuple[int, int]:
        counted = hub.requests(0)["publisher-count"]
        assert (counted["api"], counted["resolver"]) == s.requests.snapshot(), when
        return s.requests.snapshot()

    api = agree("after the start")[0]
    per_version = []
    for step in range(5):
        for a in bits.values():
            a.reshape(-1)[rng.choice(a.size, 50, replace=False)] += 1
        assert pub.offer(bits.items(), step=step) == step  # no evidence yet: every sync
        pub.flush()
        per_version.append(agree(f"after v{step}")[0] - api)
        api += per_version[-1]
    pub.close()
    agree("after the close")
    # two /batch a version (payload, then manifest): the Xet write token fetched at the start
    # (the lease) is kept, and hf_xet fetches none itself when given one (the Hub counts it)
    assert per_version == [2] * 5


def _batch(hub, bucket: str, token: str, ops: list[dict]) -> tuple[int, dict]:
    """A raw ``POST /api/buckets/{bucket}/batch``: (status, JSON answer)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{hub.url}/api/buckets/{bucket}/batch",
        data=b"".join(json.dumps(op).encode() + b"\n" for op in ops),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _tree(hub, bucket: str, token: str) -> dict[str, str]:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url, token=token)
    return {
        f.path: f.xet_hash
        for f in api.list_bucket_tree(bucket, recursive=True)
        if getattr(f, "xet_hash", None)
    }


def test_a_batch_path_that_leaves_the_bucket_is_refused_and_nothing_is_written(hub):
    token = hub.tokens["me-write"]
    store(hub, token, "other").write_bytes("paths/ok.json", b"{}")
    xet_hash = _tree(hub, "me/other", token)["paths/ok.json"]
    before = _tree(hub, "me/other", token)
    for bad in ("../run/x.json", "a/../../x", "/abs.json", "a//b.json", "a/", "./a", "a/./b"):
        ops = [
            {"type": "addFile", "path": "paths/fine.json", "xetHash": xet_hash, "mtime": 1},
            {"type": "addFile", "path": bad, "xetHash": xet_hash, "mtime": 1},
        ]
        status, body = _batch(hub, "me/other", token, ops)
        assert status == 400, (bad, status, body)
        assert "invalid path" in body["error"] and body["failed"][0]["path"] == bad, body
        status, body = _batch(hub, "me/other", token, [{"type": "deleteFile", "path": bad}])
        assert status == 400, (bad, body)
    assert _tree(hub, "me/other", token) == before  # nothing written, not even the fine one


def test_linking_another_namespaces_xet_file_is_refused(hub):
    mine = hub.tokens["me-write"]
    store(hub, mine).write_bytes("link/secret.bin", b"only me/run may hold this " * 10)
    xet_hash = _tree(hub, "me/run", mine)["link/secret.bin"]
    # the owner links its own upload into another bucket of its namespace
    op = {"type": "addFile", "path": "copied.bin", "xetHash": xet_hash, "mtime": 1}
    assert _batch(hub, "me/other", mine, [op])[0] == 200
    # eve knows the hash (a tree listing shows it) but never uploaded those bytes
    from huggingface_hub import HfApi

    eve = hub.admin("POST", "/admin/tokens", {"user": "eve", "role": "write", "name": "eve-w"})
    eve = eve["value"]
    HfApi(endpoint=hub.url, token=eve).create_bucket("eve/loot", private=True, exist_ok=True)
    status, body = _batch(hub, "eve/loot", eve, [dict(op, path="stolen.bin")])
    assert status == 422 and body["succeeded"] == 0, body
    assert "not found for eve/loot" in body["failed"][0]["error"], body
    copy = dict(op, type="copyFile", sourceRepoType="bucket", sourceRepoId="me/run")
    assert _batch(hub, "eve/loot", eve, [dict(copy, path="copied.bin")])[0] == 422
    assert _tree(hub, "eve/loot", eve) == {}
    # an unknown hash is refused the same way
    status, body = _batch(hub, "eve/loot", eve, [dict(op, xetHash="0" * 64)])
    assert status == 422 and "not found" in body["failed"][0]["error"], body
