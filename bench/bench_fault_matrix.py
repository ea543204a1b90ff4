"""The fault matrix (issue 54): each fault injected while training runs, one row per fault.

For each fault a fresh folder bucket, a trainer stand-in publishing the tiny Qwen3 (bf16, ~1% of
its elements one ulp apart from the version before) every ``--interval-s`` through a real
``DeltaPublisher`` (anchor every 5 versions), and one replica following it: a real ``SyncLoop``
on a fake engine that keeps the bf16 bits it is given (``bench/fault_harness.py``; the in-place
apply path of a GPU replica). After every poll the bits the engine serves are compared with the
trainer's bits of the version the replica reports. The fault hits mid-run; training goes on
through it, then stops, flushes and closes, and the replica must reach the newest version.

Columns: the fault; the store; when it hit (the trainer's step and newest version, the
replica's); what the replica and the trainer did; how it was detected (error type, heartbeat
status, last_error); recovery seconds (from the fault's end, or its hit for a one-shot fault,
until the replica serves at least the newest version the trainer had published at that moment,
status ok); versions lost (committed by a publisher, later missing from the manifest, and not
dropped by retention; must be 0); bit-exact at the end (every tensor the engine serves equals
the trainer's final bf16 bits, and the replica is on the newest version). A product failure
is written into the row as "FAILED: ...". Results: bench/results/fault_matrix.json.

Rows 2 and 7 run again on ``hf://`` through the local Hub (tools/local_hub, a child process; the
real huggingface_hub and hf_xet clients), row 7 as 503s for the trainer's token
(``--local-hub 0`` skips them). ``--smoke``: six faults, shorter outages, no local Hub.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace

import numpy as np
from report import parse_with_smoke, save, smoke_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fault_harness import (  # noqa: E402
    WAIT_S,
    FaultStore,
    Killed,
    LocalHub,
    LogTap,
    Replica,
    Training,
    audit_commits,
    audit_losses,
    committed_payloads,
    hostile_blob,
    manifest_of,
    payload_bytes,
    short,
    state_path,
    wait_for,
)

from deltasync.bf16 import bytes_digest, digest, to_bf16_bits  # noqa: E402
from deltasync.errors import ConcurrentWriterError, StoreNotFoundError  # noqa: E402
from deltasync.manifest import MANIFEST_PATH  # noqa: E402
from deltasync.publisher import DeltaPublisher, PublisherConfig  # noqa: E402
from deltasync.signing import RunKey, sign_manifest  # noqa: E402
from deltasync.store import Store  # noqa: E402


class World:
    """One scenario: a bucket, a training thread, a replica, and what the fault did."""

    def __init__(
        self,
        name: str,
        root: str,
        bits: dict,
        args,
        pub_store=None,
        rep_store=None,
        hub=None,
        signed: bool = False,
    ):
        self.name, self.args, self.hub = name, args, hub
        # a signed run: the trainer signs each manifest with the run key, the replica checks it
        self.key = RunKey.generate() if signed else None
        slug = name.split()[0]
        if hub is None:
            self.bucket, opts, rep_opts = os.path.join(root, slug), {}, {}
        else:  # hf:// through the local Hub; the replica has a token of its own
            self.bucket = f"hf://buckets/me/fm-{slug}"
            hub.api.create_bucket(f"me/fm-{slug}", private=True, exist_ok=True)
            opts = dict(endpoint=hub.url, token=hub.tokens["me-write"])
            rep_opts = dict(endpoint=hub.url, token=hub.replica_token)
        self.store = Store(self.bucket, **opts)
        self.cfg = PublisherConfig(anchor_every=5)
        self.outages: list = []
        self.pub_store = pub_store(self.bucket) if pub_store else None
        pub = self.publisher(self.pub_store or Store(self.bucket, **opts))
        self.training = Training({n: a.copy() for n, a in bits.items()}, pub, args.interval_s)
        self.rep_store = rep_store(self.bucket) if rep_store else None
        loop_kw = dict(max_poll_interval_s=1.0) if hub else {}
        if self.key is not None:
            loop_kw["public_key"] = self.key.public_key
        self.replica = Replica(
            self.rep_store or (Store(self.bucket, **rep_opts) if hub else self.bucket),
            self.training,
            os.path.join(root, "stage-" + slug + ("-hub" if hub else "")),
            public_url="http://127.0.0.1:18001",
            **loop_kw,
        )
        self.store_kind = "folder" if hub is None else "local Hub (hf://)"
        self.hit_info: dict | None = None
        self.t_end: float | None = None
        self.target: int | None = None
        self.replica_notes: list[str] = []
        self.trainer_notes: list[str] = []
        self.detect: list[str] = []
        self.failed: list[str] = []
        self.applies_at_hit = 0
        self.first_commit_note = False  # the row names the first commit after the fault
        self.tap = LogTap("deltasync", "rollout", "trainer")

    def publisher(self, store, **cfg) -> DeltaPublisher:
        pub = DeltaPublisher(store, config=replace(self.cfg, **cfg), signer=self.key)
        pub.on_outage = self.outages.append
        return pub

    # ----------------------------------------------------------------------------- timeline
    def start(self) -> None:
        self.training.start()
        self.replica.start()
        self.training.wait_steps(4)
        if not self.replica.wait_serving(2, WAIT_S):
            self.failed.append("the replica did not reach v2 before the fault")

    def hit(self, what: str, t: float | None = None) -> None:
        """The fault hit now (or at unix s ``t``): ``what`` it did."""
        if self.hit_info is not None:
            return
        loop = self.replica.loop
        self.hit_info = dict(
            t=t or time.time(),
            step=self.training.step,
            newest=self.training.newest,
            served=loop.served_version,
            what=what,
        )
        self.applies_at_hit = len(self.replica.eng.applies)

    def end(self, at_hit: bool = False) -> None:
        """The fault is over now (``at_hit``: a one-shot fault, over as it hit)."""
        self.t_end = self.hit_info["t"] if at_hit and self.hit_info else time.time()
        self.target = self.hit_info["newest"] if at_hit and self.hit_info else self.training.newest

    def settle(self) -> None:
        """Training goes on until the replica recovered, then ``--after-steps`` more steps."""
        if self.hit_info is None:
            self.failed.append("the fault never hit")
            return
        if self.t_end is None:
            self.end()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and self.training.stopped is None:
            if self.replica.recovered_at(self.t_end, self.target or 0) is not None:
                break
            time.sleep(0.05)
        self.training.wait_steps(self.args.after_steps)

    def finish(self) -> dict:
        tr = self.training
        tr.stop()
        pub = tr.pub
        for what, call in (("flush", lambda: pub.flush(timeout=60)), ("close", pub.close)):
            try:
                call()
            except BaseException as e:  # a product failure: reported in the row
                self.failed.append(f"trainer {what} raised {type(e).__name__}: {e}"[:300])
                break
        m = manifest_of(self.store)
        newest = m.latest.version
        reached = self.replica.wait_serving(newest, WAIT_S)
        self.replica.stop()
        return self.row(m, newest, reached)

    # --------------------------------------------------------------------------------- row
    def row(self, m, newest: int, reached: bool) -> dict:
        tr, rep, eng, loop = self.training, self.replica, self.replica.eng, self.replica.loop
        kept = {v.version for v in m.versions}
        floor = min(kept)
        committed = tr.committed()
        lost, broken, commits = audit_losses(self.store.uri)
        lost = sorted(set(lost) | {v for v in committed if v >= floor and v not in kept})
        if lost:
            self.failed.append(f"versions {lost} committed, then dropped from a later manifest")
        if broken:
            self.failed.append(f"deltas {broken} committed without their base in the manifest")
        if tr.stopped is not None and not isinstance(tr.stopped, Killed):
            self.trainer_notes.append(f"stopped: {type(tr.stopped).__name__}")
        if tr.newest != newest:
            self.failed.append(f"the trainer's newest v{tr.newest} is not the manifest's v{newest}")
        want = tr.truth.get(newest, {})
        served = eng.served_digests()
        exact = (
            reached
            and loop.served_version == newest
            and bool(want)
            and all(np.array_equal(eng.weights[n], a) for n, a in want.items())
            and all(served[n] == digest(a) for n, a in want.items())
            and loop.held.digests == served
        )
        if not exact:
            self.failed.append(
                f"replica ends on v{loop.served_version} ({loop.status.value}), newest v{newest}"
            )
        if rep.mismatches:
            self.failed.append(f"served bits other than the version reported: {rep.mismatches[:2]}")
        if rep.raised:
            self.failed.append(f"poll_once raised: {rep.raised[:1]}")
        hit = self.hit_info or {}
        t_ref = self.t_end or hit.get("t", time.time())
        rec_t = rep.recovered_at(t_ref, self.target or 0) if hit else None
        recovery = None if rec_t is None else round(max(0.0, rec_t - t_ref), 2)
        if hit and recovery is None:
            self.failed.append("the replica did not recover before the run ended")
        t_hit = hit.get("t", 0)
        t_rec = rec_t or time.time()
        before = [s for t, s in rep.states if t < t_hit][-1:]
        window = [s for t, s in rep.states if t_hit <= t <= t_rec + 0.01]
        statuses = state_path([s for s in before + window if s not in ("syncing", "stopped")])
        errors = [e[4] for e in rep.since(hit.get("t", 0)) if e[4]]
        first_error = next(
            (e for e in errors if e != (rep.timeline[0][4] if rep.timeline else None)), None
        )
        if first_error and not any("replica" in d for d in self.detect):
            self.detect.insert(0, f"replica: {short(first_error, 110)}")
        reloads = sum(
            1
            for r in self.tap.records
            if "recovered: full reload" in r[2] and r[0] >= hit.get("t", 0)
        )
        replica_did = "; ".join(
            [f"status {statuses}" if statuses else "status ok", *self.replica_notes]
            + ([f"{reloads} full reload(s), checked"] if reloads else [])
        )
        if self.first_commit_note and hit:
            after = sorted(
                (e for p in tr.publishers for e in p.published if e.created_at >= hit["t"]),
                key=lambda e: e.version,
            )
            if after:
                e = after[0]
                kind = "anchor" if e.base_version is None else f"delta on v{e.base_version}"
                self.trainer_notes.append(
                    f"first commit after the hit: v{e.version} ({kind}, {e.coalesced} folded) "
                    f"at +{e.created_at - hit['t']:.1f}s"
                )
        versions = sorted(committed)
        trainer_did = "; ".join(
            [
                f"published {tr.step} steps, committed {len(committed)} versions "
                f"(v{versions[0]}..v{versions[-1]})"
                if versions
                else "committed nothing",
                *self.trainer_notes,
            ]
        )
        where = (
            f"step {hit['step']} / trainer v{hit['newest']}, replica v{hit['served']}: {hit['what']}"
            if hit
            else "-"
        )
        return dict(
            fault=self.name,
            store=self.store_kind,
            hit=where,
            replica=replica_did,
            trainer=trainer_did,
            detected=" | ".join(self.detect) or "-",
            recovery_s=recovery,
            versions_lost=len(lost),
            lost=lost,
            commits=commits,
            bit_exact=exact,
            failed=self.failed,
            newest=newest,
            manifest_versions=sorted(kept),
            publish_max_ms=round(1e3 * max(tr.calls_s), 1) if tr.calls_s else None,
            checks=rep.checked,
            polls_timeline=[list(e[1:4]) for e in rep.timeline][-40:],
        )


# ------------------------------------------------------------------------------ the faults
def staging_full_disk(w: World, syncs: int = 1) -> None:
    """Rows 1 and 13: the replica's staging file write hits ENOSPC ``syncs`` times."""
    import rollout.staging as staging

    real, calls = staging.serialize_file, []

    def full_disk(*args, **kwargs):
        if len(calls) < syncs:
            calls.append(time.time())
            w.hit(f"staging v{w.replica.loop.held.version} (ENOSPC x{syncs})")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    staging.serialize_file = full_disk
    try:
        wait_for(lambda: len(calls) >= syncs)
    finally:
        staging.serialize_file = real
    w.end(at_hit=syncs == 1)
    w.replica_notes.append(f"the pull was kept; next stage from served v{w.hit_info['served']}")


