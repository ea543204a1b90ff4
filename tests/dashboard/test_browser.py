"""The dashboard in a real browser: ``python -m dashboard`` on a local bucket that a
background publisher thread (real DeltaPublisher + DeltaSubscriber replicas) starts writing to
after the page opened. Headless Chromium (Debian's ``chromium`` package, driven through its own
DevTools protocol; nothing is downloaded) must show the "waiting" state first, then every plot and
the status table, and the same page must update on its ``gr.Timer`` as new versions land. As
rendered, the status table's headers must be the words of ``STATUS_HEADERS`` ("Held version",
"Lag (s)"), no word of a header broken over two lines or sticking out of its cell, and every plot's
title and axis titles drawn whole (as ``plot_labels`` gives them) inside the plot, an axis title no
longer than its axis. Saves ``test-artifacts/dashboard.png`` and also drives the live server's API
with ``gradio_client``.

Then one dashboard on a run root prepared with one fault after another (a file instead of a
folder, a manifest that does not parse, a heartbeat that does not parse): each page load must name
the fault ("the run root is not a folder", "the manifest does not parse" as an ERROR, not
WAITING, "the heartbeat of replica broken does not parse") and show no filesystem path or file
name; the same root then holds an adapter run, whose page must name the adapter ("LoRA adapter
r=4, alpha 8", "trainer adapter version", plots titled for adapter versions and bytes, the table's
"Held adapter version"), its titles and headers whole as above, without its base model's local
folder. One Chromium serves the whole module."""

from __future__ import annotations

import json
import re
import shutil
import threading
from base64 import b64decode
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync.manifest import MANIFEST_PATH, Manifest
from deltasync.store import Store

pytest.importorskip("gradio", reason="the dashboard extra (gradio) is not installed")

from dashboard import ui  # noqa: E402
from tools.browser import CHROMIUM  # noqa: E402

from .browser_helpers import Cdp, _wait, chromium, dashboard  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / "test-artifacts" / "dashboard.png"
PLOTS = [
    "plot-versions",
    "plot-lag-versions",
    "plot-lag-seconds",
    "plot-payload",
    "plot-density",
    "plot-paused",
    "plot-phases",
    "plot-reward",
    "plot-staleness",
]
# Plots whose x axis is the version (or the trainer step, one version per step here).
VERSIONED = ["plot-payload", "plot-density", "plot-reward", "plot-staleness"]
# What the page shows: summary text; per plot (vega SVG) the marks drawn, the legend labels and the
# newest version/step among the marks' aria labels; the status table's cells.
PROBE = """(() => {
  const plots = {};
  document.querySelectorAll('[id^="plot-"]').forEach(el => {
    plots[el.id] = {
      marks: el.querySelectorAll('g.role-mark > *').length,
      legend: [...el.querySelectorAll('g.role-legend-label text')].map(t => t.textContent),
      newest: Math.max(-1, ...[...el.querySelectorAll('g.role-mark > *')].map(m => {
        const r = /(?:version|step): ([0-9.]+)/.exec(m.getAttribute('aria-label') || '');
        return r ? parseFloat(r[1]) : -1;
      })),
    };
  });
  const rows = [...document.querySelectorAll('#status-table .virtual-body [role="row"]')]
    .map(tr => [...tr.querySelectorAll('[role="gridcell"]')].map(td => td.textContent.trim()));
  return {summary: document.querySelector('#summary')?.innerText ?? '', plots, rows};
})()"""
# Each plot's title and axis titles as drawn (vega SVG): {elem_id: "title | x title | y title"}.
TITLES = """Object.fromEntries([...document.querySelectorAll('[id^="plot-"]')].map(el => [el.id,
  [...el.querySelectorAll('g.role-title text, g.role-axis-title text')].map(t => t.textContent)
    .join(' | ')]))"""
