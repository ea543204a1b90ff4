"""The dashboard's Gradio app (``dashboard.ui``) served in-process on 127.0.0.1 and
driven through ``gradio_client``: ``/status`` and ``/refresh`` return what the data layer computes
for a recorded bucket, and a bucket it cannot read comes back as a message, not an error. Also the
configuration checks (``DashboardConfig``, ``BUCKET`` from the environment) and the CLI."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from dashboard.data import BucketReader

# pandas 3 deprecations raised inside gradio's own code (not ours)
pytestmark = pytest.mark.filterwarnings("ignore::pandas.errors.Pandas4Warning")
gr = pytest.importorskip("gradio", reason="the dashboard extra (gradio) is not installed")
gradio_client = pytest.importorskip("gradio_client", reason="gradio_client (dev extra) missing")

from dashboard.frames import CURVE_SERIES, TRAIN_CONSISTENT  # noqa: E402
from dashboard.ui import FIXED_COLORS, PLOTS, DashboardConfig, build_app, plot_update  # noqa: E402


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(uri: str):
    config = DashboardConfig(bucket=uri, refresh_s=1.0, port=_free_port())
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
        assert table["headers"][:3] == ["replica", "health", "status"]
        assert [r[0] for r in table["data"]] == want.replica.tolist()
        names = ["versions", "lag", "lag", "payloads", "density", "syncs", "sync_phases"]
        names += ["reward", "curve", "lag", "training", "staleness"]
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
        assert {k for k in curve["color_map"] if k != "~gen"} == {*CURVE_SERIES, TRAIN_CONSISTENT}
        assert all(curve["color_map"][k] == FIXED_COLORS[k] for k in CURVE_SERIES)
        assert "label" in next(s for s in PLOTS if s.frame == "curve").tooltip
        assert "consistent" in summary
    finally:
        demo.close()


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


def test_config_from_flags_and_space_variables():
    from dashboard.config import parse_config

    with pytest.raises(SystemExit) as e:
        parse_config([], env={})
    assert e.value.code == 2
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
