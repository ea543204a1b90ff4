"""What one poll of the run root found (:class:`Snapshot`: state, messages, frames) and what it cost
(:class:`ReadStats`), with the Markdown summary the page shows. Imports neither torch nor
gradio."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd

from .frames import empty_frame
from .problems import Problem, ProblemKind


@dataclass
class ReadStats:
    """What one poll cost: ``stat_calls`` (store requests: conditional reads and listings),
    ``files_read`` (files that changed and were downloaded), ``bytes_read``."""

    stat_calls: int = 0
    files_read: int = 0
    bytes_read: int = 0


@dataclass
class Snapshot:
    """What the dashboard shows after one poll of the bucket.

    Attributes:
        bucket: the run root's URI as given.
        state: "waiting" (no version yet, or an invalid manifest), "ok", or "error" (the run root
            cannot be read).
        message: one line for the operator (logs): what the state means, with the URI and the
            reason.
        public: the same for public pages: the kind of problem, no URI, local path or exception
            text.
        read_at: unix seconds of the poll.
        problem: why the state is not "ok" (None when it is).
        run_id: the manifest's run id (None before the first manifest).
        trainer_version: newest version in the manifest (None before the first).
        trainer_published_at: unix seconds of that version's commit.
        warnings: files skipped this poll (malformed heartbeat, metrics) and other file-level
            problems while the run is still shown, one :class:`Problem` each.
        frames: {name: DataFrame} with the columns of ``frames.COLUMNS``.
        stats: what this poll read.
    """

    bucket: str
    state: Literal["waiting", "ok", "error"]
    message: str
    read_at: float
    public: str = ""
    problem: Problem | None = None
    run_id: str | None = None
    trainer_version: int | None = None
    trainer_published_at: float | None = None
    warnings: list[Problem] = field(default_factory=list)
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    stats: ReadStats = field(default_factory=ReadStats)

    def frame(self, name: str) -> pd.DataFrame:
        """The frame ``name`` (an empty one with its columns if it was not built)."""
        return self.frames.get(name, empty_frame(name))

    def public_warnings(self) -> list[str]:
        """The warnings as public pages show them: one line per heartbeat that does not parse
        (naming its replica), and one line counting the other skipped files."""
        named = [w for w in self.warnings if w.kind is ProblemKind.HEARTBEAT_UNPARSABLE]
        lines = [w.public for w in named]
        if others := len(self.warnings) - len(named):
            lines.append(f"{others} {ProblemKind.FILE_SKIPPED.value}")
        return lines

    def markdown(self, public: bool = False) -> str:
        """A short Markdown summary: state, run, trainer version, replicas, warnings, evaluations
        (``public``: the public message, and warnings without file details)."""
        lines = [f"**{self.state.upper()}**: {self.public if public else self.message}"]
        if self.run_id is not None:
            age = self.read_at - self.trainer_published_at if self.trainer_published_at else None
            age_txt = f", published {age:.0f} s ago" if age is not None else ""
            lines.append(
                f"run `{self.run_id}` · trainer version **{self.trainer_version}**{age_txt}"
            )
        status = self.frame("status")
        if len(status):
            flagged = status[~status["health"].isin(["ok", "starting", "stopped"])]
            lines.append(f"{len(status)} replica(s), {len(flagged)} flagged")
        if public:
            lines += [f"warning: {_escape(w)}" for w in self.public_warnings()]
        else:
            lines += [f"warning: {w.detail}" for w in self.warnings]
        evals = self.frame("evals")
        for r in evals.itertuples():
            consistent = (
                f", consistent {100 * r.consistent_rate:.0f}%"
                if pd.notna(r.consistent_rate)
                else ""
            )
            lines.append(
                f"eval **{r.label}** (step {r.step}, {r.episodes} games): reward "
                f"{r.reward_mean:.3f} ± {r.reward_se:.3f} (SE), win rate {100 * r.win_rate:.0f}%"
                f"{consistent}"
            )
        stamp = time.strftime("%H:%M:%S", time.localtime(self.read_at))
        lines.append(
            f"<small>read {stamp} · {self.stats.files_read} file(s), "
            f"{self.stats.bytes_read} bytes, {self.stats.stat_calls} stat call(s)</small>"
        )
        return "  \n".join(lines)


def _escape(text: str) -> str:
    """``text`` with Markdown's special characters escaped (a replica id is shown as written)."""
    return re.sub(r"([\\`*_\[\]<>#|])", r"\\\1", text)
