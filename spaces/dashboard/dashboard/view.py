"""The run as one poll of its root saw it (:class:`RunView`: state, messages, frames) and what the
poll cost (:class:`ReadStats`), with the Markdown summary the page shows, and how an adapter run is
named (:func:`describe_adapter`, :func:`public_base_model`, :func:`version_noun`). Not to be
confused with ``deltasync.snapshot.Snapshot``, the publisher's copy of the last published weights.
Imports neither torch nor gradio."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd

from deltasync.manifest import AdapterInfo

from .frames import empty_frame
from .problems import Problem, ProblemKind

# A base model name public pages show: a Hub id ("Qwen/Qwen3-0.6B") or a bare name ("tiny-qwen3",
# what the trainer records for a local folder). Anything else (an absolute path, "~", "./", "..",
# more than one "/", a backslash, a URI) is taken for a filesystem path and left out. A relative
# "folder/model" cannot be told from a Hub id and is shown.
_PUBLIC_MODEL_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?", re.ASCII)
_ADAPTER_KINDS = {"lora": "LoRA"}  # AdapterInfo.kind -> how the page names it


def version_noun(adapter: AdapterInfo | None) -> str:
    """What one published version is called on the page: "adapter version" in an adapter run
    (``adapter`` set: the versions hold the adapter's tensors only), "version" otherwise."""
    return "version" if adapter is None else "adapter version"


def public_base_model(name: str) -> str | None:
    """``name`` (``AdapterInfo.base_model``) if public pages may show it: a Hub id or a bare model
    name; None for anything that looks like a filesystem path or a URI (public pages show no
    paths)."""
    if ".." in name or not _PUBLIC_MODEL_NAME.fullmatch(name):
        return None
    return name


def describe_adapter(adapter: AdapterInfo, public: bool = False) -> str:
    """One line naming an adapter run, e.g. "LoRA adapter r=8, alpha 16 on `Qwen/Qwen3-0.6B`
    (base 1a2b3c4d)": kind, rank and alpha from ``peft_config``, the base model's name (left out
    when ``public`` and it is a path: :func:`public_base_model`) and the first 8 hex digits of the
    base digest. Markdown."""
    cfg = adapter.peft_config
    base = public_base_model(adapter.base_model) if public else adapter.base_model
    on = " on `{}`".format(base.replace("`", "'")) if base else ""  # a path may hold a "`"
    kind = _ADAPTER_KINDS.get(adapter.kind, adapter.kind)
    return (
        f"{kind} adapter r={cfg['r']}, alpha {cfg['lora_alpha']:g}{on} "
        f"(base {adapter.base_digest[:8]})"
    )


def public_adapter(adapter: AdapterInfo | None) -> dict | None:
    """An adapter run's adapter as the ``/status`` API shows it (None for a full-weight run):
    ``kind``, ``r``, ``lora_alpha``, ``target_modules``, ``base_model`` (None when it is a path:
    :func:`public_base_model`), ``base_digest`` and ``summary`` (:func:`describe_adapter`). The
    rest of ``peft_config`` is left out: it may name the base's local folder."""
    if adapter is None:
        return None
    cfg = adapter.peft_config
    return {
        "kind": adapter.kind,
        "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"],
        "target_modules": cfg["target_modules"],
        "base_model": public_base_model(adapter.base_model),
        "base_digest": adapter.base_digest,
        "summary": describe_adapter(adapter, public=True).replace("`", ""),
    }


@dataclass
class ReadStats:
    """What one poll cost: ``stat_calls`` (store requests: conditional reads and listings),
    ``files_read`` (files that changed and were downloaded), ``bytes_read``."""

    stat_calls: int = 0
    files_read: int = 0
    bytes_read: int = 0


