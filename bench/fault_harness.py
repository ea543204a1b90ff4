"""The fault matrix's harness (bench/bench_fault_matrix.py): a trainer stand-in that publishes
while a replica follows, a fake engine that keeps the bf16 bits it is given, a store that fails
on command, and the checks every row of the matrix reports.

- :class:`Training`: a thread that moves ~1% of the tiny model's bf16 elements by one ulp and
  calls ``DeltaPublisher.publish`` every ``interval_s`` (never ``flush``: the publisher's own
  thread uploads, folding versions when it falls behind), keeping each version's bits.
- :class:`Replica`: a real ``rollout.sync_loop.SyncLoop`` driving :class:`FakeEngine`, polled
  from its own thread; after every poll it compares the bits the engine serves with the trainer's
  bits of the version the replica reports (a mismatch is a product bug, recorded).
- ``audit_commits``: every manifest any publisher commits, recorded, so that a version dropped
  by one commit is seen even when retention would hide it by the end of the run.
- :class:`FaultStore`: a ``deltasync.store.Store`` whose calls go through ``hook(what, path)``
  (a test raises from it or waits in it) and fail on command inside the store's own retries
  (``down``: ``"outage"`` a refused connection, ``"429"`` a rate limit with ``Retry-After``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import numpy as np

from deltasync.bf16 import digest, from_order_key, order_key, to_bf16_bits
from deltasync.hub_store import HubThrottled
from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.store import Store
from rollout.apply_plan import DEFAULT_PACKED_MODULES
from rollout.engine import EngineControlError
from rollout.sync_loop import SyncLoop

WAIT_S = 30.0  # the longest a scenario waits for anything; reaching it is reported


class Killed(BaseException):
    """The trainer process died here (SIGKILL): nothing after it runs, not even cleanup."""


# ------------------------------------------------------------------------------------- store
class FaultStore(Store):
    """A Store that calls ``hook(what, path)`` before each operation (outside the retries: a
    hook that raises fails the call as it is) and, while ``down`` is set, fails every attempt
    inside the retries: ``"outage"`` as a refused connection (transient: retried, then
    ``StoreError``), ``"429"`` as a rate limit asking ``retry_after_s``. Payload files always go
    through the store (``local_path`` is None), as on a remote bucket. ``answers[path]``: the
    bytes a read of ``path`` returns instead of the object's (a cache or a proxy answering
    another object)."""

    def __init__(self, uri: str, hook=None, retry_after_s: float = 0.5, **kw):
        super().__init__(uri, **kw)
        self.hook = hook
        self.down: str | None = None
        self.retry_after_s = retry_after_s
        self.failed_attempts = 0
        self.answers: dict[str, bytes] = {}

    def local_path(self, path):
        return None

    def read_bytes(self, path):
        data = super().read_bytes(path)
        return self.answers.get(path, data)

    def _call(self, what, path, fn):
        if self.hook is not None:
            self.hook(what, path)

        def attempt():
            down = self.down
            if down is not None:
                self.failed_attempts += 1
                if down == "429":
                    raise HubThrottled(
                        f"{what} {path}: HTTP 429 (simulated burst)", self.retry_after_s
                    )
                raise ConnectionError(f"{what} {path}: connection refused (simulated outage)")
            return fn()

        return super()._call(what, path, attempt)


def manifest_of(store: Store) -> Manifest:
    return Manifest.from_json(store.read_bytes(MANIFEST_PATH))


def payload_bytes(store: Store) -> dict[str, bytes]:
    """Every payload file in the bucket (``anchors/``, ``deltas/``), with its bytes."""
    return {p: store.read_bytes(p) for p in store.ls("") if p.startswith(("anchors/", "deltas/"))}


def committed_payloads(store: Store) -> dict[str, tuple[int, bytes]]:
    """Every payload file the manifest names: path -> (version, bytes)."""
    out = {}
    for v in manifest_of(store).versions:
        for payload in (v.delta, v.anchor):
            for f in payload.files if payload else ():
                out[f.path] = (v.version, store.read_bytes(f.path))
    return out


# ------------------------------------------------------------------------------------ engine
class FakeEngine:
    """An engine that keeps the served weights as bf16 bits (on the host, reported as a GPU so
    that syncs take the in-place path) and applies staging files the way the worker extension does (dense reload or sparse patches, fused shards checked); each
    ``fail_*`` counter makes that many calls answer an error (``fail_apply`` also leaves a
    half-applied tensor behind, as a crash inside vLLM would)."""

    def __init__(self, names_shapes: dict[str, tuple]):
        self.weights = {n: np.zeros(s, np.uint16) for n, s in names_shapes.items()}
        self.paused = False
        self.version: str | None = None
        self.applies: list[tuple[str, int]] = []  # (mode, tensors)
        self.fail_apply = 0
        self.fail_pause = 0
        self.fail_set_version = 0
        self.fail_resume = 0
        self.fail_reset = 0
        self.failed: list[tuple[float, str]] = []  # (unix s, the call) of each injected failure
        self.on_fail = None  # called with the call's route when a failure is injected
        self.pauses = 0

    def describe(self) -> dict:
        return {
            "device": "cuda",  # a GPU replica's apply path: in-place patches onto what it serves
            "dtype": "torch.bfloat16",
            "quantization": None,
            "moe": False,
            "tie_word_embeddings": False,
            "packed_modules_mapping": DEFAULT_PACKED_MODULES,
            "architecture": "Fake",
        }

    def _fail(self, switch: str, call: str) -> None:
        if getattr(self, switch):
            setattr(self, switch, getattr(self, switch) - 1)
            self.failed.append((time.time(), call))
            if self.on_fail is not None:
                self.on_fail(call)
            raise EngineControlError(f"POST {call}: expected 2xx, found 500: injected")

    def apply(self, path: str, mode: str) -> list[dict]:
        from rollout.staging import IDX, VAL
        from rollout.worker_apply import check_fused_complete, read_stage

        meta, tensors = read_stage(path)
        if self.fail_apply:
            name = next(iter(self.weights))
            self.weights[name] = self.weights[name] ^ np.uint16(1)  # half-applied garbage
            self._fail("fail_apply", "/collective_rpc")
        if mode == "reload":
            check_fused_complete(list(tensors), DEFAULT_PACKED_MODULES)
            for n, t in tensors.items():
                self.weights[n] = to_bf16_bits(t).copy()
        else:
            for n in json.loads(meta["shapes"]):
                flat = self.weights[n].reshape(-1)
                flat[tensors[n + IDX].numpy()] = to_bf16_bits(tensors[n + VAL])
        self.applies.append((mode, len(tensors)))
        return [{"version": int(meta["version"])}]

    def pause(self, mode: str = "keep") -> None:
        self._fail("fail_pause", "/pause")
        self.paused = True
        self.pauses += 1

    def resume(self) -> None:
        self._fail("fail_resume", "/resume")
        self.paused = False

    def set_version(self, version: int) -> None:
        self._fail("fail_set_version", "/update_weight_version")
        self.version = str(version)

    def served_digests(self) -> dict[str, str]:
        return {n: digest(a) for n, a in self.weights.items()}

    def reset_prefix_cache(self) -> bool:
        self._fail("fail_reset", "/reset_prefix_cache")
        return True


# ---------------------------------------------------------------------------------- training
def rl_step(bits: dict[str, np.ndarray], rng: np.random.Generator, density: float) -> None:
    """Move ~``density`` of each tensor's elements by one ulp, in place (an RL step's shape)."""
    for a in bits.values():
        flat = a.reshape(-1)
        sel = np.flatnonzero(rng.random(flat.size) < density)
        step = rng.choice(np.array([-1, 1]), sel.size)
        flat[sel] = from_order_key((order_key(flat[sel]).astype(np.int64) + step).astype(np.uint16))


class Training:
    """A trainer stand-in: every ``interval_s`` one RL step on ``bits`` and one ``publish``.

    A ``publish`` that raises stops it (a trainer stops on an error it did not recover from):
    ``stopped`` holds the error. ``truth[v]`` is the bits of version ``v`` as published
    (``lock`` held while a version is published and recorded).
    """

    def __init__(self, bits: dict[str, np.ndarray], pub, interval_s: float = 0.2, seed: int = 0):
        self.bits = bits
        self.pub = pub
        self.publishers = [pub]
        self.interval_s = interval_s
        self.rng = np.random.default_rng(seed)
        self.truth: dict[int, dict[str, np.ndarray]] = {}
        self.published_at: dict[int, float] = {}  # version -> unix s of its publish() call
        self.lock = threading.Lock()
        self.step = 0
        self.newest: int | None = None  # the newest version publish() returned
        self.stopped: BaseException | None = None
        self.calls_s: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Training:
        self._stop.clear()
        self.stopped = None
        self._thread = threading.Thread(target=self._run, name="training", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            with self.lock:
                if self.step:
                    rl_step(self.bits, self.rng, 0.01)
                try:
                    v = self.pub.publish(list(self.bits.items()), step=self.step)
                except BaseException as e:  # the trainer stops here; the scenario reports it
                    self.stopped = e
                    return
                self.calls_s.append(time.monotonic() - t0)
                self.truth[v] = {n: a.copy() for n, a in self.bits.items()}
                self.published_at[v] = time.time()
                self.newest = v
                self.step += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def wait_steps(self, n: int, timeout_s: float = 60.0) -> None:
        """Wait until ``n`` more steps were published (or the trainer stopped)."""
        target, deadline = self.step + n, time.monotonic() + timeout_s
        while self.step < target and self.stopped is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def swap(self, pub) -> None:
        """Go on publishing through ``pub`` (a restarted or second trainer), same bits."""
        with self.lock:
            self.pub = pub
            self.publishers.append(pub)

    def committed(self) -> set[int]:
        """Every version any of its publishers committed."""
        return {e.version for p in self.publishers for e in p.published}

    def bits_of(self, version: int) -> dict[str, np.ndarray] | None:
        with self.lock:
            return self.truth.get(version)


# ----------------------------------------------------------------------------------- replica
class Replica:
    """A ``SyncLoop`` on :class:`FakeEngine`, polled from its own thread; after each poll the
    served bits are compared with ``training``'s bits of the version the replica reports."""

    def __init__(self, bucket, training: Training, stage_dir: str, rid: str = "r0", **loop_kw):
        self.training = training
        self.eng = FakeEngine({n: a.shape for n, a in training.bits.items()})
        kw = dict(poll_interval_s=0.05, heartbeat_interval_s=1.0, follow_events=False)
        kw.update(loop_kw)
        self.loop = SyncLoop(bucket, self.eng, rid, stage_dir=stage_dir, **kw)
        self.loop.connect()
        self.states: list[tuple[float, str]] = []  # (unix s, status) of every state change
        set_state = self.loop._set_state

        def recorded(new):  # the loop's one place of state changes, observed
            set_state(new)
            if not self.states or self.states[-1][1] != new.value:
                self.states.append((time.time(), new.value))

        self.loop._set_state = recorded
        self.timeline: list[tuple[float, int | None, str, bool, str | None]] = []
        self.mismatches: list[str] = []  # served bits other than the version reported
        self.raised: list[str] = []  # poll_once raised (it must not)
        self.checked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica", daemon=True)

    def start(self) -> Replica:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.loop.poll_once()
            except Exception as e:  # reported in the row: the loop must report, not raise
                self.raised.append(f"{type(e).__name__}: {e}"[:200])
            self._check()
            loop = self.loop
            now = (time.time(), loop.served_version, str(loop.status.value), loop.ready)
            if not self.timeline or self.timeline[-1][1:4] != now[1:]:
                self.timeline.append((*now, loop.last_error))
            self._stop.wait(0.05)

    def _check(self) -> None:
        loop = self.loop
        if not loop.ready or loop.served_version is None:
            return
        want = self.training.bits_of(loop.served_version)
        if want is None:
            self.mismatches.append(f"v{loop.served_version}: a version the trainer never published")
            return
        wrong = [n for n, a in want.items() if not np.array_equal(self.eng.weights[n], a)]
        self.checked += 1
        if wrong or self.eng.version != str(loop.served_version):
            self.mismatches.append(
                f"v{loop.served_version} reported (engine says {self.eng.version}), "
                f"{len(wrong)} tensors differ {wrong[:2]}"
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.loop.stop()

    def wait_serving(self, version: int, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            loop = self.loop
            if loop.ready and (loop.served_version or -1) >= version and loop.status == "ok":
                return True
            time.sleep(0.02)
        return False

    def since(self, t: float) -> list[tuple]:
        """Timeline entries from unix s ``t`` on."""
        return [e for e in self.timeline if e[0] >= t]

    def recovered_at(self, t: float, version: int) -> float | None:
        """Unix s of the first poll from ``t`` on that served ``version`` or newer, status ok."""
        for when, served, status, ready, _ in self.timeline:
            if when >= t and ready and status == "ok" and (served or -1) >= version:
                return when
        if (
            self.loop.ready
            and self.loop.status == "ok"
            and (self.loop.served_version or -1) >= version
        ):
            return time.time()  # reached since the last change was recorded
        return None


class LogTap(logging.Handler):
    """Keeps WARNING and above of the loggers it is attached to (their level set to WARNING):
    ``(unix s, logger, message)``."""

    def __init__(self, *names: str):
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str, str]] = []
        self.names = names
        for n in names:
            logging.getLogger(n).setLevel(logging.WARNING)
            logging.getLogger(n).addHandler(self)

    def detach(self) -> None:
        for n in self.names:
            logging.getLogger(n).removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.name, record.getMessage()))


