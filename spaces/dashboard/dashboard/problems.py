"""What the dashboard may say in public about a problem: the kinds of problem a poll of the run root
can find (:class:`ProblemKind`), one found problem (:class:`Problem`: its public line, and the
details that stay in the server log), and a replica's ``last_error`` reduced to its kind
(:func:`public_error`). Public lines name the kind of problem only: no bucket URI, local path or
exception text. Imports neither torch nor gradio."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


class ProblemKind(enum.Enum):
    """The kinds of problem a poll can find. The value is the public line (a template for
    ``ACCESS_REFUSED`` and ``HEARTBEAT_UNPARSABLE``); :attr:`state` is the state it puts
    the page in, or None for a file skipped while the run is still shown."""

    NOT_PUBLISHED = "waiting for the first version"  # no folder, no manifest or no version yet
    # the manifest does not parse and no good one was seen: damaged, as the trainer writes it
    # whole (temp file + rename, or one upload), so waiting alone does not mend it
    MANIFEST_UNPARSABLE = "the manifest does not parse"
    ROOT_NOT_A_FOLDER = "the run root is not a folder"
    ACCESS_REFUSED = "{summary}"  # token refused or bucket missing: StoreAccessError.summary
    RATE_LIMITED = "bucket unreadable: rate limited by the Hub (HTTP 429; retrying)"
    STORE_FAILED = "bucket unreadable: storage error (retrying)"  # any other storage failure
    HEARTBEAT_UNPARSABLE = "the heartbeat of replica {replica} does not parse"
    # the metrics, or the manifest after a good one was read (counted on public pages, not named)
    FILE_SKIPPED = "file(s) skipped this poll (malformed)"

    @property
    def state(self) -> Literal["waiting", "error"] | None:
        """The state (``RunView.state``) this kind puts the page in (None: the run is still
        shown)."""
        if self is ProblemKind.NOT_PUBLISHED:
            return "waiting"
        if self in (ProblemKind.HEARTBEAT_UNPARSABLE, ProblemKind.FILE_SKIPPED):
            return None
        return "error"


@dataclass(frozen=True)
class Problem:
    """One problem found by a poll.

    Attributes:
        kind: what kind of problem it is.
        detail: one line for the operator (server log and private pages): names the URI or the
            file and why, exception text included.
        replica_id: ``HEARTBEAT_UNPARSABLE``: the replica, from the heartbeat's file name.
        summary: ``ACCESS_REFUSED``: the error's own public line (``StoreAccessError.summary``).
    """

    kind: ProblemKind
    detail: str
    replica_id: str | None = None
    summary: str | None = None

    @property
    def public(self) -> str:
        """The line public pages show: the kind of problem, no path, URI or exception text."""
        summary = self.summary or "bucket unreadable"
        return self.kind.value.format(summary=summary, replica=self.replica_id or "?")

    def __str__(self) -> str:
        return self.detail


def public_error(last_error: str | None) -> str:
    """A replica's ``last_error`` as public pages show it: the error's kind only (no paths, no
    exception text); "" when there is none."""
    if not last_error:
        return ""
    kind = last_error.split(":", 1)[0].strip()
    return _PUBLIC_ERRORS.get(kind, "error (see the replica's log)")


_PUBLIC_ERRORS = {
    "StoreAuthError": "bucket unreadable: token lacks access",
    "StoreBucketNotFoundError": "bucket not found: check the bucket name and the token",
    "StoreRateLimitError": "rate limited by the Hub",
    "StoreError": "bucket read failed (retrying)",
    "StoreNotFoundError": "a payload file is missing (re-planning)",
    "DeltaCorruptError": "refused a corrupt payload",
    "BaseVersionMismatch": "refused a delta on the wrong base",
    "ModelMismatchError": "model mismatch",
    "ManifestError": "invalid manifest",
    "EngineControlError": "engine control failed",
    # signed versions (RUN_PUBLIC_KEY): the replica refused a version and keeps serving its own
    "SignatureError": "refused a version: its signature does not verify",
    "UnsignedVersionError": "refused an unsigned version",
    "ForeignKeyError": "refused a version signed by another key",
    "PayloadDigestError": "refused a payload that differs from the signed one",
    "StaleManifestError": "ignored an older manifest",
    "ForeignRunError": "ignored another run's manifest",
}
