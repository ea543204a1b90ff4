"""The replica fleet (``trainer.fleet``): the router TRL talks to, over real HTTP servers on
127.0.0.1 (fake replicas that answer like the replica's front).

Covers: requests spread over healthy replicas; a replica that refuses connections, answers 503,
or hangs past the timeout loses no request (it goes to another); a 500 that every replica gives
is handed back instead of waited on; with no replica the request waits and goes on when one
returns, or gets 503 naming each replica after ``wait_s``; discovery from bucket heartbeats (join,
leave when stale, malformed or plain-http URLs ignored with a warning); a replica too far behind
is drained; per-replica headers replace the caller's Authorization; an idle client connection is
kept longer than its client keeps it for reuse.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time

import httpx
import pytest

from deltasync.status import ReplicaHeartbeat, write_heartbeat
from deltasync.store import Store
from trainer.fleet.pool import ReplicaPool, parse_vllm_urls
from trainer.fleet.router import FleetRouter

from .fleet_fakes import FakeReplica, free_port

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
KEY = (
    "test-run-key"  # the router's run key (FleetRouter(key=)); test_router_key checks it is needed
)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def fleet():
    """fleet(urls, **pool_kw) -> (pool, router URL); everything stopped at the end."""
    started: list = []

    def make(urls=None, wait_s=30.0, request_timeout_s=10.0, **kw):
        pool = ReplicaPool(urls, health_interval_s=0.2, **kw).start()
        router = FleetRouter(
            pool, wait_s=wait_s, request_timeout_s=request_timeout_s, log_every_s=0.5, key=KEY
        )
        started.append((pool, router))
        return pool, router.start(free_port())

    yield make
    for pool, router in started:
        router.stop()
        pool.stop()


@pytest.fixture
def replicas():
    made: list[FakeReplica] = []

    def make(n: int, **kw) -> list[FakeReplica]:
        out = [FakeReplica(**kw).start() for _ in range(n)]
        made.extend(out)
        return out

    yield make
    for r in made:
        r.stop()


def post_many(url: str, n: int, concurrency: int = 8) -> list[httpx.Response]:
    with (
        httpx.Client(timeout=60, headers=AUTH) as c,
        concurrent.futures.ThreadPoolExecutor(concurrency) as ex,
    ):
        return list(ex.map(lambda _: c.post(f"{url}/v1/completions", json=BODY), range(n)))


def test_requests_spread_over_every_healthy_replica(fleet, replicas):
    a, b = replicas(2, delay_s=0.05)
    pool, url = fleet([a.url, b.url])
    out = post_many(url, 40)
    assert all(r.status_code == 200 for r in out)
    assert all(r.json()["echo"] == BODY for r in out)  # the body reached a replica unchanged
    by = {r.headers["X-Deltasync-Replica"] for r in out}
    assert by == {a.url, b.url}
    assert min(a.requests, b.requests) >= 0.2 * 40  # each serves at least 20%
    assert all(r.headers["X-Deltasync-Version"] == "1" for r in out)
    by_version = [p["served_by_version"] for p in pool.replica_rows()]
    assert sum(v[1] for v in by_version) == 40  # every answer counted under its version


def test_refused_503_and_hanging_replicas_lose_no_request(fleet, replicas):
    good, busy, hung, dead = replicas(4)
    busy.mode = "503"  # re-anchoring
    hung.mode, hung.hang_s = "hang", 5.0
    dead.stop()  # refuses connections
    pool, url = fleet([good.url, busy.url, hung.url, dead.url], request_timeout_s=1.0)
    for r in (busy, hung):  # make them look healthy to the router: /health still answers
        assert any(p["url"] == r.url and p["state"] == "serving" for p in pool.replica_rows())
    out = post_many(url, 12, concurrency=4)
    assert [r.status_code for r in out] == [200] * 12
    assert {r.headers["X-Deltasync-Replica"] for r in out} == {good.url}
    failed = {p["url"]: p["failed"] for p in pool.replica_rows()}
    assert failed[busy.url] >= 1 and failed[hung.url] >= 1 and failed[dead.url] >= 1


def test_a_server_error_every_replica_gives_is_handed_back(fleet, replicas):
    a, b = replicas(2)
    a.mode = b.mode = "500"
    _, url = fleet([a.url, b.url], wait_s=60.0)
    r = httpx.post(f"{url}/v1/completions", json=BODY, headers=AUTH, timeout=30)
    assert r.status_code == 500 and a.requests == 1 and b.requests == 1


def test_no_replica_waits_then_goes_on_when_one_returns(fleet, replicas, caplog):
    (a,) = replicas(1)
    a.stop()
    pool, url = fleet([a.url], wait_s=60.0)
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(f"{url}/v1/completions", json=BODY, headers=AUTH, timeout=60)
        )
    )
    with caplog.at_level(logging.WARNING, logger="trainer.fleet"):
        t.start()
        time.sleep(1.5)
        assert t.is_alive()  # waiting, not failed
        a.start()  # the replica comes back on the same port
        t.join(30)
    assert result["r"].status_code == 200
    assert any("waiting" in m and a.url in m for m in caplog.messages)


def test_no_replica_for_wait_s_is_a_503_that_names_each_replica(fleet, replicas):
    (a,) = replicas(1)
    a.stop()
    _, url = fleet([a.url], wait_s=1.0)
    r = httpx.post(f"{url}/v1/completions", json=BODY, headers=AUTH, timeout=30)
    assert r.status_code == 503
    assert a.url in r.json()["error"] and "down" in r.json()["error"]


def test_discovery_from_heartbeats_join_leave_and_bad_urls(replicas, caplog):
    a, b = replicas(2)
    store = Store("memory://fleet-discovery")

    def announce(rid: str, url: str, age_s: float = 0.0) -> None:
        write_heartbeat(
            store,
            ReplicaHeartbeat(
                replica_id=rid,
                held_version=1,
                newest_seen=1,
                lag_versions=0,
                lag_s=0.0,
                status="ok",
                url=url,
                updated_at=time.time() - age_s,
            ),
        )

    pool = ReplicaPool(
        store=store, heartbeat_max_age_s=60.0, require_https=True, discover_interval_s=0.0
    )  # every refresh reads the heartbeats
    announce("a", a.url)
    announce("evil", "http://203.0.113.7:8000")  # plain http off loopback, remote bucket
    announce("bad", "ftp://x/y")
    with caplog.at_level(logging.WARNING, logger="trainer.fleet"):
        pool.refresh()
    assert [p["url"] for p in pool.replica_rows()] == [a.url]
    assert sum("ignored" in m for m in caplog.messages) == 2
    announce("b", b.url)  # joins late
    pool.refresh()
    assert {p["url"]: p["state"] for p in pool.replica_rows()} == {
        a.url: "serving",
        b.url: "serving",
    }
    announce("a", a.url, age_s=120.0)  # its heartbeat goes stale: it leaves
    pool.refresh()
    assert {p["url"]: p["state"] for p in pool.replica_rows()} == {a.url: "gone", b.url: "serving"}
    assert pool.acquire(exclude=set()).url == b.url
    pool.stop()


def test_a_heartbeat_that_does_not_parse_is_skipped_and_the_good_replica_joins(
    fleet, replicas, caplog
):
    """One damaged heartbeat and one of a newer schema (a field this reader forbids) next to a
    good one: the pool starts (its first refresh runs outside the upkeep loop's guard), the good
    replica is discovered and serves, and each skipped file is named in a warning."""
    (a,) = replicas(1)
    store = Store("memory://fleet-bad-heartbeat")
    good = ReplicaHeartbeat.empty("a", status="ok", held_version=1, newest_seen=1, url=a.url)
    write_heartbeat(store, good)
    store.write_bytes("replicas/garbage.json", b"\x00{not json")
    newer = json.loads(good.model_dump_json()) | {"replica_id": "newer", "gpu_temp_c": 61.0}
    store.write_bytes("replicas/newer.json", json.dumps(newer).encode())
    with caplog.at_level(logging.WARNING, logger="deltasync.status"):
        pool, url = fleet(store=store, discover_interval_s=0.0)
    assert {p["url"]: p["state"] for p in pool.replica_rows()} == {a.url: "serving"}
    assert (
        httpx.post(f"{url}/v1/completions", json=BODY, headers=AUTH, timeout=30).status_code == 200
    )
    skipped = [m for m in caplog.messages if "skipped" in m]
    assert any("replicas/garbage.json" in m for m in skipped)
    assert any("replicas/newer.json" in m and "gpu_temp_c" in m for m in skipped)


def test_a_replica_too_far_behind_is_drained(fleet, replicas):
    old, new = replicas(2)
    old.version, new.version = 1, 9
    pool, url = fleet([old.url, new.url], published_version_fn=lambda: 10, max_staleness=4)
    states = {p["url"]: p["state"] for p in pool.replica_rows()}
    assert states == {old.url: "draining", new.url: "serving"}
    out = post_many(url, 6)
    assert {r.headers["X-Deltasync-Replica"] for r in out} == {new.url} and old.requests == 0
    old.version = 8
    pool.refresh()
    assert {p["url"]: p["state"] for p in pool.replica_rows()}[old.url] == "serving"


def test_per_replica_headers_replace_the_callers_authorization(fleet, replicas):
    (a,) = replicas(1)
    _, url = fleet([a.url], headers_for=lambda u: {"Authorization": "Bearer replica-token"})
    r = httpx.post(
        f"{url}/v1/completions", json=BODY, headers=AUTH, timeout=30
    )  # the caller's Authorization (the router's run key) never reaches a replica
    assert r.status_code == 200
    assert a.auth == ["Bearer replica-token"]


def test_the_turns_of_an_episode_stay_on_their_replica_unless_it_fails(fleet, replicas):
    """Multi-turn episodes as TRL sends them: every later turn's prompt is the first prompt, the
    completion so far and a tool reply. Each later turn goes to its first turn's replica (its
    prefix cache), even where load alone would pick the other; when that replica fails, the
    episode goes on on the other one."""
    a, b = replicas(2)
    _, url = fleet([a.url, b.url])
    first = list(range(1, 41))  # one GRPO group: every episode starts from the same prompt

    def turn(c, prompt):
        r = c.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200
        return prompt + r.json()["choices"][0]["token_ids"] + [7, 7], r.headers[
            "X-Deltasync-Replica"
        ]

    with httpx.Client(timeout=30, headers=AUTH) as c:
        episodes = [turn(c, first) for _ in range(6)]  # first turns: spread by load
        assert {rep for _, rep in episodes} == {a.url, b.url}
        episodes.sort(key=lambda e: e[1])  # all of a's episodes, then b's: load alone would mix
        for _ in range(3):
            for i, (prompt, rep) in enumerate(episodes):
                nxt, got = turn(c, prompt)
                assert got == rep, f"turn of episode {i} went to {got}, its replica is {rep}"
                episodes[i] = (nxt, rep)
        a.mode = "503"  # the replica of half the episodes fails (re-anchoring): they go on on b
        for prompt, _ in episodes:
            assert turn(c, prompt)[1] == b.url


def test_vllm_url_lists_and_auto():
    assert parse_vllm_urls("https://a, https://b") == (["https://a", "https://b"], False)
    assert parse_vllm_urls("auto") == ([], True)
    assert parse_vllm_urls("auto,http://127.0.0.1:9") == (["http://127.0.0.1:9"], True)
    with pytest.raises(ValueError, match="VLLM_URL entry"):
        ReplicaPool(["not a url"])


def test_each_sample_is_tagged_with_the_oldest_version_that_answered_it(replicas):
    """Per-sample staleness: the trainer re-stamps each sample it takes from TRL's queue with the
    oldest bucket version that answered one of its turns (each answer's X-Deltasync-Version, as
    the router saw it), not with a fleet-wide guess made when its group started."""
    import queue
    from types import SimpleNamespace

    from trainer.loop.rollout_tagging import ReplicaVersionTagger

    old, new = replicas(1, version=3)[0], replicas(1, version=5)[0]
    pool = ReplicaPool([old.url, new.url], health_interval_s=0.2).start()
    router = FleetRouter(pool, wait_s=30.0, request_timeout_s=10.0, key=KEY)
    url = router.start(free_port())
    inner = SimpleNamespace(
        rollout_buffer=queue.Queue(),
        metrics_queue=queue.Queue(),
        update_model_version=lambda v: None,
    )
    published = {"v": None}
    tagger = ReplicaVersionTagger(
        inner,
        lambda: published["v"],
        lambda: None,
        poll_s=3600,
        sample_versions_fn=router.affinity.versions_of,
    )
    for trl, bucket in ((1, 3), (2, 4), (3, 5)):  # TRL versions 1..3 are bucket v3..v5
        published["v"] = bucket
        tagger.update_model_version(trl)
    try:
        with httpx.Client(timeout=30, headers=AUTH) as c:

            def episode(first, turns, fail_after=None):
                """Play ``turns`` turns; the replica of the first fails after ``fail_after``."""
                prompt, used = list(first), None
                for t in range(turns):
                    if t == fail_after:
                        {old.url: old, new.url: new}[used].mode = "503"
                    r = c.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4})
                    used = used or r.headers["X-Deltasync-Replica"]
                    prompt = prompt + r.json()["choices"][0]["token_ids"] + [7, 7]
                return prompt[:-2], used  # the sample's tokens: prompts and completions

            samples = [episode(range(1, 30), 3) for _ in range(2)]  # one on each replica
            by = {used: tokens for tokens, used in samples}
            assert set(by) == {old.url, new.url}
            moved, first_on = episode(range(40, 70), 3, fail_after=1)  # turn 2 onwards elsewhere
    finally:
        router.stop()
        pool.stop()
    stale_group_tag = 0
    cases = [(by[old.url], 1), (by[new.url], 3), (list(range(500, 540)), stale_group_tag)]
    assert first_on == old.url  # a tie goes to the first replica listed
    cases.append((moved, 1))  # began on v3, finished on v5: as old as its oldest turn
    for i, (tokens, _) in enumerate(cases):  # the RolloutSample fields the tagger reads
        sample = SimpleNamespace(
            input_ids=tokens,
            model_version=stale_group_tag,
            completion=[],
            completion_mask=[1] * len(tokens),
            group_id=i,
            metrics={"reward": 0.0},
        )
        inner.rollout_buffer.put(sample)
    got = [tagger.rollout_buffer.get(timeout=1).model_version for _ in cases]
    assert got == [want for _, want in cases]
    assert tagger.per_sample_tags == len(cases) - 1  # the unknown sample keeps its group's tag


def test_a_client_that_disconnects_mid_body_is_logged_and_the_router_serves_on(
    fleet, replicas, caplog
):
    """A raw socket announces a 1,000-byte body, sends 10 bytes and closes: nothing is
    forwarded, the router logs one line (no traceback), and the next request is answered."""
    import socket

    (a,) = replicas(1)
    _, url = fleet([a.url])
    host, port = url.removeprefix("http://").split(":")
    caplog.set_level(logging.INFO, logger="trainer.fleet")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model":"'
        )
    deadline = time.monotonic() + 10
    while "disconnected before its request arrived" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    assert a.requests == 0
    r = httpx.post(f"{url}/v1/completions", json=BODY, headers=AUTH, timeout=30)
    assert r.status_code == 200 and a.requests == 1


def test_an_idle_client_connection_is_kept_past_uvicorns_default(fleet, replicas):
    """One keep-alive connection, idle 6 s after its first answer (uvicorn closes one after 5 s
    by default; TRL's aiohttp client reuses one for 15 s), still gets its second answer.
    ``http.client`` does not reconnect: a connection the router closed fails the second request
    (``RemoteDisconnected``)."""
    import http.client
    import json

    (a,) = replicas(1)
    _, url = fleet([a.url])
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    statuses = []
    try:
        for _ in range(2):
            conn.request(
                "POST",
                "/v1/completions",
                json.dumps(BODY),
                {"Content-Type": "application/json", **AUTH},
            )
            r = conn.getresponse()
            r.read()
            statuses.append(r.status)
            if len(statuses) == 1:
                time.sleep(6)
    finally:
        conn.close()
    assert statuses == [200, 200] and a.requests == 2


def test_a_busy_replica_whose_health_times_out_is_not_taken_down(fleet, replicas, caplog):
    """Under an evaluation's load on 2 cores a replica's ``/health`` outlived the pool's timeout
    while it still answered every request; the fleet marked it down and up again for minutes.
    Now a replica that answered within ``busy_grace_s`` stays serving through slow health checks
    (counted as failures), while one that never answered is down."""
    busy, silent = replicas(2)
    pool, url = fleet([busy.url], health_timeout_s=0.3, busy_grace_s=60.0)
    assert [r.status_code for r in post_many(url, 8)] == [200] * 8
    busy.health_delay_s = 1.0
    caplog.set_level(logging.INFO, logger="trainer.fleet.pool")
    failed = pool.replica_rows()[0]["failed"]
    deadline = time.monotonic() + 30
    while pool.replica_rows()[0]["failed"] < failed + 2 and time.monotonic() < deadline:
        time.sleep(0.1)  # waits for two health rounds that timed out
    row = pool.replica_rows()[0]
    assert row["failed"] >= failed + 2 and row["state"] == "serving"
    assert "-> down" not in caplog.text
    assert [r.status_code for r in post_many(url, 4)] == [200] * 4
    silent.health_delay_s = 1.0  # never answered a request: a timed-out health is down
    other = ReplicaPool([silent.url], health_timeout_s=0.3)
    other.check_health()
    assert other.replica_rows()[0]["state"] == "down"
    other.stop()