# Each status table header as drawn: its text, the words broken over two lines, the words that
# stick out of the header cell, and the lines it takes.
HEADERS = """[...document.querySelectorAll('#status-table th')].map(th => {
  const span = th.querySelector('span.header'), cell = th.getBoundingClientRect();
  const broken = [], outside = [];
  const walker = document.createTreeWalker(span, NodeFilter.SHOW_TEXT);
  for (let node; (node = walker.nextNode());) {
    for (const m of node.data.matchAll(/\\S+/g)) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const rects = [...range.getClientRects()];
      if (new Set(rects.map(r => Math.round(r.top))).size > 1) broken.push(m[0]);
      const out = r => r.left < cell.left - 0.5 || r.right > cell.right + 0.5;
      if (rects.some(out)) outside.push(m[0]);
    }
  }
  const lines = span.getBoundingClientRect().height / parseFloat(getComputedStyle(span).lineHeight);
  return {text: span.textContent.trim(), broken, outside, lines: Math.round(lines)};
})"""
# Each plot's title and axis titles as drawn: {elem_id: [{text, in_svg, in_box, fits_axis, rects}]}.
# Along its length (a rotated y axis title: top to bottom) a text lies inside the plot's svg and
# its block (a title cut at its ends fails), and across it its middle lies inside the block (its
# box, the font's line box, may pass the svg's edge by a few pixels with no ink there); an axis
# title is no longer than its axis (the plot frame's width, or its height for the y axis).
TITLE_FIT = """Object.fromEntries([...document.querySelectorAll('[id^="plot-"]')].map(el => {
  const box = el.getBoundingClientRect(), svg = el.querySelector('svg').getBoundingClientRect();
  const frame = el.querySelector('g.role-frame path.background').getBoundingClientRect();
  const at = b => [b.left, b.top, b.right, b.bottom].map(Math.round);
  return [el.id, [...el.querySelectorAll('g.role-title text, g.role-axis-title text')].map(t => {
    const r = t.getBoundingClientRect(), vertical = r.height > r.width;
    const [lo, hi, mid] = vertical ? [r.top, r.bottom, (r.left + r.right) / 2]
                                   : [r.left, r.right, (r.top + r.bottom) / 2];
    const along = b => vertical ? lo >= b.top - 1 && hi <= b.bottom + 1
                                : lo >= b.left - 1 && hi <= b.right + 1;
    const across = b => vertical ? mid >= b.left && mid <= b.right
                                 : mid >= b.top && mid <= b.bottom;
    const axis = t.closest('g.role-axis-title') !== null;
    const length = vertical ? frame.height : frame.width;
    return {text: t.textContent, in_svg: along(svg), in_box: along(box) && across(box),
            fits_axis: !axis || hi - lo <= length + 2,
            rects: {text: at(r), svg: at(svg), box: at(box), frame: at(frame)}};
  })];
}))"""

if CHROMIUM is None:
    pytest.skip(
        "Debian's chromium is not installed: apt-get install -y chromium chromium-driver",
        allow_module_level=True,
    )
ws_client = pytest.importorskip(
    "websockets.sync.client", reason="websockets (installed with gradio/openenv) is missing"
)
gradio_client = pytest.importorskip("gradio_client", reason="gradio_client (dev extra) missing")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Iterator[Cdp]:
    """One headless Chromium page for every test of this module (started once)."""
    with chromium(tmp_path_factory.mktemp("chromium")) as cdp:
        yield cdp


def _assert_headers_read_whole(page: Cdp, adapter: bool) -> None:
    """The status table's headers are drawn as ``status_headers`` words, no word of them broken
    over two lines or sticking out of its cell."""
    want = list(ui.status_headers(adapter).values())
    last = []

    def drawn_whole():  # the table may still be taking its new columns' widths
        last[:] = page.evaluate(HEADERS)
        return [h["text"] for h in last] == want and not any(h["broken"] for h in last)

    _wait(drawn_whole, 10, "the status table's headers, whole", lambda: last)
    for h in last:
        assert not h["broken"] and not h["outside"], h
        assert 1 <= h["lines"] <= len(h["text"].split()), h  # a line holds one word or more


def _assert_titles_fit(page: Cdp, adapter: bool) -> None:
    """Every plot's title and axis titles are drawn whole (the labels of ``plot_labels``, not
    cut short) inside the plot's svg and block, each axis title no longer than its axis."""
    drawn = page.evaluate(TITLE_FIT)
    assert set(drawn) == {spec.elem_id for spec in ui.PLOTS}
    for spec in ui.PLOTS:
        texts = drawn[spec.elem_id]
        assert sorted(t["text"] for t in texts) == sorted(ui.plot_labels(spec, adapter).values())
        for t in texts:
            assert t["in_svg"] and t["in_box"] and t["fits_axis"], (
                f"{spec.elem_id}: {json.dumps(t)}"
            )