# ------------------------------------------------------------------------------- helpers
def state_path(xs: list[str]) -> str:
    """The states in order, repeats folded (``ok->error->ok``; a long path shortened)."""
    out: list[str] = []
    for x in xs:
        if not out or out[-1] != x:
            out.append(x)
    if len(out) > 6:
        return "->".join(out[:3]) + f"->... ({len(out) - 4} more changes)->" + out[-1]
    return "->".join(out)


def short(s: str, n: int) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def wait_for(cond, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


AUDIT: dict[str, list] = {}  # store uri -> every manifest a publisher committed there, in order


def audit_commits() -> None:
    """Record every manifest any publisher commits (observation only: the real commit runs)."""
    import deltasync.publisher as publisher

    real = publisher.commit_manifest

    def recorded(store, *args, **kwargs):
        manifest, dropped = real(store, *args, **kwargs)
        AUDIT.setdefault(store.uri, []).append(manifest)
        return manifest, dropped

    publisher.commit_manifest = recorded


def audit_losses(uri: str) -> tuple[list[int], list[int], int]:
    """Versions a committed manifest lost (named by an earlier commit, at or above its own
    oldest version, and not in it), deltas committed without their base, and the commits."""
    seen: set[int] = set()
    lost: set[int] = set()
    broken: set[int] = set()
    commits = AUDIT.get(uri, [])
    for m in commits:
        kept = {v.version for v in m.versions}
        floor = min(kept)
        lost |= {v for v in seen if v >= floor and v not in kept}
        broken |= {
            v.version
            for v in m.versions
            if v.base_version is not None and v.base_version >= floor and v.base_version not in kept
        }
        seen |= kept
    return sorted(lost), sorted(broken), len(commits)


def hostile_blob(n_coded: int = 400_000) -> bytes:
    """Every one of the 256 classes in the unchanged-ranks mode with ``n_coded`` coded ranks and
    no Rice stream: 314 bytes (the blob of issue 54)."""
    import zstandard

    from deltasync import codec

    table = np.zeros(256, codec._TABLE)
    table["cls"] = np.arange(256)
    table["mode"] = codec.MODE_UNCHANGED
    table["n_coded"] = n_coded
    frame = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(table.tobytes())
    return codec._HEADER.pack(256, 0) + frame


class LocalHub:
    """The local Hub (tools/local_hub) as a child process, with a write token for replicas."""

    def __init__(self, root: str):
        from huggingface_hub import HfApi

        from tools.local_hub.process import HubProcess

        self.proc = HubProcess(os.path.join(root, "hub")).start()
        self.url, self.admin = self.proc.url, self.proc.admin
        self.admin("POST", "/admin/tokens", {"user": "me", "role": "write"})
        self.tokens = self.proc.tokens
        self.replica_token = next(v for k, v in self.tokens.items() if k.startswith("me-write-"))
        self.api = HfApi(endpoint=self.url, token=self.tokens["me-write"])

    def stop(self) -> None:
        self.proc.stop()
