"""Exceptions raised by deltasync. Each message says what was expected, what was found, and the fix."""

from __future__ import annotations


class DeltaSyncError(Exception):
    """Base class of every error deltasync raises on purpose."""


class DeltaCorruptError(DeltaSyncError):
    """A payload file failed validation: unparsable, truncated, wrong shapes, out-of-range
    positions, or a digest mismatch. Nothing from that file has been applied."""


class BaseVersionMismatch(DeltaSyncError):
    """A delta's `base_version` is not the version the receiver holds."""


class VersionNotKeptError(DeltaSyncError):
    """A version asked of a ``deltasync.history.VersionHistory`` is not among the ones it can
    rebuild (older than its window, reached by an anchor jump, or not published yet)."""


class ModelMismatchError(DeltaSyncError):
    """Tensor names, shapes or dtypes differ from the run's model fingerprint."""


class AdapterMismatchError(DeltaSyncError):
    """A run's adapter (``Manifest.adapter``: kind, PEFT config, base model digest) is not the one
    expected: a publisher resuming a run with another adapter (or a full-weight publisher on an
    adapter run, or the reverse), or a reader that expects the other kind of run."""


class WrongBaseModelError(DeltaSyncError):
    """The adapter was trained on another base model than the one the replica serves (their
    base digests differ, ``deltasync.adapter.check_base``)."""


class ManifestError(DeltaSyncError):
    """The bucket's manifest is missing, unparsable or inconsistent."""


class StaleManifestError(ManifestError):
    """A manifest whose newest version is older than one a reader saw before (a stale read
    from a cache in front of the store, or an old manifest written back): ignored, never
    followed backward."""


class ForeignRunError(ManifestError):
    """A manifest of another run (another ``run_id``) where a reader follows one run: refused."""


class ConcurrentWriterError(DeltaSyncError):
    """Another trainer holds (or took over) the run's writer lease."""


class StoreError(DeltaSyncError):
    """A storage operation failed after its retries."""


class StoreNotFoundError(StoreError):
    """The object does not exist (a local folder that does not exist counts as empty). On a
    Hugging Face bucket, a missing *bucket* raises :class:`StoreBucketNotFoundError` instead."""


class StoreAccessError(StoreError):
    """The store cannot be used as configured and waiting will not help: the credentials were
    refused or the bucket does not exist. Not retried; the message names the bucket and the fix.

    Attributes:
        summary: a short line without paths, URIs or server text, safe for public pages
            (e.g. "bucket unreadable: token lacks access").
    """

    summary = "bucket unreadable"

    def __init__(self, message: str, summary: str | None = None):
        super().__init__(message)
        if summary is not None:
            self.summary = summary


class StoreAuthError(StoreAccessError):
    """The store refused the credentials (HTTP 401/403). Not retried."""

    summary = "bucket unreadable: token lacks access"


class StoreBucketNotFoundError(StoreAccessError):
    """The bucket itself does not exist, or the token cannot see it (the Hub answers 404 for a
    private bucket the token has no access to). Not retried; never means "no version yet"."""

    summary = "bucket not found: check the bucket name and the token"


class StoreRateLimitError(StoreError):
    """The store kept answering HTTP 429 (rate limited) after its retries, each of which waited
    the ``Retry-After`` the server asked for; ``retry_after_s``: the last wait asked for (capped
    by the store's ``max_retry_after_s``), None where unknown."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class KeyFileError(DeltaSyncError):
    """A run key cannot be used: the private key file is missing, readable by group or others
    (fix: ``chmod 600``) or not an Ed25519 key; or a ``RUN_PUBLIC_KEY`` is not one's text."""


class SignatureError(ManifestError):
    """A manifest's signature does not verify with the run's public key (the manifest was
    changed after it was signed). Refused before anything is planned or applied."""


class UnsignedVersionError(SignatureError):
    """A reader that requires signed versions (it has the run's public key) found a manifest
    without a signature. Refused."""


class ForeignKeyError(SignatureError):
    """A manifest signed by another key than the run's. Refused."""


class PayloadDigestError(DeltaCorruptError):
    """A payload file's bytes do not hash to the SHA-256 its signed manifest names (or it names
    none). Nothing of it is applied; the reader plans around it."""
