"""Exceptions raised by deltasync. Each message says what was expected, what was found, and the fix."""

from __future__ import annotations


class DeltaSyncError(Exception):
    """Base class of every error deltasync raises on purpose."""


class DeltaCorruptError(DeltaSyncError):
    """A payload file failed validation: unparsable, truncated, wrong shapes, out-of-range
    positions, or a digest mismatch. Nothing from that file has been applied."""


class BaseVersionMismatch(DeltaSyncError):
    """A delta's `base_version` is not the version the receiver holds."""


class ModelMismatchError(DeltaSyncError):
    """Tensor names, shapes or dtypes differ from the run's model fingerprint."""


class ManifestError(DeltaSyncError):
    """The bucket's manifest is missing, unparsable or inconsistent."""


class ConcurrentWriterError(DeltaSyncError):
    """Another trainer holds (or took over) the run's writer lease."""


class StoreError(DeltaSyncError):
    """A storage operation failed after its retries."""


class StoreNotFoundError(StoreError):
    """The object (or the bucket itself) does not exist."""


class StoreAuthError(StoreError):
    """The store refused the credentials (HTTP 401/403). Not retried."""
