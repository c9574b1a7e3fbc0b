"""The pages over HTTP (no browser): what each route answers, bad input never a 500, the
live endpoint's contract, assets from the installed plotly, and the read-token rule."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import plotly
import pytest
from fastapi.testclient import TestClient
from zerowatch.dashboards.html import script_json
from zerowatch.server import store
from zerowatch.server.app import create_app
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate as sim


@pytest.fixture(scope="module")
def client(tmp_path_factory):  # type: ignore[no-untyped-def]
    db = tmp_path_factory.mktemp("pages") / "z.db"
    app = create_app(Settings(db_url=f"sqlite:///{db}", stalled_after_s=3600))
    ids = {}
    for stage in (1, 3):
        spec = sim.SimSpec(name=f"run {stage}", stage=stage, world_size=2, seed=stage)
        rc = sim.run_create(spec)
        store.create_run(app.state.db, run=rc)
        events = [e for step in sim.steps(spec, 12) for e in step]
        store.ingest_batch(app.state.db, run_id=rc.run_id,
                           batch=ev.EventBatch(run_id=rc.run_id, events=events))  # fmt: skip
        ids[stage] = rc.run_id
    empty = sim.run_create(sim.SimSpec(name="no steps yet"))
    store.create_run(app.state.db, run=empty)
    ids[0] = empty.run_id
    with TestClient(app) as c:
        c.ids = ids  # type: ignore[attr-defined]
        yield c


def test_script_json_cannot_close_the_script_element():
    text = script_json({"name": "</script><script>alert(1)</script>", "x": [float("nan")]})
    assert "<" not in text and ">" not in text
    assert '"x":[null]' in text


def test_figures_reach_the_page_with_five_significant_digits():
    import plotly.graph_objects as go
    from zerowatch.dashboards.html import figure_dict

    fig = go.Figure([go.Scatter(x=[0, 7, 1_000_003], y=[1 / 3, None, 123456.789]),
                     go.Heatmap(z=[[2 / 3, None], [1e-7 / 3, 5.0]]),
                     go.Bar(x=["a"], y=[1.23456789], error_y={"array": [0.1234567]})])  # fmt: skip
    scatter, heat, bar = figure_dict(fig)["data"]
    assert scatter["x"] == [0, 7, 1_000_003]  # whole numbers (steps) stay whole
    assert scatter["y"] == [0.33333, None, 123460.0]
    assert heat["z"] == [[0.66667, None], [3.3333e-08, 5.0]]
    assert bar["y"] == [1.2346] and bar["error_y"]["array"] == [0.12346]


@pytest.mark.parametrize(
    "url",
    [
        "/?status=bogus", "/?project=", "/?tag=%00", "/?project=" + "p" * 300,
        "/runs/%20", "/runs/" + "x" * 500, "/runs/nope/figures.json?since=-5",
        "/runs/nope/figures.json?since=abc", "/compare?runs=,,,", "/compare?runs=a&runs=b,c",
        "/compare?runs=" + ",".join(str(i) for i in range(50)),
        "/plan?params=1e400", "/plan?params=-5", "/plan?gpus=0", "/plan?gpus=abc",
        "/plan?nodes=3&gpus=8", "/plan?gpu_memory=80", "/plan?bandwidth=fast",
        "/plan?precision=fp8", "/plan?offload=nvme", "/plan?params=7B&gpus=99999999999999999999",
    ],
)  # fmt: skip
def test_bad_input_is_answered_without_a_server_error(client, url):
    resp = client.get(url)
    assert resp.status_code < 500, resp.text[:500]


def test_plan_errors_name_the_field(client):
    for url, field in [("/plan?params=lots", "params"), ("/plan?gpus=abc", "gpus"),
                       ("/plan?gpu_memory=80", "gpu_memory"), ("/plan?offload=nvme", "offload"),
                       ("/plan?nodes=3&gpus=8", "nodes")]:  # fmt: skip
        resp = client.get(url)
        assert resp.status_code == 422, url
        error = re.search(r'id="plan-error">([^<]*)<', resp.text)
        assert error and error.group(1).startswith(field), (url, error)


def test_live_endpoint_sends_figures_only_when_new_steps_arrived(client):
    run_id = client.ids[1]
    fresh = client.get(f"/runs/{run_id}/figures.json").json()
    assert fresh["changed"] and fresh["last_step"] == 11 and fresh["status"] == "running"
    assert {"breakdown", "collectives", "memory", "training", "ranks"} <= set(fresh["figures"])
    assert all(set(f) == {"data", "layout"} for f in fresh["figures"].values())
    assert fresh["summary"]["steps"] == "12"
    same = client.get(f"/runs/{run_id}/figures.json?since=11").json()
    assert not same["changed"] and same["figures"] == {}
    assert (same["last_step"], same["status"]) == (11, "running")
    assert set(same["summary"]) == {"last-seen"}  # the rest is unchanged: not recomputed
    older = client.get(f"/runs/{run_id}/figures.json?since=10").json()
    assert older["changed"] and older["summary"]["steps"] == "12" and older["figures"]
    assert client.get("/runs/nope/figures.json").status_code == 404


def test_run_without_steps_shows_a_waiting_page(client):
    resp = client.get(f"/runs/{client.ids[0]}")
    assert resp.status_code == 200
    assert "No steps stored yet" in resp.text
    assert "plotly.min.js" not in resp.text


def test_compare_accepts_commas_and_repeats_and_names_missing_runs(client):
    a, b = client.ids[1], client.ids[3]
    resp = client.get(f"/compare?runs={a},missing-run&runs={b}")
    assert resp.status_code == 200
    assert resp.text.count('<tr data-run-id="') == 2
    assert "missing-run" in resp.text


def _js_version(text: bytes) -> str:
    """The version in a plotly.js bundle's header comment ("* plotly.js ... v4.1.1")."""
    head = text[:400].decode()
    return head.split(" v", 1)[1].split()[0]


