"""One definition of a run's step time and samples/s, named on every surface: the run
resource and the runs list (the API), the runs list page, the run page's tiles, the compare
page and its API, and the demo's summary show the same number, over the same window.

A run whose steps got 3x slower at step 60 of 100: the newest 20 steps and the newest 100
give different medians, and the surfaces disagreed (the compare page and the demo summary
read the newest 100, the runs list and the run page the newest 20)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from fastapi.testclient import TestClient
from markupsafe import escape
from zerowatch.dashboards import theme as th
from zerowatch.server import store
from zerowatch.server.app import create_app
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate as sim


def _stored_run(tmp_path: Any, spec: sim.SimSpec) -> tuple[Any, str]:
    """An app on a new SQLite database holding 100 steps of the simulated run `spec`."""
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", stalled_after_s=3600))
    rc = sim.run_create(spec)
    store.create_run(app.state.db, run=rc)
    events = [e for step in sim.steps(spec, 100) for e in step]
    store.ingest_batch(app.state.db, run_id=rc.run_id,
                       batch=ev.EventBatch(run_id=rc.run_id, events=events))  # fmt: skip
    return app, rc.run_id


def test_step_time_is_one_figure_on_every_surface_and_says_what_it_is(tmp_path):
    from zerowatch.demo import _summary_table

    spec = sim.SimSpec(name="slower", stage=2, world_size=4, step_time_s=0.1,
                       regress_at=60, regress_factor=3.0)  # fmt: skip
    app, rid = _stored_run(tmp_path, spec)
    with TestClient(app) as c:
        api = c.get(f"/api/v1/runs/{rid}").json()
        listed = c.get("/api/v1/runs").json()["runs"][0]
        compared = c.get("/api/v1/compare", params={"runs": rid}).json()
        step = api["step_time_s"]
        assert step is not None and step > 0.2  # the newest steps: after the slowdown
        assert listed["step_time_s"] == step
        assert compared["runs"][0]["step_time_s"] == step
        assert listed["samples_per_s"] == api["samples_per_s"]
        assert compared["runs"][0]["samples_per_s"] == api["samples_per_s"]
        assert compared["runs"][0]["window"] == [80, 99]  # the server's recent_steps, 20

        shown = th.fmt_seconds(step)
        label = str(escape(th.recent_label(20)))  # as the pages write it
        runs_page = c.get("/").text
        assert shown in runs_page and f'title="{label}"' in runs_page
        run_page = c.get(f"/runs/{rid}").text
        tile = re.search(r'id="stat-step-time">([^<]*)<', run_page)
        assert tile is not None and tile.group(1) == shown and label in run_page
        # The exposed share over the same steps, the median rank (the API's recent figures).
        rec = api["recent"]
        exposed = re.search(r'id="stat-exposed">([^<]*)<', run_page)
        assert exposed is not None
        assert exposed.group(1) == f"{rec['exposed_comm_s'] / rec['step_time_s']:.0%}"
        compare_page = c.get("/compare", params={"runs": rid}).text
        assert shown in compare_page and f'title="{label}"' in compare_page

        table = _summary_table(compared, [dataclasses.make_dataclass(
            "StageRun", ["stage", "run_id"])(2, rid)])  # fmt: skip
        cells = [str(cell) for col in table.columns for cell in col._cells]
        assert f"{step * 1000:.1f} ms" in cells
        assert "newest 20 steps" in str(table.caption)


def test_the_straggler_tile_names_a_rank_only_where_the_doctor_would(tmp_path):
    """A rank 10% slower than the median is no straggler to the doctor (its line: 20%):
    the tile said "rank 1 (+10%)" beside findings that named none."""
    app = create_app(Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", stalled_after_s=3600))
    ids = {}
    for factor in (1.1, 1.5):
        spec = sim.SimSpec(name=f"x{factor}", stage=2, world_size=4, straggler_rank=1,
                           straggler_factor=factor, seed=int(factor * 10))  # fmt: skip
        rc = sim.run_create(spec)
        store.create_run(app.state.db, run=rc)
        events = [e for step in sim.steps(spec, 30) for e in step]
        store.ingest_batch(app.state.db, run_id=rc.run_id,
                           batch=ev.EventBatch(run_id=rc.run_id, events=events))  # fmt: skip
        ids[factor] = rc.run_id
    with TestClient(app) as c:
        tiles = {}
        for factor, rid in ids.items():
            page = c.get(f"/runs/{rid}").text
            tiles[factor] = re.search(r'id="stat-straggler">([^<]*)<', page).group(1)  # type: ignore[union-attr]
            kinds = {f["kind"] for f in c.get(f"/api/v1/runs/{rid}/findings").json()["findings"]}
            assert (tiles[factor] != "none") == ("straggler" in kinds), (factor, tiles, kinds)
        assert tiles[1.1] == "none" and tiles[1.5].startswith("rank 1 (+")


def _named(text: str, fig: dict) -> list[str]:
    """What follows every "<label> " in `text`: each must be `<text> (<stat>)`."""
    return [text[m.end():m.end() + len(fig["text"]) + len(fig["stat"]) + 3]
            for m in re.finditer(rf"\b{re.escape(fig['label'])} ", text)]  # fmt: skip


def test_the_findings_and_zerowatch_doctor_name_the_tiles_figures(tmp_path, monkeypatch):
    """One run on every surface: the demo summary, the runs list, the run page's tiles,
    compare, the API, the findings (API and run page) and `zerowatch doctor`. Each figure
    with a tile (step time, exposed share, straggler) is one number under one name wherever
    it is stated; the findings' own statistics (the rank that waits least, a window of
    their own) go by other names. The run got 2x slower at step 75 of 100, so the doctor's
    50-step window and the tiles' newest 20 steps have different medians."""
    from typer.testing import CliRunner

    from zerowatch import cli
    from zerowatch.demo import _summary_table

    spec = sim.SimSpec(name="one", stage=2, world_size=4, step_time_s=0.1, regress_at=75,
                       regress_factor=2.0, straggler_rank=1, straggler_factor=1.5)  # fmt: skip
    app, rid = _stored_run(tmp_path, spec)
    with TestClient(app) as c:
        api = c.get(f"/api/v1/runs/{rid}").json()
        rec = api["recent"]
        doctor = c.get(f"/api/v1/runs/{rid}/findings").json()
        figs = doctor["figures"]
        step, exposed, straggler = (figs[k] for k in ("step_time_s", "exposed_share",
                                                       "straggler"))  # fmt: skip
        # The figures are the run resource's, named as the tiles name them.
        assert step["value"] == api["step_time_s"] and step["text"] == th.fmt_seconds(step["value"])
        assert step["label"] == "step time" and step["stat"] in th.recent_label(20)
        assert exposed["value"] == rec["exposed_comm_s"] / rec["step_time_s"]
        assert straggler["rank"] == 1 and straggler["text"].startswith("rank 1 (+")

        # The tiles.
        page = c.get(f"/runs/{rid}").text
        tiles = {k: re.search(rf'id="stat-{k}">([^<]*)<', page).group(1)  # type: ignore[union-attr]
                 for k in ("step-time", "exposed", "straggler")}  # fmt: skip
        assert tiles == {"step-time": step["text"], "exposed": exposed["text"],
                         "straggler": straggler["text"]}  # fmt: skip
        for fig in (step, exposed, straggler):  # each tile's hint names its statistic
            assert str(escape(fig["stat"])) in page
        # The rank heatmap names the same straggler with the same number, on the page and
        # when a live page redraws it.
        excess = straggler["text"].removeprefix("rank 1 (").removesuffix(")")
        heat = f"straggler: rank 1 ({excess} vs median rank)"
        assert re.findall(r"straggler: rank \d+ \([^)]*\)", page) == [heat]
        live = c.get(f"/runs/{rid}/figures.json", params={"since": -1}).json()
        assert (
            heat in json.dumps(live["figures"])
            and live["summary"]["straggler"] == straggler["text"]
        )
        # The runs list, compare and the demo's summary: the same step time.
        assert c.get("/api/v1/runs").json()["runs"][0]["step_time_s"] == step["value"]
        assert step["text"] in c.get("/").text
        compared = c.get("/api/v1/compare", params={"runs": rid}).json()
        assert compared["runs"][0]["step_time_s"] == step["value"]
        assert step["text"] in c.get("/compare", params={"runs": rid}).text
        table = _summary_table(compared, [dataclasses.make_dataclass(
            "StageRun", ["stage", "run_id"])(2, rid)])  # fmt: skip
        assert f"{step['value'] * 1000:.1f} ms" in [str(x) for col in table.columns
                                                   for x in col._cells]  # fmt: skip

        # The findings: wherever a message says "step time", "exposed share" or
        # "straggler", it is the figure, with its name.
        messages = [f["message"] for f in doctor["findings"]]
        kinds = {f["kind"] for f in doctor["findings"]}
        assert {"straggler", "stage_choice"} <= kinds, kinds
        said = " ".join(messages)
        for fig in (step, exposed, straggler):
            assert set(_named(said, fig)) <= {f"{fig['text']} ({fig['stat']})"}, fig["label"]
        assert f"{straggler['label']} {straggler['text']} ({straggler['stat']})" in said
        assert f"now {step['text']} a step" in said  # stage_choice's "now" is the tile's
        for f in doctor["findings"]:  # the run page shows the same messages
            assert str(escape(f["message"])) in page

        def get(server: str, path: str, **params: str):
            return c.get(path, params=params or None).json()

        monkeypatch.setattr(cli, "_get", get)
        out = CliRunner().invoke(cli.app, ["doctor", rid], env={"COLUMNS": "400"}).output
    said = "\n".join(line for line in out.splitlines() if not line.startswith("["))  # kinds
    for fig in (step, exposed, straggler):
        assert f"{fig['label']} {fig['text']} ({fig['stat']})" in said, out
        assert set(_named(said, fig)) <= {f"{fig['text']} ({fig['stat']})"}, (fig["label"], out)
    for message in messages:
        assert message in out
