"""deltasync: lossless sparse bf16 weight deltas through an object-store bucket.

Light by design: importing ``deltasync`` imports neither torch nor vLLM. Import the parts you need:
``deltasync.publisher.DeltaPublisher`` (trainer), ``deltasync.subscriber.DeltaSubscriber``
(replicas), ``deltasync.store.Store``, ``deltasync.manifest.Manifest``, ``deltasync.codec``,
``deltasync.adapter`` (LoRA adapter runs).
"""

from .errors import (
    AdapterMismatchError,
    BaseVersionMismatch,
    ConcurrentWriterError,
    DeltaCorruptError,
    DeltaSyncError,
    ManifestError,
    ModelMismatchError,
    StoreAuthError,
    StoreError,
    StoreNotFoundError,
    VersionNotKeptError,
    WrongBaseModelError,
)

__version__ = "0.1.0"
__all__ = [
    "AdapterMismatchError",
    "BaseVersionMismatch",
    "ConcurrentWriterError",
    "DeltaCorruptError",
    "DeltaSyncError",
    "ManifestError",
    "ModelMismatchError",
    "StoreAuthError",
    "StoreError",
    "StoreNotFoundError",
    "VersionNotKeptError",
    "WrongBaseModelError",
]
