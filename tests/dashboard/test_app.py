"""The dashboard's Gradio app (``dashboard.ui``) served in-process on 127.0.0.1 and
driven through ``gradio_client``: ``/status`` and ``/refresh`` return what the data layer computes
for a recorded bucket, and a bucket it cannot read comes back as a message, not an error. An
adapter run's page and API name the adapter and say "adapter version" without showing the base
model's local path; a full-weight run's page keeps its labels as built. Also the configuration
checks (``DashboardConfig``, ``BUCKET`` from the environment) and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dashboard.data import BucketReader
from trainer.local.ports import free_port

# pandas 3 deprecations raised inside gradio's own code (not ours)
pytestmark = pytest.mark.filterwarnings("ignore::pandas.errors.Pandas4Warning")
gr = pytest.importorskip("gradio", reason="the dashboard extra (gradio) is not installed")
gradio_client = pytest.importorskip("gradio_client", reason="gradio_client (dev extra) missing")

from dashboard.frames import COLUMNS, REWARD_SERIES, TRAIN_SUFFIX  # noqa: E402
from dashboard.ui import (  # noqa: E402
    ADAPTER_LABELS,
    FIXED_COLORS,
    PLOTS,
    STATUS_HEADERS,
    DashboardConfig,
    build_app,
    plot_labels,
    plot_update,
    status_headers,
    status_table,
)


def _serve(uri: str):
    config = DashboardConfig(bucket=uri, refresh_s=1.0, port=free_port())
    demo = build_app(config)
    demo.launch(
        server_name="127.0.0.1", server_port=config.port, prevent_thread_lock=True, quiet=True
    )
    return demo, f"http://127.0.0.1:{config.port}/"


def test_api_matches_the_data_layer(recorded_bucket):
    uri, _ = recorded_bucket
    expected = BucketReader(uri).read()
    demo, url = _serve(uri)
    try:
        client = gradio_client.Client(url, verbose=False)
        status = client.predict(api_name="/status")
        assert status["state"] == "ok" and "uri" not in status
        assert status["trainer_version"] == expected.trainer_version
        want = expected.frame("status")
        got = {r["replica"]: r for r in status["replicas"]}
        assert set(got) == set(want.replica)
        for row in want.itertuples():
            assert got[row.replica]["held_version"] == row.held_version
            assert got[row.replica]["lag_versions"] == row.lag_versions
            assert got[row.replica]["health"] == row.health

        summary, table, *plots = client.predict(api_name="/refresh")
        assert f"trainer version **{expected.trainer_version}**" in summary
        # the page's headers are words (the API above keeps the frame's column names)
        assert table["headers"] == list(STATUS_HEADERS.values())
        assert table["headers"][:4] == ["Replica", "Health", "Status", "Held version"]
        assert [r[0] for r in table["data"]] == want.replica.tolist()
        names = ["versions", "lag", "lag", "payloads", "density", "syncs", "sync_phases"]
        names += ["reward", "curve", "training", "staleness"]
        assert len(plots) == len(names)
        for name, plot in zip(names, plots, strict=True):
            value = plot["value"] if plot.get("__type__") == "update" else plot
            assert value["columns"] == list(expected.frame(name).columns), name
            assert len(value["data"]) == len(expected.frame(name)), name
        # each plot's color map names exactly its categories (so new ones are drawn), and a
        # replica has the same color everywhere
        colors = [{k: v for k, v in p["color_map"].items() if k != "~gen"} for p in plots[:4]]
        assert set(colors[0]) == {"trainer", "r0", "r1"}
        assert colors[1] == {k: v for k, v in colors[0].items() if k != "trainer"}
        assert set(colors[3]) == {"anchor", "delta"}
        # the learning curve: its series in their fixed colors, the label in each tooltip
        curve = plots[names.index("curve")]
        training = expected.frame("training")
        valid = "valid_rate" in training and training.valid_rate.notna().any()  # counted moves
        evals = {REWARD_SERIES, "win rate", "consistent", "valid"}  # Wordle's headline figures
        want = (
            evals | {"consistent" + TRAIN_SUFFIX} | ({"valid" + TRAIN_SUFFIX} if valid else set())
        )
        assert {k for k in curve["color_map"] if k != "~gen"} == want
        assert all(curve["color_map"][k] == FIXED_COLORS[k] for k in evals)
        assert "label" in next(s for s in PLOTS if s.frame == "curve").tooltip
        assert "consistent" in summary
        # a full-weight run's page keeps the labels it was built with
        assert "label" not in table and all("title" not in p for p in plots)
        assert status["adapter"] is None and "adapter" not in summary.lower()
    finally:
        demo.close()


def test_adapter_run_is_named_on_the_page_and_in_the_api(adapter_bucket, tmp_path):
    uri, _ = adapter_bucket
    expected = BucketReader(uri).read()
    digest = expected.adapter.base_digest
    demo, url = _serve(uri)
    try:
        client = gradio_client.Client(url, verbose=False)
        status = client.predict(api_name="/status")
        assert status["message"] == "6 adapter version(s) in the manifest"
        adapter = status["adapter"]
        assert (adapter["kind"], adapter["r"], adapter["lora_alpha"]) == ("lora", 4, 8)
        assert adapter["base_model"] is None and adapter["base_digest"] == digest
        assert adapter["summary"] == f"LoRA adapter r=4, alpha 8 (base {digest[:8]})"
        want = expected.frame("status").set_index("replica")
        got = {r["replica"]: r for r in status["replicas"]}
        assert {rid: r["held_version"] for rid, r in got.items()} == want.held_version.to_dict()
        assert {r["apply_path"] for r in got.values()} == {"lora"}

        out = client.predict(api_name="/refresh")
        for answer in (status, out):  # the base model's local folder, nor any part of it
            text = json.dumps(answer)
            assert str(tmp_path) not in text and "qwen3-base" not in text
        summary, table, *plots = out
        assert "trainer adapter version **5**" in summary
        assert f"LoRA adapter r=4, alpha 8 (base {digest[:8]})" in summary
        assert table["__type__"] == "update" and "adapter version" in table["label"]
        headers = table["value"]["headers"]
        assert headers == list(status_headers(adapter=True).values())
        adapter_headers = {
            "Held adapter version",
            "Trainer adapter version",
            "Lag (adapter versions)",
        }
        assert adapter_headers <= set(headers)
        assert "Held version" not in headers and "held_version" not in headers
        for spec, plot in zip(PLOTS, plots, strict=True):
            if spec.elem_id in ADAPTER_LABELS:  # relabelled: versions and bytes are the adapter's
                labels = plot_labels(spec, adapter=True)
                assert {k: plot[k] for k in labels} == labels, spec.elem_id
            else:  # reads the same as for weights
                assert "title" not in plot, spec.elem_id
        payload = plots[[s.elem_id for s in PLOTS].index("plot-payload")]
        assert payload["x_title"] == "adapter version"
        assert payload["title"].startswith("Adapter bytes per version")
        assert len(payload["value"]["data"]) == len(expected.frame("payloads"))
    finally:
        demo.close()


def test_plot_labels_are_sent_when_the_kind_of_run_changes():
    import pandas as pd

    spec = next(s for s in PLOTS if s.elem_id == "plot-payload")
    full, lora = plot_labels(spec, adapter=False), plot_labels(spec, adapter=True)
    assert (full["title"], full["x_title"]) == (spec.title, "version")
    assert lora["x_title"] == "adapter version" and lora["y_title"].startswith("adapter MB")
    seen = {"labels": full}  # the page as built
    df = pd.DataFrame({"version": [0, 1], "kind": ["anchor", "delta"]})
    sent = [plot_update(df, "kind", [], seen, labels) for labels in (full, lora, lora, lora, full)]
    assert ["title" in u for u in sent] == [False, True, False, False, True]
    assert sent[1]["title"] == lora["title"] and sent[4]["x_title"] == "version"
    # new labels rebuild the chart, and once more on the next refresh (as new categories do)
    assert [u["color_map"]["~gen"] for u in sent] == ["1", "2", "3", "3", "4"]
    # a plot without colors is sent as its frame until its labels change
    bare = next(s for s in PLOTS if s.color is None)
    seen = {"labels": plot_labels(bare, adapter=False)}
    assert plot_update(df, None, [], seen, plot_labels(bare, adapter=True)) is df
    assert plot_update(df, None, [], seen, {**seen["labels"], "title": "x"})["title"] == "x"


def test_unreadable_bucket_is_a_message(tmp_path):
    uri = "nosuchproto://bucket/run"
    demo, url = _serve(uri)
    try:
        client = gradio_client.Client(url, verbose=False)
        status = client.predict(api_name="/status")
        # public: a short state, never the URI or the exception text
        assert status["state"] == "error" and status["message"].startswith("bucket unreadable")
        assert uri not in status["message"] and "Error" not in status["message"]
        assert status["replicas"] == []
        summary = client.predict(api_name="/refresh")[0]
        assert "ERROR" in summary and uri not in summary
    finally:
        demo.close()


def test_config_from_flags_and_space_variables(capsys):
    from dashboard.config import parse_config

    with pytest.raises(SystemExit) as e:
        parse_config([], env={})
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error: --bucket URI is required (or set BUCKET to the run's URI" in err
    env = {"BUCKET": "hf://buckets/me/run", "REFRESH_S": "5", "GRADIO_SERVER_NAME": "0.0.0.0"}
    config = parse_config([], env=env)
    got = (config.bucket, config.refresh_s, config.host, config.port)
    assert got == ("hf://buckets/me/run", 5.0, "0.0.0.0", 7860)
    assert parse_config(["--bucket", "x", "--port", "9"], env=env).port == 9
    assert parse_config(["--bucket", "x"], env={}).host == "127.0.0.1"
    with pytest.raises(ValueError, match="refresh_s > 0"):
        DashboardConfig(bucket="x", refresh_s=0)


def test_cli_requires_a_bucket(monkeypatch):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-m", "dashboard"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--bucket URI is required" in out.stderr


def test_color_map_rebuilds_plots_exactly_when_categories_change():
    import pandas as pd

    seen: dict = {}

    def gen(kinds: list[str]) -> str:
        df = pd.DataFrame({"version": range(len(kinds)), "kind": kinds})
        return plot_update(df, "kind", [], seen)["color_map"]["~gen"]

    sent = [gen(["anchor"]), gen(["anchor"]), gen(["anchor"]), gen(["anchor", "delta"])]
    sent += [gen(["anchor", "delta", "delta"]), gen(["anchor", "delta", "delta", "delta"])]
    # a new category rebuilds at once and once more on the next refresh, then never again
    assert sent == ["1", "2", "2", "3", "4", "4"]


def test_status_headers_are_words_with_units():
    for adapter in (False, True):
        headers = status_headers(adapter)
        assert list(headers) == COLUMNS["status"]  # one header for each column, in its order
        shown = list(headers.values())
        assert len(set(shown)) == len(shown)
        for h in shown:  # words a person reads: no field names, no word longer than a column
            assert "_" not in h and h[0].isupper() and max(map(len, h.split())) <= 10, h
    assert STATUS_HEADERS["lag_s"] == "Lag (s)" and STATUS_HEADERS["heartbeat_age_s"].endswith(
        "(s)"
    )
    assert status_headers(adapter=True)["held_version"] == "Held adapter version"


def test_status_table_shows_headers_whole_numbers_and_flags(recorded_bucket):
    import pandas as pd

    view = BucketReader(recorded_bucket[0]).read()
    df = view.frame("status").copy()
    df.loc[0, "health"] = "STALLED"
    df.loc[0, ["served", "served_per_s"]] = [12.0, 0.25]
    styled = status_table(df, adapter=False)
    assert list(styled.data.columns) == list(STATUS_HEADERS.values())
    assert "background-color: #fde2e1" in styled.to_html()  # the flagged row
    header, first, _ = styled.to_string(delimiter="|").splitlines()
    row = dict(zip(header.split("|")[1:], first.split("|")[1:], strict=True))
    assert row["Held version"] == str(view.trainer_version) and row["Served"] == "12"
    assert row["Served per s"] == "0.2" and row["Lag (s)"] == "0.0"  # to 0.1
    empty = status_table(view.frame("status").iloc[:0], adapter=True)
    assert isinstance(empty, pd.DataFrame) and "Held adapter version" in empty.columns
