"""The bucket manifest: the commit point of every version (JSON, validated with pydantic).

A reader acts only on what the manifest names; payload files are written before the manifest that
names them and deleted only after a manifest that no longer names them is committed.
Importing this module does not import torch. Schema and layout: docs/PROTOCOL.md.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Literal

import xxhash
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from .errors import ManifestError

SCHEMA = "deltasync.manifest/1"
MANIFEST_PATH = "manifest.json"
WRITER_PATH = "writer.json"
# Every payload path a publisher writes: anchor_dir/delta_dir + part_name (docs/PROTOCOL.md).
# Relative, no '..', no '//', no backslash, nothing outside anchors/ and deltas/. The file name
# carries the writer's id, so a writer never overwrites another's file; names without it (buckets
# written before parts were named per writer) stay valid for readers.
WRITER_TOKEN_PATTERN = r"[0-9a-z]{4,32}"
PAYLOAD_PATH_PATTERN = (
    rf"(anchors|deltas)/v[0-9]{{10,}}/part-[0-9]{{4,}}(-{WRITER_TOKEN_PATTERN})?\.safetensors"
)
_PAYLOAD_PATH = re.compile(PAYLOAD_PATH_PATTERN)
_WRITER_TOKEN = re.compile(WRITER_TOKEN_PATTERN)


def anchor_dir(version: int) -> str:
    """Bucket folder of the anchor of ``version``."""
    return f"anchors/v{version:010d}"


def delta_dir(version: int) -> str:
    """Bucket folder of the delta that produces ``version``."""
    return f"deltas/v{version:010d}"


def part_name(i: int, writer: str | None = None) -> str:
    """File name of part ``i`` of a payload written by ``writer`` (a writer id: 4 to 32 of
    ``[0-9a-z]``), e.g. ``part-0003-5f0c9e2a71b4.safetensors``. ``writer=None`` gives the name
    without a writer (``part-0003.safetensors``), as buckets written before writer ids hold.

    Raises:
        ValueError: ``writer`` is not 4 to 32 lowercase letters or digits.
    """
    if writer is None:
        return f"part-{i:04d}.safetensors"
    if not _WRITER_TOKEN.fullmatch(writer):
        raise ValueError(
            f"a writer id in a payload name must be 4 to 32 of [0-9a-z], found {writer!r}; "
            "use the publisher's own id (uuid4().hex[:12])"
        )
    return f"part-{i:04d}-{writer}.safetensors"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class TensorSpec(_Strict):
    """One checkpoint tensor: HF name, shape, dtype (always "BF16" on the wire)."""

    name: str
    shape: list[int]
    dtype: Literal["BF16"] = "BF16"


class ModelFingerprint(_Strict):
    """Names, shapes and dtypes of the published model, with their xxh3-64 digest."""

    tensors: list[TensorSpec]
    digest: str

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]]) -> ModelFingerprint:
        """Fingerprint of {name: shape} (order-independent)."""
        specs = [TensorSpec(name=n, shape=list(shapes[n])) for n in sorted(shapes)]
        blob = json.dumps([[s.name, s.shape, s.dtype] for s in specs]).encode()
        return cls(tensors=specs, digest=xxhash.xxh3_64_hexdigest(blob))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: tuple(t.shape) for t in self.tensors}

    def check(self, shapes: dict[str, tuple[int, ...]], where: str) -> None:
        """Raise ModelMismatchError, naming what differs, unless ``shapes`` is this model
        (``where`` says which run, for the message)."""
        if self.digest == ModelFingerprint.of(shapes).digest:
            return
        from .errors import ModelMismatchError

        want = self.shapes()
        missing = sorted(set(want) - set(shapes))[:3]
        extra = sorted(set(shapes) - set(want))[:3]
        wrong = [(n, want[n], shapes[n]) for n in want if n in shapes and want[n] != shapes[n]]
        raise ModelMismatchError(
            f"the tensors differ from {where}: missing {missing}, unexpected {extra}, wrong shape "
            f"(name, expected, found) {wrong[:3]}; publish the same architecture or start a new "
            "run elsewhere"
        )


# adapter_config.json keys that name the base rather than shape the adapter: a resumed run may
# differ in them (another path to the same base); ``AdapterInfo.base_digest`` identifies the base
INFORMATIONAL_PEFT_KEYS = ("base_model_name_or_path", "revision")


def _json_value(value: Any) -> Any:
    """``value`` as JSON would give it back: sets become sorted lists, tuples lists."""
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_json_value(v) for v in value)
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return value


class AdapterInfo(_Strict):
    """The adapter an adapter run publishes (``Manifest.adapter``): its tensors are PEFT's
    ``adapter_model.safetensors`` keys; the base model's weights are not in the bucket.

    Attributes:
        kind: ``"lora"`` (the only kind so far).
        peft_config: the JSON PEFT writes to ``adapter_config.json`` (``r``, ``lora_alpha``,
            ``target_modules``, ...); sets are stored as sorted lists. Must hold ``r`` (int >= 1),
            ``lora_alpha`` (a number) and ``target_modules`` (a list of names or a regex).
        base_model: the base's name as the trainer loaded it (informational).
        base_digest: ``deltasync.adapter.base_digest_of`` the base model's weights (16 hex).
    """

    kind: Literal["lora"]
    peft_config: dict[str, Any]
    base_model: str
    base_digest: str

    @field_validator("peft_config")
    @classmethod
    def _lora_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        try:  # as adapter_config.json holds it: enums as their values, sets as sorted lists
            cfg = json.loads(json.dumps(_json_value(cfg)))
        except TypeError as e:
            raise ValueError(f"peft_config must be JSON like adapter_config.json ({e})") from e
        r, alpha, targets = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("target_modules")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"peft_config['r'] must be an int >= 1, found {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise ValueError(f"peft_config['lora_alpha'] must be a number, found {alpha!r}")
        if not (isinstance(targets, str) or (isinstance(targets, list) and targets)):
            raise ValueError(
                f"peft_config['target_modules'] must be module names or a regex, found "
                f"{targets!r}; pass the LoraConfig's to_dict() after get_peft_model"
            )
        return cfg

    def identity(self) -> tuple:
        """What must match for a run to go on with this adapter: kind, base digest, and the
        PEFT config without ``INFORMATIONAL_PEFT_KEYS``."""
        cfg = {k: v for k, v in self.peft_config.items() if k not in INFORMATIONAL_PEFT_KEYS}
        return self.kind, self.base_digest, json.dumps(cfg, sort_keys=True)


class FileRef(_Strict):
    """A payload file: bucket path relative to the run root, size in bytes, xxh3-64 of its bytes,
    and in a signed run (``deltasync.signing``) the SHA-256 of its bytes (64 hex; the key is
    absent otherwise, so an unsigned manifest's JSON is unchanged)."""

    path: str
    bytes: int = Field(ge=0)
    digest: str
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @model_serializer(mode="wrap")
    def _omit_no_sha256(self, handler) -> dict[str, Any]:
        data = handler(self)
        if data.get("sha256", 0) is None:
            del data["sha256"]
        return data

    @field_validator("path")
    @classmethod
    def _payload_path(cls, path: str) -> str:
        """Only paths the protocol names (``PAYLOAD_PATH_PATTERN``); anything else (``..``,
        absolute, backslashes, other folders) makes the manifest invalid, so that a reader
        never opens a file outside the run's payload folders."""
        if not _PAYLOAD_PATH.fullmatch(path):
            raise ValueError(
                f"payload path {path[:200]!r} does not match the protocol's pattern "
                f"{PAYLOAD_PATH_PATTERN!r} (e.g. 'deltas/v0000000007/part-0000.safetensors'); "
                "the manifest is corrupt or was not written by a deltasync publisher"
            )
        return path


class Payload(_Strict):
    """The files of one anchor or one delta (split by a per-file size cap)."""

    files: list[FileRef]

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)


