"""Replica side of the sync protocol: ``DeltaSubscriber`` and the CPU-held weights it updates.

The subscriber reads the manifest, plans a path from the version a replica holds to the newest
(deltas when they chain onto it, otherwise the newest anchor and the deltas after it), fetches and
verifies each step, and turns it into patches in checkpoint coordinates (name, shape, flat int64
indices, bf16 values) or full tensors. Decoding needs the base bits, so the replica keeps them in a
:class:`HeldWeights` (a CPU dict of bf16 bits); every patch is checked against the publisher's
digest of the full post-update tensor BEFORE anything is applied.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import codec, deltafile
from .bf16 import bytes_digest, digest
from .errors import (
    BaseVersionMismatch,
    DeltaCorruptError,
    ManifestError,
    ModelMismatchError,
    StoreNotFoundError,
)
from .manifest import MANIFEST_PATH, FileRef, Manifest, VersionEntry, model_digest
from .signing import check_payload, public_key_of, verify_manifest
from .store import Store, open_store

log = logging.getLogger("deltasync.subscriber")
SPLIT_MIN = 1 << 25  # elements from which one tensor's decode is split over threads


@dataclass
class PlanStep:
    """One step of a sync plan: apply the ``kind`` payload of ``version``."""

    version: int
    kind: str  # "anchor" | "delta"
    base_version: int | None
    files: list[FileRef]
    created_at: float

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)


@dataclass
class SyncPlan:
    """The steps from ``from_version`` (None: nothing held) to ``to_version``."""

    from_version: int | None
    to_version: int | None
    steps: list[PlanStep]

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)


@dataclass
class Patch:
    """A sparse update of one tensor in checkpoint coordinates.

    Attributes:
        name: HF checkpoint name.
        shape: the full tensor's shape.
        indices: int64[M] flat (row-major) positions, ascending.
        values: uint16[M] new bf16 bits (absolute values, not differences).
        old_values: uint16[M] the bits they replace (the base's), or None.
    """

    name: str
    shape: tuple[int, ...]
    indices: np.ndarray
    values: np.ndarray
    old_values: np.ndarray | None = None

    def sum_delta(self) -> int:
        """How much the patch changes the sum of the tensor's bits read as int16 (exact int):
        a checksum the receiver can compare in any layout (``rollout.worker_apply``).

        Raises:
            ValueError: the patch has no ``old_values``.
        """
        if self.old_values is None:
            raise ValueError(f"{self.name}: a patch without old_values has no sum delta")
        new = self.values.view(np.int16).astype(np.int64).sum()
        return int(new - self.old_values.view(np.int16).astype(np.int64).sum())


@dataclass
class FullTensor:
    """A whole tensor from an anchor: name, shape and bf16 bits (np.uint16 of that shape)."""

    name: str
    shape: tuple[int, ...]
    values: np.ndarray


@dataclass
class HeldWeights:
    """What a replica holds: a version and the bf16 bits of every tensor (CPU, np.uint16)."""

    version: int | None = None
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)

    def to_torch(self) -> dict:
        """{name: torch.bfloat16 tensor} sharing memory with the held bits (imports torch)."""
        from .bf16 import from_bf16_bits

        return {n: from_bf16_bits(a) for n, a in self.tensors.items()}


@dataclass
class Fetched:
    """A downloaded, digest-checked and parsed version payload (not yet decoded)."""

    step: PlanStep
    tensors: dict[str, deltafile.PartTensor]
    nbytes: int
    fetch_s: float


class DeltaSubscriber:
    """Follows one bucket run.

    Args:
        store: a Store or URI (the run root).
        fetch_threads: parallel downloads of payload parts.
        decode_threads: tensors decoded and verified in parallel (the codec's kernels, zstd and
            xxh3 release the GIL); default: every core of the machine.
        public_key: the run's public key (``RUN_PUBLIC_KEY``, base64 of 32 bytes): every manifest
            read must carry a signature by it (``deltasync.signing.verify_manifest``) and every
            payload's bytes must hash to the SHA-256 it signs. None: unsigned runs are read too
            (the dashboard, ``make eval``, a resume).

    Raises:
        KeyFileError: ``public_key`` is not a public key's text.
    """

    def __init__(
        self,
        store: Store | str,
        fetch_threads: int = 4,
        decode_threads: int | None = None,
        public_key: str | None = None,
    ):
        if public_key is not None:
            public_key_of(public_key)  # a wrong key fails here, not at the first poll
        self.public_key = public_key
        self.store = open_store(store)
        self._pool = ThreadPoolExecutor(fetch_threads, "deltasync-fetch")
        self.decode_threads = decode_threads or os.cpu_count() or 1
        self._decode_pool = ThreadPoolExecutor(self.decode_threads, "deltasync-decode")
        self._manifest_tag: str | None = None  # read_if_changed tag of the last manifest read
        self._manifest: Manifest | None = None

    def close(self) -> None:
        self._pool.shutdown()
        self._decode_pool.shutdown()

    def read_manifest(self) -> Manifest | None:
        """The current manifest, or None while the run has no version yet (no manifest in an
        existing bucket). An unchanged manifest is not downloaded or parsed again (a conditional
        read: on hf:// one resolver request answered 304).

        Raises:
            ManifestError: the manifest exists but is not valid.
            UnsignedVersionError, ForeignKeyError, SignatureError (ManifestErrors): with a
                ``public_key``, the manifest is unsigned, signed by another key, or changed
                after it was signed; it is not kept.
            StoreAuthError, StoreBucketNotFoundError: the token or the bucket is wrong (never
                "no version yet").
            StoreError: the store kept failing.
        """
        try:
            data, tag = self.store.read_if_changed(MANIFEST_PATH, self._manifest_tag)
        except StoreNotFoundError:
            self._manifest_tag, self._manifest = None, None
            return None
        if data is None:
            return self._manifest
        try:
            manifest = Manifest.from_json(data)
        except ValueError as e:
            raise ManifestError(f"{self.store.uri}/{MANIFEST_PATH} is invalid: {e}") from e
        if self.public_key is not None:
            verify_manifest(manifest, self.public_key, f"{self.store.uri}/{MANIFEST_PATH}")
        self._manifest_tag, self._manifest = tag, manifest
        return manifest

    def plan(self, held: int | None, manifest: Manifest, target: int | None = None) -> SyncPlan:
        """Cheapest path from ``held`` to ``target`` (default: the newest version).

        Deltas are used when they chain onto ``held``; otherwise (nothing held, fell behind past
        retention, or a trainer restart) the newest anchor at or before ``target`` and the deltas
        after it. Also re-anchors when that downloads fewer bytes than the delta chain.

        Raises:
            ManifestError: no path exists (e.g. the target has no anchor before it).
        """
        versions = manifest.versions
        if not versions:
            return SyncPlan(held, held, [])
        target = versions[-1].version if target is None else target
        by_v = {v.version: v for v in versions}
        if target not in by_v:
            raise ManifestError(f"version {target} is not in the manifest of {self.store.uri}")
        if held == target:
            return SyncPlan(held, target, [])
        chain = self._delta_chain(versions, held, target) if held is not None else None
        anchored = self._anchored(versions, target)
        if chain is None and anchored is None:
            raise ManifestError(
                f"no path to version {target} from {held} in {self.store.uri}: no anchor at or "
                "before it; the manifest is inconsistent"
            )
        if chain is None or (
            anchored is not None and sum(s.bytes for s in anchored) < sum(s.bytes for s in chain)
        ):
            return SyncPlan(held, target, anchored)
        return SyncPlan(held, target, chain)

    @staticmethod
    def _step(v: VersionEntry, kind: str) -> PlanStep:
        payload = v.anchor if kind == "anchor" else v.delta
        base = v.base_version if kind == "delta" else None
        return PlanStep(v.version, kind, base, list(payload.files), v.created_at)

    def _delta_chain(self, versions, held, target) -> list[PlanStep] | None:
        steps, cur = [], held
        for v in versions:
            if v.version <= held or v.version > target:
                continue
            if v.delta is not None and v.base_version == cur:
                steps.append(self._step(v, "delta"))
                cur = v.version
        return steps if cur == target else None

    def _anchored(self, versions, target) -> list[PlanStep] | None:
        anchors = [v for v in versions if v.anchor is not None and v.version <= target]
        if not anchors:
            return None
        start = anchors[-1]
        rest = self._delta_chain(versions, start.version, target)
        if rest is None:
            return None
        return [self._step(start, "anchor"), *rest]

    def fetch(self, step: PlanStep) -> Fetched:
        """Download a step's files in parallel, check each file's xxh3-64 digest (and, with a
        ``public_key``, first its signed SHA-256), and parse them.

        Raises:
            PayloadDigestError (a DeltaCorruptError): with a ``public_key``, a file's bytes do not
                hash to the SHA-256 the signed manifest names (or it names none).
            DeltaCorruptError: a file's size or digest differs from the manifest, or it does not
                parse, or its metadata disagrees with the plan step.
            StoreNotFoundError: a file was deleted (retention moved on): plan again.
        """
        t0 = time.perf_counter()

        def get(ref: FileRef):
            data = self.store.read_bytes(ref.path)
            if self.public_key is not None:
                check_payload(ref, data, f"{self.store.uri}/{ref.path}")
            if len(data) != ref.bytes or bytes_digest(data) != ref.digest:
                raise DeltaCorruptError(
                    f"{self.store.uri}/{ref.path}: expected {ref.bytes} bytes with xxh3 "
                    f"{ref.digest}, found {len(data)} bytes with xxh3 {bytes_digest(data)}"
                )
            return deltafile.read_part(data), len(data)

        tensors: dict[str, deltafile.PartTensor] = {}
        nbytes = 0
        for ref, (part, n) in zip(step.files, self._pool.map(get, step.files), strict=True):
            if part.kind != step.kind or part.version != step.version:
                raise DeltaCorruptError(
                    f"{ref.path}: expected {step.kind} v{step.version}, "
                    f"found {part.kind} v{part.version}"
                )
            if part.base_version != step.base_version:
                raise DeltaCorruptError(
                    f"{ref.path}: expected base {step.base_version}, found {part.base_version}"
                )
            dup = set(tensors) & set(part.tensors)
            if dup:
                raise DeltaCorruptError(
                    f"{ref.path}: tensors repeated across parts: {sorted(dup)[:3]}"
                )
            tensors.update(part.tensors)
            nbytes += n
        return Fetched(step, tensors, nbytes, time.perf_counter() - t0)

    def decode_into(self, fetched: Fetched, held: HeldWeights, manifest: Manifest | None = None):
        """Decode and verify a fetched step against ``held``, then update ``held`` in place.

        Nothing in ``held`` changes unless every tensor of the step verified.

        Returns:
            list[Patch] for a delta, list[FullTensor] for an anchor.

        Raises:
            BaseVersionMismatch: a delta whose base is not ``held.version``.
            DeltaCorruptError: a blob fails to decode, or a result's digest differs from the
                publisher's (a damaged file or a base that differs from the publisher's).
            ModelMismatchError: names or shapes differ from what is held / the manifest.
        """
        step = fetched.step
        if step.kind == "anchor":
            return self._apply_anchor(fetched, held, manifest)
        if held.version != step.base_version:
            raise BaseVersionMismatch(
                f"delta v{step.version} applies to base v{step.base_version}, but the replica "
                f"holds v{held.version}; re-plan from the held version (or re-anchor)"
            )
        for name, t in fetched.tensors.items():
            base = held.tensors.get(name)
            if base is None or base.shape != t.shape:
                raise ModelMismatchError(
                    f"delta v{step.version} changes {name} {t.shape}; the replica holds "
                    f"{None if base is None else base.shape}"
                )

        def patch(item):  # one tensor per thread: decode, patch the held bits, verify
            name, t = item
            flat = held.tensors[name].reshape(-1)
            idx, new = codec.decode(t.data, flat, threads=self._split(flat.shape[0]))
            if idx.shape[0] != t.changed:
                raise DeltaCorruptError(
                    f"{name}: {idx.shape[0]} changes decoded, {t.changed} declared"
                )
            old = flat[idx]
            flat[idx] = new
            got = digest(flat)
            if got != t.digest:
                flat[idx] = old
                raise DeltaCorruptError(
                    f"v{step.version} {name}: result digest {got} != published {t.digest}; "
                    "the held base differs from the publisher's or the file is damaged"
                )
            return Patch(name, t.shape, idx, new, old), old

        done = self._all_or_nothing(patch, list(fetched.tensors.items()), held)
        digests = dict(held.digests)
        digests.update({n: t.digest for n, t in fetched.tensors.items()})
        try:
            self._check_model_digest(step, digests, manifest)
        except DeltaCorruptError:
            self._undo(done, held)
            raise
        held.digests = digests
        held.version = step.version
        return [p for p, _ in done]

    def _split(self, n: int) -> int:
        """Threads for one tensor's decode: a tensor of ``SPLIT_MIN`` elements or more (an
        embedding, an LM head) is split over a quarter of the decode threads, since it is
        decoded first and would otherwise finish last while the other threads idle; smaller
        ones take one thread each (splitting costs an extra pass)."""
        return max(1, self.decode_threads // 4) if n >= SPLIT_MIN else 1

    def _all_or_nothing(self, fn, items, held: HeldWeights) -> list:
        """``fn`` over items on the decode threads; if any raised, undo the others' patches
        (each result is (Patch, old bits)) and raise the first error."""
        # largest first, so that no big tensor starts last while the other threads idle
        items = sorted(items, key=lambda it: -it[1].data.nbytes)
        futures = [self._decode_pool.submit(fn, item) for item in items]
        done, errors = [], []
        for f in futures:
            try:
                done.append(f.result())
            except Exception as e:  # collected; the first is raised once all have finished
                errors.append(e)
        if errors:
            self._undo(done, held)
            raise errors[0]
        return done

    @staticmethod
    def _undo(done: list, held: HeldWeights) -> None:
        for p, old in done:
            held.tensors[p.name].reshape(-1)[p.indices] = old

    def _apply_anchor(self, fetched: Fetched, held: HeldWeights, manifest):
        step = fetched.step
        if manifest is not None:
            want = manifest.model.shapes()
            got = {n: t.shape for n, t in fetched.tensors.items()}
            if got != want:
                raise ModelMismatchError(
                    f"anchor v{step.version} tensors differ from the manifest's model fingerprint"
                )

        def full(item):
            name, t = item
            bits = np.array(t.data, copy=True)
            if digest(bits) != t.digest:
                raise DeltaCorruptError(f"anchor v{step.version} {name}: digest mismatch")
            return FullTensor(name, t.shape, bits)

        out = list(self._decode_pool.map(full, fetched.tensors.items()))
        tensors = {f.name: f.values for f in out}
        digests = {n: t.digest for n, t in fetched.tensors.items()}
        self._check_model_digest(step, digests, manifest)
        held.tensors, held.digests, held.version = tensors, digests, step.version
        return out

    @staticmethod
    def _check_model_digest(step: PlanStep, digests: dict[str, str], manifest) -> None:
        entry = manifest.entry(step.version) if manifest is not None else None
        if entry is not None and model_digest(digests) != entry.digest:
            raise DeltaCorruptError(
                f"v{step.version}: model digest {model_digest(digests)} != manifest {entry.digest}"
            )

    def sync(self, held: HeldWeights, target: int | None = None) -> list[tuple[PlanStep, list]]:
        """Bring ``held`` to ``target`` (default newest) once, raising the first error.

        The one-shot form of ``deltasync.follow.Follower.poll`` without ``report``: read the
        manifest, plan from ``held.version``, then fetch and verify each step into ``held``.

        Returns:
            the applied (step, ``list[Patch]`` or ``list[FullTensor]``) pairs, oldest first;
            empty when the run has no version yet or ``held`` is already at ``target``.

        Raises:
            the errors of :meth:`read_manifest`, :meth:`plan`, :meth:`fetch` and
            :meth:`decode_into`; ``held`` then stays at the last step that verified.
        """
        manifest = self.read_manifest()
        if manifest is None or manifest.latest is None:
            return []
        done = []
        for step in self.plan(held.version, manifest, target).steps:
            done.append((step, self.decode_into(self.fetch(step), held, manifest)))
        return done


def merge_patches(held: HeldWeights, steps: list[list[Patch]]) -> list[Patch]:
    """Fold patches of consecutive delta steps into one patch per tensor (the union of positions,
    values taken from ``held``, which must already be at the last step's version; old values
    from the first step that touched each position, where every patch has them)."""
    by_name: dict[str, list[Patch]] = {}
    for patches in steps:
        for p in patches:
            by_name.setdefault(p.name, []).append(p)
    out = []
    for name, ps in by_name.items():
        idx, first = np.unique(np.concatenate([p.indices for p in ps]), return_index=True)
        old = None
        if all(p.old_values is not None for p in ps):
            old = np.concatenate([p.old_values for p in ps])[first]
        out.append(Patch(name, ps[0].shape, idx, held.tensors[name].reshape(-1)[idx].copy(), old))
    return out


def apply_patches(tensors: dict[str, np.ndarray], patches: list) -> None:
    """Apply patches (or full tensors) to a CPU dict of bf16 bits in place."""
    for p in patches:
        if isinstance(p, FullTensor):
            tensors[p.name] = p.values.copy()
        else:
            tensors[p.name].reshape(-1)[p.indices] = p.values
