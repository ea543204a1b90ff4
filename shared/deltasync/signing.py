"""Signed versions: a run key (Ed25519) that the publisher signs each manifest commit with, and
that replicas given its public key verify before they apply anything (docs/PROTOCOL.md
section 8).

The xxh3-64 digests of the manifest are unkeyed and not collision resistant: they catch damage,
not an attacker who can write the bucket (every Space's token can, for its heartbeat). A signed
manifest carries, for every payload file, the SHA-256 of its bytes, and a ``signature`` over the
canonical bytes of the rest of the manifest (:func:`signed_bytes`: the run id, every version and
every payload file with its size and SHA-256). A replica with the run's public key serves only
versions whose manifest verifies and whose payload bytes hash to the signed SHA-256.

Key files: the private key as unencrypted PKCS#8 PEM, mode 0600 (a file readable by group or
others is refused). The public key travels as text: the base64 of its 32 raw bytes (44
characters), a Space variable ``RUN_PUBLIC_KEY``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .errors import (
    ForeignKeyError,
    KeyFileError,
    PayloadDigestError,
    SignatureError,
    UnsignedVersionError,
)
from .manifest import FileRef, Manifest, ManifestSignature

log = logging.getLogger("deltasync.signing")

# Signed bytes = this tag + the canonical JSON of the manifest without ``signature``: a signature
# made for anything else (another protocol, another purpose) never verifies as a manifest's.
SIGNING_CONTEXT = b"deltasync.manifest-signature/1\n"
PUBLIC_KEY_VAR = "RUN_PUBLIC_KEY"  # the replica's (and dashboard's) variable
KEY_FILE_NAME = "run_key.pem"  # under a run folder or a deploy's state folder


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class RunKey:
    """A run's private signing key (Ed25519).

    Use :meth:`generate`, :meth:`load` or :func:`load_or_create`; :attr:`public_key` is the
    text replicas are given. The key never appears in ``repr``.
    """

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public_key: str = _b64(raw)  # base64 of the 32 raw bytes (44 characters)

    def __repr__(self) -> str:
        return f"RunKey(public_key={self.public_key!r})"

    @classmethod
    def generate(cls) -> RunKey:
        """A new random key."""
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> str:
        """The Ed25519 signature of ``data``, base64 (88 characters for 64 bytes)."""
        return _b64(self._key.sign(data))

    def save(self, path: str | os.PathLike) -> None:
        """Write the key to a new file ``path`` (PKCS#8 PEM, mode 0600), creating its folder.

        Raises:
            FileExistsError: ``path`` exists (a key is never overwritten: replicas trust it).
            OSError: the file cannot be written.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, pem)
        finally:
            os.close(fd)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunKey:
        """Read a key file :meth:`save` wrote.

        Raises:
            KeyFileError: the file is missing, readable by group or others (fix: ``chmod 600``),
                or not an Ed25519 private key in PEM.
        """
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise KeyFileError(
                f"expected the run's private key at {path}, found no file; run `make spaces` "
                "(it writes the key) or point RUN_KEY at the key file"
            ) from None
        if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(
                f"{path}: expected a private key file only its owner can read (mode 0600), "
                f"found mode {stat.S_IMODE(mode):04o}; fix: chmod 600 {path}"
            )
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise KeyFileError(
                f"{path}: expected an unencrypted Ed25519 private key (PKCS#8 PEM), found a file "
                f"that does not load as one ({type(e).__name__}); restore the key file, or move "
                "it away to make a new run key (replicas then need the new RUN_PUBLIC_KEY)"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(
                f"{path}: expected an Ed25519 private key, found {type(key).__name__}"
            )
        return cls(key)


def load_or_create(path: str | os.PathLike) -> tuple[RunKey, bool]:
    """The key at ``path``, made (mode 0600) when there is none yet.

    Returns:
        (the key, whether it was created now).

    Raises:
        KeyFileError: see :meth:`RunKey.load`.
    """
    try:
        key = RunKey.generate()
        key.save(path)
        return key, True
    except FileExistsError:
        return RunKey.load(path), False


def public_key_of(text: str, where: str = PUBLIC_KEY_VAR) -> Ed25519PublicKey:
    """The public key of its text form (base64 of 32 raw bytes).

    Raises:
        KeyFileError: ``text`` is not the base64 of 32 bytes (``where`` names the setting).
    """
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise KeyFileError(
            f"{where}: expected an Ed25519 public key as the base64 of 32 bytes (44 characters), "
            f"found {len(text)} characters that do not decode to 32 bytes; copy the value "
            "`make spaces` printed (or the run key's public_key)"
        )
    return Ed25519PublicKey.from_public_bytes(raw)


def signed_bytes(manifest: Manifest) -> bytes:
    """What a manifest's signature covers: :data:`SIGNING_CONTEXT` + the manifest without its
    ``signature`` as canonical JSON (every field as the model holds it, keys sorted, no spaces,
    ASCII only): the run id, the model, every version and every payload file with its path,
    size, xxh3 and SHA-256."""
    data = manifest.model_dump(mode="json", by_alias=True)
    data.pop("signature", None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return SIGNING_CONTEXT + text.encode("ascii")


def sign_manifest(manifest: Manifest, key: RunKey) -> Manifest:
    """``manifest`` with its ``signature`` set (a copy; the argument is left as it is).

    Signed over the manifest as a reader parses it back from its JSON, so the signed bytes are
    the ones a reader computes.

    Raises:
        ValueError: a payload file has no ``sha256`` (the publisher was not signing when it
            wrote it) in the newest version: a signature would vouch for bytes it never hashed.
    """
    latest = manifest.latest
    for ref in _files(latest) if latest is not None else ():
        if ref.sha256 is None:
            raise ValueError(f"{ref.path}: no sha256 to sign; write payloads with sha256=True")
    parsed = Manifest.from_json(manifest.model_copy(update={"signature": None}).to_json())
    sig = ManifestSignature(public_key=key.public_key, value=key.sign(signed_bytes(parsed)))
    return parsed.model_copy(update={"signature": sig})


def verify_manifest(manifest: Manifest, public_key: str, where: str = "manifest.json") -> None:
    """Check ``manifest``'s signature against the run's ``public_key`` (text form).

    Raises:
        UnsignedVersionError: the manifest has no signature.
        ForeignKeyError: it was signed by another key.
        SignatureError: the signature does not verify (the manifest was changed after it was
            signed).
        KeyFileError: ``public_key`` is not a public key's text.
    """
    key = public_key_of(public_key)
    sig = manifest.signature
    newest = f"v{manifest.latest.version}" if manifest.latest else "no version"
    if sig is None:
        raise UnsignedVersionError(
            f"{where} ({newest}): expected a manifest signed by the run key {public_key}, found "
            "no signature; refused, the replica keeps its version. Fix: publish with the run "
            "key (the trainer's RUN_KEY), or unset RUN_PUBLIC_KEY to accept unsigned runs"
        )
    if sig.public_key != public_key.strip():
        raise ForeignKeyError(
            f"{where} ({newest}): expected a signature by the run key {public_key}, found one "
            f"by key {sig.public_key[:60]}; refused, the replica keeps its version. Fix: give "
            "the replica the RUN_PUBLIC_KEY of the trainer that publishes this run"
        )
    try:
        key.verify(base64.b64decode(sig.value, validate=True), signed_bytes(manifest))
    except (InvalidSignature, binascii.Error, ValueError):
        raise SignatureError(
            f"{where} ({newest}): expected a valid signature by the run key {public_key}, found "
            "one that does not verify: the manifest was changed after it was signed. Refused, "
            "the replica keeps its version. Fix: find who writes the bucket; the trainer's next "
            "commit writes a signed manifest again"
        ) from None


def trusted_history(manifest: Manifest, key: RunKey, where: str) -> Manifest:
    """The manifest a signing writer resumes from: ``manifest`` when ``key`` signed it, else a
    copy without any ``sha256`` (unsigned, another key's, or changed since it was signed: this
    key never vouches for bytes it did not hash; readers that require signatures then refuse
    those payloads and start from the writer's first anchor)."""
    try:
        verify_manifest(manifest, key.public_key, where)
        return manifest
    except SignatureError as e:
        log.warning(
            "%s: %s; resuming without vouching for its payloads (readers with the run key start "
            "from the next anchor)",
            where,
            type(e).__name__,
        )
        return without_sha256(manifest)


def without_sha256(manifest: Manifest) -> Manifest:
    """A copy of ``manifest`` without ``signature`` and without any payload ``sha256``."""
    data = manifest.model_dump(mode="json", by_alias=True)
    data.pop("signature", None)
    for v in data["versions"]:
        for kind in ("delta", "anchor"):
            for f in (v.get(kind) or {}).get("files", []):
                f.pop("sha256", None)
    return Manifest.model_validate(data)


def check_payload(ref: FileRef, data: bytes, where: str) -> None:
    """Check a payload file's bytes against the SHA-256 its signed manifest names.

    Raises:
        PayloadDigestError: the manifest names no SHA-256 for it, or the bytes hash otherwise.
    """
    if ref.sha256 is None:
        raise PayloadDigestError(
            f"{where}: expected a signed SHA-256 for this payload, found none (written before "
            "the run was signed); refused, the replica re-anchors on a newer anchor"
        )
    got = hashlib.sha256(data).hexdigest()
    if got != ref.sha256:
        raise PayloadDigestError(
            f"{where}: expected SHA-256 {ref.sha256} (signed), found {got}: the file was "
            "changed after it was published. Refused, nothing of it is applied; the replica "
            "keeps its version and re-plans around it"
        )


def _files(entry) -> list[FileRef]:
    return [f for p in (entry.delta, entry.anchor) if p is not None for f in p.files]