def _trainer_version(summary: str) -> int | None:
    m = re.search(r"trainer version (\d+)", summary)
    return int(m.group(1)) if m else None


def test_dashboard_renders_and_updates_in_chromium(tmp_path, run_recorder, page):
    bucket = str(tmp_path / "bucket")  # does not exist yet: the trainer has not started
    stop, errors = threading.Event(), []

    def publish_loop():
        try:
            rec = run_recorder(bucket, anchor_every=4)
            try:
                while not stop.is_set():
                    rec.step()
                    stop.wait(0.4)
            finally:
                rec.close()
        except BaseException as e:  # handed to the test thread, which fails on it
            errors.append(e)

    publisher = threading.Thread(target=publish_loop, name="test-publisher", daemon=True)
    with dashboard(bucket, tmp_path) as url:
        page.call("Page.navigate", url=url)
        last = {}

        def probe(check):
            nonlocal last
            last = page.evaluate(PROBE) or {}
            return last if check(last) else None

        _wait(
            lambda: probe(lambda p: "WAITING" in p.get("summary", "")),
            60,
            "the waiting state",
            lambda: last,
        )
        assert "waiting for the first version" in last["summary"]

        publisher.start()
        first = _wait(
            lambda: probe(
                lambda p: (
                    _trainer_version(p["summary"]) is not None
                    and len(p["rows"]) == 2
                    and all(p["plots"].get(k, {}).get("marks", 0) > 0 for k in PLOTS)
                )
            ),
            90,
            "every plot and the status table",
            lambda: (last, errors),
        )
        assert not errors, errors
        v1 = _trainer_version(first["summary"])
        assert [r[0] for r in first["rows"]] == ["r0", "r1"]

        # the same page (no reload) updates on its timer; series that appeared after the first
        # render (deltas after the first anchor, anchor markers) get drawn and named
        legends = {
            "plot-versions": {"trainer", "r0", "r1"},
            "plot-lag-versions": {"r0", "r1"},
            "plot-payload": {"anchor", "delta"},
            "plot-density": {"delta", "anchor+delta"},
            "plot-phases": {"fetch", "decode", "apply", "paused"},
            "plot-paused": {"r0", "r1"},
        }
        later = _wait(
            lambda: probe(
                lambda p: (
                    (_trainer_version(p["summary"]) or -1) >= v1 + 3
                    and p["rows"] != first["rows"]
                    and all(want <= set(p["plots"][k]["legend"]) for k, want in legends.items())
                )
            ),
            60,
            "the page to update",
            lambda: (first, last, errors),
        )
        for k in PLOTS:
            assert later["plots"][k]["marks"] >= first["plots"][k]["marks"], k
        # once the publisher stops, every plot must catch up with the newest version
        stop.set()
        publisher.join(timeout=30)
        assert not errors, errors
        newest = Store(bucket).read_bytes(MANIFEST_PATH)
        newest = Manifest.from_json(newest).latest.version
        _wait(
            lambda: probe(
                lambda p: (
                    _trainer_version(p["summary"]) == newest
                    and all(p["plots"][k]["newest"] == newest for k in VERSIONED)
                )
            ),
            30,
            f"every plot to show version {newest}",
            lambda: last,
        )
        # the page reads whole: headers in words, no word broken, every title inside its plot
        _assert_headers_read_whole(page, adapter=False)
        _assert_titles_fit(page, adapter=False)
        shot = page.call("Page.captureScreenshot", format="png")
        ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
        ARTIFACT.write_bytes(b64decode(shot["data"]))

        client = gradio_client.Client(url, verbose=False)
        status = client.predict(api_name="/status")
        assert status["state"] == "ok"
        assert status["trainer_version"] >= _trainer_version(later["summary"])
        assert {r["replica"] for r in status["replicas"]} == {"r0", "r1"}
        assert all(r["health"] == "ok" for r in status["replicas"])
    assert not errors, errors
    assert ARTIFACT.stat().st_size > 10_000