def old_manifest_written_back(w: World) -> None:
    """Row 2: an older manifest.json written over the current one, again and again for a while
    (the Hub answering an older manifest)."""
    old = w.store.read_bytes(MANIFEST_PATH)
    old_v = manifest_of(w.store).latest.version
    w.training.wait_steps(3)
    cur = manifest_of(w.store).latest.version
    w.hit(f"v{old_v}'s manifest written over v{cur}'s for {w.args.stale_s:.0f}s")
    t_end = time.monotonic() + w.args.stale_s
    writes = 0
    while time.monotonic() < t_end:
        w.store.write_bytes(MANIFEST_PATH, old)
        writes += 1
        time.sleep(0.05)
    w.end()
    w.trainer_notes.append(f"{writes} rewrites of the old manifest")


def failed_resume(w: World) -> None:
    """Row 3: one ``/resume`` after an apply answers 500."""
    eng = w.replica.eng
    eng.on_fail = lambda call: w.hit(f"{call} after the apply of v{w.replica.loop.held.version}")
    eng.fail_resume = 1
    wait_for(lambda: eng.failed)
    w.end(at_hit=True)


def damaged_delta(w: World, how: str) -> None:
    """Rows 4a/4b/10: a committed delta part replaced just before the manifest names it (the
    publisher's ``before_commit`` seam): ``hostile`` (a part whose first tensor's blob is the
    314-byte hostile blob; the manifest names its size and digest, so it reaches the decoder),
    ``truncated`` (half the part), ``foreign`` (a delta part of another run)."""
    from deltasync import deltafile

    done = threading.Event()
    pub = w.training.pub

    def damage(entry):
        if done.is_set() or entry.delta is None:
            return
        f = entry.delta.files[0]
        data = w.store.read_bytes(f.path)
        if how == "hostile":
            part = deltafile.read_part(data)
            name = next(iter(part.tensors))
            pt = part.tensors[name]
            label = deltafile.PartLabel(
                part.version, part.base_version, part.run_id, part.part, part.parts
            )
            blob = hostile_blob()
            bad = deltafile.delta_part(
                label, {name: blob}, {name: pt.shape}, {name: pt.digest}, {name: pt.changed}
            )
            f.bytes, f.digest = len(bad), bytes_digest(bad)
            what = f"v{entry.version}: a {len(blob)}-byte blob claiming 256 x 400k elements"
        elif how == "truncated":
            bad = data[: len(data) // 2]
            what = f"v{entry.version}'s part truncated to {len(bad)} of {len(data)} bytes"
        else:
            bad = w.foreign_part
            what = f"v{entry.version}'s part replaced by another run's ({len(bad)} bytes)"
        w.store.write_bytes(f.path, bad)
        w.hit(what)
        done.set()

    pub.before_commit = damage
    done.wait(WAIT_S)
    pub.before_commit = None
    w.end(at_hit=True)


def restart_with_spurious_404(w: World) -> None:
    """Row 5: the trainer restarts (a clean close, a new publisher on the same bucket) and its
    first read of manifest.json answers not-found."""
    tr = w.training
    tr.stop()
    tr.pub.close()
    before = payload_bytes(w.store)
    misses: list[float] = []

    def one_404(what, path):
        if what == "read" and path == MANIFEST_PATH and not misses:
            misses.append(time.time())
            raise StoreNotFoundError(f"simulated spurious 404 for {path}")

    last = tr.pub.latest_committed
    try:
        pub = w.publisher(FaultStore(w.bucket, one_404))
    except Exception as e:  # the restart refused: the trainer is down
        w.failed.append(f"the restart raised {type(e).__name__}: {e}"[:300])
        w.hit("restart", misses[0] if misses else None)
        tr.start()  # with the closed publisher: it raises at once and the run stops here
        return
    w.hit(f"restart after v{last}; manifest read 404 once", misses[0] if misses else None)
    after = payload_bytes(w.store)
    gone = sorted(set(before) - set(after))
    changed = sorted(p for p in after if p in before and after[p] != before[p])
    if gone or changed:
        w.failed.append(f"the restart deleted {gone[:3]} / changed {changed[:3]}")
    w.detect.append("trainer: read manifest again after the 404 (payloads listed)")
    w.trainer_notes.append(
        f"resumed at v{pub.latest_committed} (was v{last}), deleted {len(gone)} of "
        f"{len(before)} payload files"
    )
    tr.swap(pub)
    tr.start()
    w.end()


def second_trainer(w: World, takeover: bool) -> None:
    """Rows 6a/6b: a second DeltaPublisher on the bucket while the first runs; without
    takeover it must be refused at its start, with takeover the first must stop at its next
    commit. Every committed payload file keeps its bytes."""
    before = committed_payloads(w.store)
    tr = w.training
    try:
        second = w.publisher(w.bucket, takeover=takeover)
    except ConcurrentWriterError as e:
        w.hit("a second trainer starts")
        w.detect.append(f"second trainer: ConcurrentWriterError: {short(e, 110)}")
        w.trainer_notes.append("the second trainer was refused at its start; the first went on")
        second = None
    else:
        w.hit("a second trainer takes over")
        if not takeover:
            w.failed.append("a second trainer started beside a live one")
    if takeover and second is not None:
        wait_for(lambda: tr.stopped is not None, 10)
        if tr.stopped is None:
            w.failed.append("the first trainer did not stop")
        else:
            w.detect.append(f"first trainer: {type(tr.stopped).__name__}: {short(tr.stopped, 110)}")
        tr.stop()
        try:
            tr.pub.close()
        except ConcurrentWriterError:
            pass  # its close keeps the error and releases nothing: expected
        w.trainer_notes.append(
            f"the first stopped at step {tr.step}; the second (same bits) goes on from "
            f"v{second.latest_committed}"
        )
        tr.swap(second)
        tr.start()
    w.end()
    w.training.wait_steps(3)
    m = manifest_of(w.store)
    floor = min(v.version for v in m.versions)
    changed, lost = [], []
    for path, (version, data) in before.items():
        try:
            now = w.store.read_bytes(path)
        except StoreNotFoundError:
            if version >= floor:
                lost.append(path)
            continue
        if now != data:
            changed.append(path)
    if changed or lost:
        w.failed.append(f"committed payloads changed {changed[:2]} / lost {lost[:2]}")
    w.trainer_notes.append(
        f"{len(before)} committed payload files compared: {len(changed)} changed"
    )


def store_trouble(w: World, kind: str, seconds: float, replica_too: bool = False) -> None:
    """Rows 7 and 8: the publisher's store (and the replica's, ``replica_too``) fails every
    attempt for ``seconds``: ``outage`` (refused connections, longer than the store's retries)
    or ``429`` (rate limited, ``Retry-After`` 0.5 s)."""
    stores = [w.pub_store] + ([w.rep_store] if replica_too else [])
    n0 = len(w.outages)
    for s in stores:
        s.down = kind
    w.hit(f"{'429 burst' if kind == '429' else 'store down'} for {seconds:.1f}s")
    time.sleep(seconds)
    for s in stores:
        s.down = None
    w.end()
    outage_report(w, n0, f"{sum(s.failed_attempts for s in stores)} failed attempts")
    throttled = [r for r in w.tap.records if "rate limited (429)" in r[2]]
    if throttled:
        w.detect.append(f"store: {len(throttled)} x '{short(throttled[0][2], 70)}'")


def hub_outage(w: World) -> None:
    """Row 7 on the local Hub: every request of the trainer's token answers 503 for
    ``--hub-outage-s`` (huggingface_hub retries 503s itself, 1 s doubling to 8 s)."""
    n0, seconds = len(w.outages), w.args.hub_outage_s
    w.hub.admin("POST", "/admin/faults", {"kind": "503", "seconds": seconds, "token": "me-write"})
    w.hit(f"the Hub answers the trainer's token 503 for {seconds:.0f}s")
    time.sleep(seconds)
    w.hub.admin("DELETE", "/admin/faults")
    w.end()
    outage_report(w, n0, "huggingface_hub's and the store's retries")


def outage_report(w: World, n0: int, absorbed: str) -> None:
    """The trainer's side of a store fault: its outage reports and first commit after."""
    if w.outages[n0:]:
        wait_for(lambda: any(o.ended_at for o in w.outages[n0:]), WAIT_S)
    reports = w.outages[n0:]
    if reports:
        o = reports[-1]
        w.detect.append(f"trainer on_outage: {short(o.last_error, 90)}")
        w.trainer_notes.append(
            f"publish() never raised; outage {o.duration_s():.1f}s, {o.failures} failed "
            f"attempts, then v{o.committed} committed"
        )
    else:
        w.trainer_notes.append(f"no outage: absorbed by {absorbed}")
    w.first_commit_note = True
    if w.training.stopped is not None:
        w.failed.append(f"the trainer stopped: {type(w.training.stopped).__name__}")


def garbage_heartbeat(w: World) -> None:
    """Row 9: a heartbeat of garbage in replicas/ beside the good one; the trainer's
    ReplicaPool must still discover the good replica."""
    from trainer.fleet.pool import ReplicaPool

    w.store.write_bytes(
        "replicas/zz-garbage.json", b'{"replica_id": 7, "status": \xff\xfe' + os.urandom(64)
    )
    w.hit("replicas/zz-garbage.json written")
    pool = ReplicaPool(store=Store(w.bucket))
    try:
        pool.discover()
        found = {r.replica_id: url for url, r in pool.replicas.items()}
    finally:
        pool._http.close()
    if found.get("r0") != "http://127.0.0.1:18001":
        w.failed.append(f"the pool found {found}, not replica r0")
    skipped = [r[2] for r in w.tap.records if "zz-garbage" in r[2]]
    w.detect.append(f"pool: {short(skipped[0], 110)}" if skipped else "pool: no warning")
    w.trainer_notes.append(f"ReplicaPool.discover found {sorted(found)}")
    w.end()


def foreign_manifest(w: World) -> None:
    """Row 11: the replica reads another run's manifest.json for a while (its store answers
    it); the bucket itself is unchanged."""
    w.rep_store.answers[MANIFEST_PATH] = w.foreign_manifest
    w.hit(f"the replica reads another run's manifest for {w.args.stale_s:.0f}s")
    time.sleep(w.args.stale_s)
    w.rep_store.answers.clear()
    w.end()


def forged_manifests(w: World) -> None:
    """Row 15 (a signed run): someone who can write the bucket writes manifests over the
    trainer's for a while, in turn: the newest one with a payload's SHA-256 changed after it was
    signed, the same re-signed by their own key, and the same unsigned."""
    m = manifest_of(w.store)
    files = m.latest.delta.files if m.latest.delta else m.latest.anchor.files
    ref = files[0].model_copy(update={"sha256": "0" * 64})
    entry = m.latest.delta or m.latest.anchor
    changed_entry = entry.model_copy(update={"files": [ref, *files[1:]]})
    field = "delta" if m.latest.delta else "anchor"
    latest = m.latest.model_copy(update={field: changed_entry})
    changed = m.model_copy(update={"versions": [*m.versions[:-1], latest]})
    forged = [
        changed.to_json(),  # signature kept: does not verify
        sign_manifest(
            changed.model_copy(update={"signature": None}), RunKey.generate()
        ).to_json(),  # another key's signature
        changed.model_copy(update={"signature": None}).to_json(),  # unsigned
    ]
    w.hit(f"forged manifests of v{m.latest.version} written over the trainer's")
    t_end = time.monotonic() + w.args.stale_s
    writes = 0
    while time.monotonic() < t_end:
        w.store.write_bytes(MANIFEST_PATH, forged[writes % 3])
        writes += 1
        time.sleep(0.05)
    w.end()
    w.trainer_notes.append(f"{writes} forged manifests written")
    refused = sorted(
        {
            name
            for name in ("SignatureError", "ForeignKeyError", "UnsignedVersionError")
            if any(name in r[2] for r in w.tap.records)
        }
    )
    w.detect.append("replica refused: " + (", ".join(refused) or "nothing logged"))


def killed_mid_anchor(w: World) -> None:
    """Row 12: the trainer dies between two parts of an anchor upload (no close, its lease left
    fresh); a restarted trainer takes the run over, removes the dead one's parts, resumes."""
    store, tr = w.pub_store, w.training
    parts: list[str] = []
    killed = threading.Event()

    def kill(what, path):
        if what in ("write", "upload") and path.startswith("anchors/") and not killed.is_set():
            parts.append(path)
            if len(parts) == 2:
                killed.set()
                raise Killed("SIGKILL between two anchor parts")

    dead = tr.pub
    store.hook = kill
    killed.wait(WAIT_S)
    w.hit(f"anchor upload, after part {parts[0].rsplit('/', 1)[-1] if parts else '?'}")
    tr.stop()  # the process is gone: no close, no cleanup
    dead._thread.join(WAIT_S)
    committed = committed_payloads(w.store)
    orphans = sorted(set(payload_bytes(w.store)) - set(committed))
    try:
        w.publisher(w.bucket)
        w.failed.append("a restart beside a fresh lease was not refused")
    except ConcurrentWriterError as e:
        w.detect.append(f"restart without takeover: ConcurrentWriterError: {short(e, 80)}")
    pub = w.publisher(w.bucket, takeover=True)
    left = sorted(set(payload_bytes(w.store)) - set(committed_payloads(w.store)))
    after = committed_payloads(w.store)
    changed = [p for p, (_, b) in committed.items() if after.get(p, (0, b))[1] != b]
    if left or changed:
        w.failed.append(f"after the restart: orphans {left[:2]}, changed {changed[:2]}")
    w.trainer_notes.append(
        f"died at step {tr.step} ({type(dead._error).__name__}); restarted with takeover: "
        f"{len(orphans)} orphan part(s) removed, resumed at v{pub.latest_committed}"
    )
    tr.swap(pub)
    tr.start()
    w.end()


def failed_apply(w: World) -> None:
    """Row 14: an apply inside the engine fails once and leaves a tensor half-applied."""
    eng = w.replica.eng
    eng.on_fail = lambda call: w.hit(f"{call}: apply of v{w.replica.loop.held.version}")
    eng.fail_apply = 1
    wait_for(lambda: eng.failed)
    w.end(at_hit=True)


# --------------------------------------------------------------------------------- matrix
def flaky(**kw):
    return lambda bucket: FaultStore(bucket, **kw)


FAULTS = {
    # key: (row name, scenario, World kwargs)
    "enospc": ("1 staging ENOSPC once", lambda w: staging_full_disk(w, 1), {}),
    "stale": ("2 older manifest written back", old_manifest_written_back, {}),
    "resume": ("3 one failed /resume", failed_resume, {}),
    "hostile": ("4a hostile 314-byte delta blob", lambda w: damaged_delta(w, "hostile"), {}),
    "truncated": ("4b truncated delta part", lambda w: damaged_delta(w, "truncated"), {}),
    "restart404": ("5 restart, spurious 404 on manifest", restart_with_spurious_404, {}),
    "two": ("6a second trainer (no takeover)", lambda w: second_trainer(w, False), {}),
    "takeover": ("6b second trainer (takeover)", lambda w: second_trainer(w, True), {}),
    "outage": (
        "7 store outage > retries",
        lambda w: store_trouble(w, "outage", w.args.outage_s),
        dict(pub_store=flaky(retries=3, backoff_s=0.05)),
    ),
    "429": (
        "8 429 burst (trainer + replica)",
        lambda w: store_trouble(w, "429", w.args.burst_s, replica_too=True),
        dict(pub_store=flaky(), rep_store=flaky()),
    ),
    "heartbeat": ("9 garbage heartbeat", garbage_heartbeat, {}),
    "foreignpart": ("10 part from another run", lambda w: damaged_delta(w, "foreign"), {}),
    "foreignmanifest": ("11 manifest from another run", foreign_manifest, dict(rep_store=flaky())),
    "killed": (
        "12 trainer killed mid-anchor upload",
        killed_mid_anchor,
        dict(pub_store=flaky()),
    ),
    "enospc3": ("13 staging ENOSPC 3 syncs", lambda w: staging_full_disk(w, 3), {}),
    "apply": ("14 failed apply in the engine", failed_apply, {}),
    "forged": ("15 forged manifests (signed run)", forged_manifests, dict(signed=True)),
}
SMOKE_FAULTS = ["enospc", "stale", "truncated", "outage", "killed", "apply"]
HUB_FAULTS = {
    "stale": ("2 older manifest written back", old_manifest_written_back),
    "outage": ("7 Hub outage (503s)", hub_outage),
}


def other_run(root: str, bits: dict) -> tuple[bytes, bytes]:
    """Another run's manifest and one of its delta parts (rows 10 and 11)."""
    from fault_harness import rl_step

    bucket = os.path.join(root, "other-run")
    bits = {n: a.copy() for n, a in bits.items()}
    rng = np.random.default_rng(7)
    with DeltaPublisher(bucket, config=PublisherConfig(anchor_every=100)) as pub:
        for step in range(3):
            rl_step(bits, rng, 0.02)
            pub.publish(list(bits.items()), step=step)
            pub.flush()
    store = Store(bucket)
    m = manifest_of(store)
    return store.read_bytes(MANIFEST_PATH), store.read_bytes(m.latest.delta.files[0].path)


def run_fault(key: str, root: str, bits: dict, args, other: tuple[bytes, bytes], hub=None) -> dict:
    if hub is None:
        name, scenario, kw = FAULTS[key]
    else:
        (name, scenario), kw = HUB_FAULTS[key], dict(hub=hub)
    t0 = time.perf_counter()
    w = World(name, root, bits, args, **kw)
    w.foreign_manifest, w.foreign_part = other
    try:
        w.start()
        scenario(w)
        w.settle()
        row = w.finish()
    finally:
        w.tap.detach()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--faults", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    p.add_argument("--interval-s", type=float, default=0.2, help="seconds between versions")
    p.add_argument("--outage-s", type=float, default=5.0, help="row 7: seconds the store is down")
    p.add_argument("--burst-s", type=float, default=1.5, help="row 8: seconds of 429s")
    p.add_argument("--stale-s", type=float, default=2.0, help="rows 2, 11: seconds of old reads")
    p.add_argument("--after-steps", type=int, default=5, help="steps after the recovery")
    p.add_argument(
        "--local-hub", type=int, default=1, help="1: also rows 2 and 7 on the local Hub (hf://)"
    )
    p.add_argument("--hub-outage-s", type=float, default=10.0, help="row 7 on the local Hub")
    p.add_argument("--out", default="bench/results/fault_matrix.json")
    a = parse_with_smoke(
        p,
        dict(
            faults=SMOKE_FAULTS,
            outage_s=2.0,
            stale_s=1.0,
            after_steps=2,
            local_hub=0,
            out=smoke_path("fault_matrix.json"),
        ),
    )
    console = logging.StreamHandler()
    console.setLevel(logging.ERROR)  # the rows say what the warnings said
    console.setFormatter(logging.Formatter("  log %(name)s: %(message)s"))
    logging.getLogger().addHandler(console)
    from trainer.task.char_model import checkpoint_tensors, make_char_qwen3

    audit_commits()
    t0 = time.perf_counter()
    root = tempfile.mkdtemp(prefix="bench-fault-matrix-")
    model = make_char_qwen3(os.path.join(root, "model"), seed=0)
    bits = {n: to_bf16_bits(t).copy() for n, t in checkpoint_tensors(model).items()}
    other = other_run(root, bits)
    rows = []
    for key in a.faults:
        row = run_fault(key, root, bits, a, other)
        rows.append(row)
        print(
            f"  {row['fault']}: {row['seconds']}s{' FAILED' if row['failed'] else ''}", flush=True
        )
    if a.local_hub:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        hub = LocalHub(root)
        try:
            for key in HUB_FAULTS:
                row = run_fault(key, root, bits, a, other, hub)
                rows.append(row)
                print(f"  {row['fault']} (local Hub): {row['seconds']}s", flush=True)
        finally:
            hub.stop()
    total_s = round(time.perf_counter() - t0, 1)
    save(a.out, {"total_s": total_s, "interval_s": a.interval_s, "rows": rows})
    print(
        "| fault | store | hit at (step / version) | replica did | trainer did | detected by | "
        "recovery s | versions lost | bit-exact |"
    )
    print("|---" * 9 + "|")
    for r in rows:
        lost, exact = str(r["versions_lost"]), "yes" if r["bit_exact"] else "no"
        if r["failed"]:
            failed = " (FAILED: " + "; ".join(r["failed"]) + ")"
            if r["versions_lost"]:
                lost += failed
            else:
                exact += failed
        print(
            f"| {r['fault']} | {r['store']} | {r['hit']} | {r['replica']} | {r['trainer']} | "
            f"{r['detected']} | {r['recovery_s']} | {lost} | {exact} |"
        )
    print(f"total {total_s}s; wrote {a.out}")


if __name__ == "__main__":
    main()