class VersionEntry(_Strict):
    """One published version.

    A version has a delta (from ``base_version``), an anchor (a full snapshot), or both. The first
    version of a run, and the first after a trainer restart, are anchors only.
    """

    version: int = Field(ge=0)
    step: int | None = None  # trainer optimizer step that produced it
    created_at: float  # unix seconds when committed
    base_version: int | None = None  # the delta's base; None when there is no delta
    delta: Payload | None = None
    anchor: Payload | None = None
    changed: int = Field(ge=0)  # elements that differ from base_version (0 without a delta)
    total: int = Field(ge=0)  # elements in the model
    digest: str  # model digest: xxh3-64 over the sorted per-tensor digests
    coalesced: int = 0  # unpublished versions folded into this one because uploads fell behind
    timings_s: dict[str, float] = Field(default_factory=dict)  # diff, encode, write, upload

    @model_validator(mode="after")
    def _check(self) -> VersionEntry:
        if self.delta is None and self.anchor is None:
            raise ValueError(f"version {self.version} has neither a delta nor an anchor")
        if (self.delta is None) != (self.base_version is None):
            raise ValueError(f"version {self.version}: base_version must be set iff a delta is")
        if self.base_version is not None and self.base_version >= self.version:
            raise ValueError(f"version {self.version}: base {self.base_version} is not older")
        for kind, payload, folder in (
            ("delta", self.delta, delta_dir(self.version)),
            ("anchor", self.anchor, anchor_dir(self.version)),
        ):
            for ref in payload.files if payload is not None else ():
                if not ref.path.startswith(folder + "/"):
                    raise ValueError(
                        f"version {self.version}: {kind} file {ref.path!r} is not under "
                        f"{folder}/, where the protocol puts the {kind} of this version"
                    )
        return self

    @property
    def density(self) -> float:
        """Changed elements / total elements of the delta (0.0 for anchor-only versions)."""
        return self.changed / self.total if self.total else 0.0