def test_public_page_names_each_fault(tmp_path, recorded_bucket, adapter_bucket, page):
    root = tmp_path / "run-root-with-faults"
    root.write_text("a file where the run's folder should be")
    # what must never reach the page: the folders, the file names, the parsers' words, the adapter
    # run's base model folder (tmp_path / BASE_DIR)
    hidden = [str(tmp_path), root.name, "replicas/", ".json", "Invalid JSON", "validation error"]
    hidden.append("qwen3-base")

    def shows(url: str, message: str) -> str:
        """Load the page afresh and wait for ``message`` in its summary; returns the page text."""
        page.call("Page.navigate", url=url)
        last = {}

        def probe():
            last["summary"] = page.evaluate("document.querySelector('#summary')?.innerText ?? ''")
            return message in last["summary"]

        _wait(probe, 30, repr(message), lambda: last)
        text = page.evaluate("document.body.innerText")
        for secret in hidden:
            assert secret not in text, (secret, text)
        return text

    with dashboard(str(root), tmp_path) as url:
        assert "ERROR" in shows(url, "the run root is not a folder")

        root.unlink()  # now a folder, its manifest damaged: an error, as waiting will not mend it
        root.mkdir()
        (root / MANIFEST_PATH).write_bytes(b'{"schema": "deltasync.manifest/1", "run_')
        text = shows(url, "the manifest does not parse")
        summary = page.evaluate("document.querySelector('#summary')?.innerText ?? ''")
        # the first line of the state (Gradio may show its update timer, "0.1s", above it)
        lines = [x for x in summary.splitlines() if x.strip() and not re.fullmatch(r"[\d.]+s", x)]
        assert lines[0].startswith("ERROR: the manifest does not parse"), summary
        assert "WAITING" not in text and "waiting for the first version" not in text
        assert MANIFEST_PATH not in text  # the kind of problem, not the file (nor its folder)

        shutil.rmtree(root)  # a good run, one of whose heartbeats does not parse
        shutil.copytree(recorded_bucket[0], root)
        (root / "replicas" / "broken.json").write_text('{"replica_id": "broken"}')
        text = shows(url, "the heartbeat of replica broken does not parse")
        assert "OK" in text and "trainer version" in text

        shutil.rmtree(root)  # an adapter run, its base model recorded as a local folder
        shutil.copytree(adapter_bucket[0], root)
        text = shows(url, "LoRA adapter r=4, alpha 8 (base ")
        assert "trainer adapter version 5" in text and "Replicas serving the adapter" in text
        last = {}

        def relabelled():
            last.update(page.evaluate(TITLES) or {})
            return "Adapter bytes per version" in last.get("plot-payload", "") and last

        titles = _wait(relabelled, 30, "the plots' adapter titles", lambda: last)
        assert "adapter version" in titles["plot-payload"]  # the x axis
        assert "Held vs trainer adapter version" in titles["plot-versions"]
        assert "Reward per step" in titles["plot-reward"]  # not about versions: as for weights
        text = page.evaluate("document.body.innerText")
        assert "Held adapter version" in text and "held_adapter_version" not in text
        _assert_headers_read_whole(page, adapter=True)
        _assert_titles_fit(page, adapter=True)


def test_another_tasks_own_figures_are_on_the_page(tmp_path, number_guess_bucket, page):
    """A run of the number-guess example task: the summary names each evaluation's headline
    figures under the task's labels ("solved", "follows the feedback"), the learning curve draws
    them, for the evaluations and the training steps, and nothing of Wordle's is shown."""
    uri, metrics = number_guess_bucket
    with dashboard(uri, tmp_path) as url:
        page.call("Page.navigate", url=url)
        last = {}

        def probe():
            last.update(page.evaluate(PROBE) or {})
            legend = set(last.get("plots", {}).get("plot-curve", {}).get("legend", []))
            return "eval after" in last.get("summary", "") and len(legend) >= 5

        _wait(probe, 60, "the number-guess run's evaluations and learning curve", lambda: last)
        for e in metrics.evals:
            solved, follows = e.figures["solved_rate"], e.figures["consistent_rate"]
            assert (
                f"eval {e.label} (step {e.step}, {e.episodes} games): reward {e.reward_mean:.3f} "
                f"± {e.reward_se:.3f} (SE), solved {100 * solved:.0f}%, follows the feedback "
                f"{100 * follows:.0f}%"
            ) in last["summary"]
        legend = set(last["plots"]["plot-curve"]["legend"])
        assert legend == {
            "reward",
            "solved",
            "follows the feedback",
            "solved (train)",
            "follows the feedback (train)",
        }
        text = page.evaluate("document.body.innerText")
        assert "win rate" not in text and "consistent" not in " ".join(legend)
        _assert_titles_fit(page, adapter=False)