def test_plotly_js_is_the_cartesian_bundle_of_the_installed_plotlys_version(client):
    resp = client.get("/static/plotly.min.js")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/javascript")
    assert "immutable" in resp.headers["cache-control"]
    # The figures are built by the plotly package for the plotly.js it embeds: the bundle
    # served must be that version (update server/static/plotly-cartesian.min.js with it).
    embedded = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    assert b"plotly.js (cartesian - minified)" in resp.content[:200]
    assert _js_version(resp.content) == _js_version(embedded)
    assert len(resp.content) < len(embedded) / 3
    assert client.get("/favicon.ico").headers["content-type"] == "image/x-icon"
    assert client.get("/static/zerowatch.css").status_code == 200


def test_pages_follow_the_read_token_rule(tmp_path):
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", token="sekret",
                        read_requires_token=True)  # fmt: skip
    with TestClient(create_app(settings)) as c:
        assert c.get("/").status_code == 401
        assert c.get("/plan").status_code == 401
        assert c.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert c.get("/", headers={"Authorization": "Bearer sekret"}).status_code == 200
    open_reads = dataclasses.replace(settings, read_requires_token=False)
    with TestClient(create_app(open_reads)) as c:
        assert c.get("/").status_code == 200


@pytest.mark.parametrize("params", [
    {"params": "70e9", "gpus": "8", "gpu_memory": "80GiB", "bandwidth": "100GB/s"},
    {"params": "7B", "gpus": "4", "gpu_memory": "24GB", "offload": "none"},
    {"params": "350M", "gpus": "64", "nodes": "8", "gpu_memory": "16GiB", "precision": "fp16"},
])  # fmt: skip
def test_plan_page_prints_the_figures_zerowatch_plan_prints(client, params):
    """The same plan through `zerowatch plan` and /plan: every option's device bytes, bytes
    sent and comm time are the same strings (one formatter, binary bytes)."""
    from typer.testing import CliRunner

    from zerowatch.cli import app as cli

    args = [a for k, v in params.items() for a in (f"--{k.replace('_', '-')}", v)]
    out = CliRunner().invoke(cli, ["plan", *args])
    assert out.exit_code == 0, out.output
    lines = [ln for ln in out.output.splitlines() if re.match(r"\s+\d \s", ln)]
    page = client.get("/plan", params=params)
    assert page.status_code == 200
    body = page.text.split('id="plan-table"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr class=\"(?:fits|nofit)\">(.*?)</tr>", body, re.S)
    assert rows and len(rows) == len(lines)
    for line, row in zip(lines, rows, strict=True):
        cells = [c.strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        device, sent = cells[1], cells[3]
        assert "iB" in device  # binary units on both sides
        cli_cells = re.split(r"\s{2,}", line.strip())
        assert device in cli_cells, (device, line)
        assert (sent if sent != "0 B" else "-") in cli_cells, (sent, line)
        if "bandwidth" in params:
            assert cells[4] in cli_cells, (cells[4], line)


def test_steps_without_figures_are_gaps_in_the_lines_and_said_on_the_page(tmp_path):
    """Steps of a run that have no figures (still being rolled up after an upload, or never
    stored) were drawn as a straight line across, and nothing said so."""
    from sqlalchemy import delete
    from zerowatch.server import models as m

    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", stalled_after_s=3600))
    spec = sim.SimSpec(name="holes", stage=1, world_size=2, seed=4)
    rc = sim.run_create(spec)
    store.create_run(app.state.db, run=rc)
    events = [e for step in sim.steps(spec, 30) for e in step]
    store.ingest_batch(app.state.db, run_id=rc.run_id,
                       batch=ev.EventBatch(run_id=rc.run_id, events=events))  # fmt: skip
    with app.state.db.write() as conn:
        for table in (m.steps, m.step_rollups, m.dirty_steps):
            conn.execute(delete(table).where(table.c.step.between(10, 19)))
    with TestClient(app) as c:
        page = c.get(f"/runs/{rc.run_id}").text
        assert "10 of the drawn steps (10–19) have no figures yet" in page
        figs = c.get(f"/runs/{rc.run_id}/figures.json").json()["figures"]
        (line,) = [t for fig in figs.values() for t in fig["data"]
                   if t.get("name") == "step time"]  # fmt: skip
        at = dict(zip(line["x"], line["y"], strict=True))
        assert all(at[s] is None for s in range(10, 20)) and at[9] is not None