@dataclass
class RunView:
    """The run as one poll of its root saw it: the state, its messages and the frames the page
    draws (``BucketReader.read`` returns one per poll).

    Attributes:
        bucket: the run root's URI as given.
        state: "waiting" (no version yet), "ok", or "error" (the run root cannot be read, or its
            manifest does not parse and no good one was seen).
        message: one line for the operator (logs): what the state means, with the URI and the
            reason.
        public: the same for public pages: the kind of problem, no URI, local path or exception
            text.
        read_at: unix seconds of the poll.
        problem: why the state is not "ok" (None when it is).
        run_id: the manifest's run id (None before the first manifest).
        trainer_version: newest version in the manifest (None before the first).
        trainer_published_at: unix seconds of that version's commit.
        adapter: the manifest's adapter in an adapter run (its versions hold only the adapter's
            tensors), None in a full-weight run or before the first manifest.
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
    adapter: AdapterInfo | None = None
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
        """A short Markdown summary: state, run, trainer version, the adapter of an adapter run
        (:func:`describe_adapter`), replicas, warnings, evaluations (``public``: the public
        message, warnings without file details, and no base model path)."""
        lines = [f"**{self.state.upper()}**: {self.public if public else self.message}"]
        if self.run_id is not None:
            age = self.read_at - self.trainer_published_at if self.trainer_published_at else None
            age_txt = f", published {age:.0f} s ago" if age is not None else ""
            lines.append(
                f"run `{self.run_id}` · trainer {version_noun(self.adapter)} "
                f"**{self.trainer_version}**{age_txt}"
            )
        if self.adapter is not None:
            lines.append(describe_adapter(self.adapter, public))
        status = self.frame("status")
        if len(status):
            flagged = status[~status["health"].isin(["ok", "starting", "stopped"])]
            lines.append(f"{len(status)} replica(s), {len(flagged)} flagged")
        if public:
            lines += [f"warning: {_escape(w)}" for w in self.public_warnings()]
        else:
            lines += [f"warning: {w.detail}" for w in self.warnings]
        lines += self._dropped_lines()
        lines += self._cadence_lines()
        evals = self.frame("evals")
        figures = self.frame("figures")
        headline = figures[figures["evals"].astype(bool) & figures["headline"].astype(bool)]
        headline = headline[~headline["counts"].astype(bool)]
        for _, r in evals.iterrows():
            shown = "".join(  # the task's headline figures that this evaluation has
                f", {f.label} {_figure_text(r[f.name], f.unit)}"
                for f in headline.itertuples()
                if f.name in r.index and pd.notna(r[f.name])
            )
            lines.append(
                f"eval **{r['label']}** (step {r['step']}, {r['episodes']} games): reward "
                f"{r['reward_mean']:.3f} ± {r['reward_se']:.3f} (SE){shown}"
            )
        stamp = time.strftime("%H:%M:%S", time.localtime(self.read_at))
        lines.append(
            f"<small>read {stamp} · {self.stats.files_read} file(s), "
            f"{self.stats.bytes_read} bytes, {self.stats.stat_calls} stat call(s)</small>"
        )
        return "  \n".join(lines)

    def _dropped_lines(self) -> list[str]:
        """One line when steps had episodes the environment failed (no reward): the last such
        step's count and the total; none otherwise."""
        training = self.frame("training")
        if not len(training) or "dropped_episodes" not in training:
            return []
        dropped = training[training["dropped_episodes"].fillna(0) > 0]
        if not len(dropped):
            return []
        last = dropped.iloc[-1]
        games = 0 if pd.isna(last["games"]) else int(last["games"])
        n = int(last["dropped_episodes"])
        return [
            f"dropped episodes (the environment failed them): **{n} of {n + games}** at step "
            f"{int(last['step'])}, {int(dropped['dropped_episodes'].sum())} in "
            f"{len(dropped)} step(s)"
        ]

    def _cadence_lines(self) -> list[str]:
        """One line while the publisher's cadence (``deltasync.cadence``: the Hub token's request
        budget) publishes every k > 1 syncs, k as of the last step that recorded it; none
        otherwise (k = 1, no cadence, or a file written before it was recorded)."""
        training = self.frame("training")
        if not len(training) or "publish_every" not in training:
            return []
        recorded = training["publish_every"].dropna()
        if not len(recorded) or int(recorded.iloc[-1]) <= 1:
            return []
        return [f"publishing every {int(recorded.iloc[-1])} syncs (Hub budget)"]


def _figure_text(value: float, unit: str) -> str:
    """A task figure as the summary shows it: a share as a percentage, another number to 3
    significant digits with its unit."""
    if unit == "share":
        return f"{100 * value:.0f}%"
    return f"{value:.3g}" + (f" {unit}" if unit else "")


def _escape(text: str) -> str:
    """``text`` with Markdown's special characters escaped (a replica id is shown as written)."""
    return re.sub(r"([\\`*_\[\]<>#|])", r"\\\1", text)
