"""``PublisherConfig``: the settings of a ``deltasync.publisher.DeltaPublisher``, with units.

Imported by ``deltasync.publisher`` (and re-exported there, where trainers import it from).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cadence import plan_limits
from .snapshot import DIFF_ON


@dataclass
class PublisherConfig:
    """Settings of a :class:`~deltasync.publisher.DeltaPublisher`.

    Attributes:
        anchor_every: versions between anchors (a full snapshot), counted from the last anchor.
            40 (was 20): with sparse deltas (a pretrained model at lr 1e-6, 0.2% of elements a
            version) anchors were 97% of the bytes a trainer uploaded at 20, and a replica 32
            versions behind lost its delta chain (14 MB) to retention and paid an anchor and
            more (155 MB); at 40 the anchor bytes halve and a new replica pays 1.5% more. With
            dense deltas ``anchor_replay_fraction`` anchors first (about every 11 versions for
            the local model). ``bench/bench_catch_up.py``, docs/BENCHMARKS.md section 12 (catch-up against lag).
        anchor_replay_fraction: also anchor when the delta bytes since the last anchor exceed
            this fraction of an anchor's bytes, which bounds what a new replica downloads.
        keep_anchors: retention; versions older than the ``keep_anchors``-th newest anchor are
            dropped from the manifest and their files deleted.
        part_bytes: size cap of one payload file in bytes (larger payloads are split, so parts
            upload and download in parallel and none needs one huge buffer).
        zstd_level: zstandard level of the value streams (1-22).
        encode_threads: threads that diff and encode tensors in parallel (the kernels release
            the GIL); the default suits the 2-core CPU default, use more on a big trainer host.
        diff_on: where ``publish`` diffs (``deltasync.snapshot.Snapshot``): ``auto`` on the
            device that holds each tensor (an accelerator keeps a bf16 copy of the last
            published bits; only changes cross to the host), ``host``, or ``device``.
        lease_s: the writer lease in seconds; another trainer is refused while it is fresh.
        takeover: take the run over even if another writer's lease looks fresh.
        new_run: start a new run on a prefix that holds payload files but no ``manifest.json``
            (a trainer that died before its first commit, or a run whose manifest is lost),
            deleting those files. Off by default: a manifest that reads as missing may be a
            spurious not-found of a live run, whose history a new run would drop.
        adaptive_cadence: publish every k-th ``publish``/``offer`` call, k chosen from the
            token's request budget (``deltasync.cadence.PublishCadence``; ``DeltaPublisher.offer``
            skips the others, which are then not diffed nor uploaded). None (default): on for
            ``hf://`` buckets only, the one store here with a request limit; a local folder has
            none, and there every call publishes as before. True/False: on/off everywhere.
        hub_plan: the bucket token's Hub plan, whose per-5-minute limit the cadence keeps to:
            ``free`` (1,000 API + 5,000 resolver requests), ``pro`` (2,500 / 12,000), ``team``
            (3,000 / 20,000), ``enterprise`` (6,000 / 50,000), or the API requests per 5 minutes
            as an integer. Figures: the Hub docs' rate limits, docs/SCALE.md.
        target_share: the share of that limit the publisher aims at (the rest: the trainer's
            fleet discovery and metrics writes on the same token, and headroom).
        max_publish_every: the largest k (None: no bound); the trainer sets it to its
            ``max_staleness``, so that the newest published version's samples stay within it.

    Raises (on construction):
        ValueError: ``anchor_every``, ``keep_anchors`` or ``part_bytes`` below 1, an unknown
            ``diff_on``, a ``target_share`` outside (0, 1] or a ``max_publish_every`` below 1.
        HubPlanError: (a ValueError) a ``hub_plan`` that is no plan and no positive integer.
    """

    anchor_every: int = 40
    anchor_replay_fraction: float = 0.5
    keep_anchors: int = 2
    part_bytes: int = 512 * 2**20
    zstd_level: int = 3
    encode_threads: int = 2
    lease_s: float = 120.0
    takeover: bool = False
    new_run: bool = False
    diff_on: str = "auto"
    adaptive_cadence: bool | None = None
    hub_plan: str = "free"
    target_share: float = 0.8
    max_publish_every: int | None = None

    def __post_init__(self):
        if self.anchor_every < 1 or self.keep_anchors < 1 or self.part_bytes < 1:
            raise ValueError(f"anchor_every, keep_anchors, part_bytes must be >= 1: {self}")
        if self.diff_on not in DIFF_ON:
            raise ValueError(f"diff_on must be one of {DIFF_ON}, found {self.diff_on!r}")
        plan_limits(self.hub_plan)  # HubPlanError (a ValueError) names the plans and the fix
        if not 0 < self.target_share <= 1:
            raise ValueError(
                f"target_share: expected a share of the limit in (0, 1], found "
                f"{self.target_share}; fix: e.g. 0.8"
            )
        if self.max_publish_every is not None and self.max_publish_every < 1:
            raise ValueError(
                f"max_publish_every: expected >= 1 or None, found {self.max_publish_every}"
            )