class ManifestSignature(_Strict):
    """``Manifest.signature``: an Ed25519 signature of the rest of the manifest
    (``deltasync.signing.signed_bytes``).

    Attributes:
        alg: ``"ed25519"``.
        public_key: the signing key's public key, base64 of its 32 raw bytes (informational: a
            reader verifies with the key it was given, and names this one when they differ).
        value: the signature, base64 of its 64 bytes.
    """

    alg: Literal["ed25519"] = "ed25519"
    public_key: str = Field(max_length=100)
    value: str = Field(max_length=200)


class Manifest(_Strict):
    """The run's manifest: ``manifest.json`` at the run root."""

    schema_: Literal["deltasync.manifest/1"] = Field(SCHEMA, alias="schema")
    run_id: str
    writer_id: str
    model: ModelFingerprint
    adapter: AdapterInfo | None = None  # set in every manifest of an adapter run
    versions: list[VersionEntry]  # ascending by version
    updated_at: float = Field(default_factory=time.time)
    signature: ManifestSignature | None = None  # set by a signing publisher (deltasync.signing)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_serializer(mode="wrap")
    def _omit_no_adapter(self, handler) -> dict[str, Any]:
        """A full-weight manifest has no ``adapter`` key at all, an unsigned one no
        ``signature`` (their JSON is unchanged)."""
        data = handler(self)
        for key in ("adapter", "signature"):
            if data.get(key, 0) is None:
                del data[key]
        return data

    @model_validator(mode="after")
    def _ascending(self) -> Manifest:
        vs = [v.version for v in self.versions]
        if any(b <= a for a, b in zip(vs, vs[1:], strict=False)):
            raise ValueError(f"versions must be strictly ascending, found {vs}")
        return self

    @property
    def latest(self) -> VersionEntry | None:
        return self.versions[-1] if self.versions else None

    def entry(self, version: int) -> VersionEntry | None:
        for v in self.versions:
            if v.version == version:
                return v
        return None

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse ``manifest.json`` bytes.

        Raises:
            ManifestParseError (a ManifestError and a ValueError): the bytes are not JSON, not
                an object, not this schema (pydantic's message names the field), or hold a
                number out of range (an int beyond int64, a float that is not finite).
        """
        try:
            manifest = cls.model_validate_json(data)
        except (ValueError, RecursionError) as e:  # pydantic.ValidationError is a ValueError
            raise ManifestParseError(
                f"{MANIFEST_PATH} is not a valid {SCHEMA} manifest ({e}); it was damaged or "
                "not written by a deltasync publisher: restore it or publish a new version"
            ) from e
        bad = _out_of_range(manifest)
        if bad:
            raise ManifestParseError(
                f"{MANIFEST_PATH}: expected ints within int64 and finite floats, found {bad}; "
                "it was damaged or not written by a deltasync publisher"
            )
        return manifest


class ManifestParseError(ManifestError, ValueError):
    """``manifest.json`` does not parse as a :class:`Manifest`. Also a ValueError, as pydantic's
    ValidationError was, so callers that catch ValueError around ``from_json`` still do."""


def _out_of_range(m: Manifest) -> str | None:
    """The first number of a parsed manifest that int64 or a finite float cannot hold, named."""
    limit = 2**63 - 1
    ints = [("shape", d) for t in m.model.tensors for d in t.shape]
    floats = [("updated_at", m.updated_at)]
    for v in m.versions:
        ints += [("version", v.version), ("changed", v.changed), ("total", v.total)]
        ints += [("step", v.step), ("base_version", v.base_version), ("coalesced", v.coalesced)]
        ints += [("bytes", f.bytes) for p in (v.delta, v.anchor) if p for f in p.files]
        floats += [("created_at", v.created_at), *v.timings_s.items()]
    for name, x in ints:
        if x is not None and not -limit <= x <= limit:
            return f"{name} = {str(x)[:40]}"
    for name, x in floats:
        if not math.isfinite(x):
            return f"{name} = {x}"
    return None


class WriterLease(_Strict):
    """``writer.json``: who writes this run. Refreshed while publishing; stale after ``lease_s``."""

    writer_id: str
    run_id: str
    host: str
    pid: int
    heartbeat_at: float
    lease_s: float


def model_digest(tensor_digests: dict[str, str]) -> str:
    """xxh3-64 over ``name:digest`` lines in name order: one digest for a whole model version."""
    text = "\n".join(f"{n}:{tensor_digests[n]}" for n in sorted(tensor_digests))
    return xxhash.xxh3_64_hexdigest(text.encode())


def retained(versions: list[VersionEntry], keep_anchors: int) -> list[VersionEntry]:
    """Versions still needed to replay to the newest one from the ``keep_anchors`` newest anchors:
    everything from the oldest kept anchor on. With fewer anchors than that, everything is kept."""
    anchors = [v.version for v in versions if v.anchor is not None]
    if keep_anchors < 1:
        raise ValueError(f"keep_anchors must be >= 1, found {keep_anchors}")
    if len(anchors) <= keep_anchors:
        return list(versions)
    oldest = anchors[-keep_anchors]
    return [v for v in versions if v.version >= oldest]
