"""The rank view and the node view (server/rank_pages.py, dashboards/rank.py, their routes):
one rank or one node of a simulated 64-rank run with a straggler, next to the run's median."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
from fastapi.testclient import TestClient
from zerowatch.dashboards import rank as rank_figs
from zerowatch.dashboards.data import Series
from zerowatch.server import rank_pages, store
from zerowatch.server.app import create_app
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate as sim

WORLD, STEPS, STRAGGLER = 64, 12, 13  # rank 13 is local rank 5 of sim-node-0001
XSS = "<script>alert(1)</script>"


def _store(db, spec: sim.SimSpec, *, host: str | None = None) -> tuple[str, list[ev.StepEvent]]:  # type: ignore[no-untyped-def]
    rc = sim.run_create(spec)
    store.create_run(db, run=rc)
    events = [e for step in sim.steps(spec, STEPS) for e in step]
    if host is not None:
        events = [dataclasses.replace(e, host=host) for e in events]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(run_id=rc.run_id, events=events))
    return rc.run_id, events


@pytest.fixture(scope="module")
def client(tmp_path_factory):  # type: ignore[no-untyped-def]
    db = tmp_path_factory.mktemp("ranks") / "z.db"
    app = create_app(Settings(db_url=f"sqlite:///{db}", stalled_after_s=3600))
    spec = sim.SimSpec(name="wide", stage=3, world_size=WORLD, straggler_rank=STRAGGLER, seed=3)
    run_id, events = _store(app.state.db, spec)
    xss_spec = sim.SimSpec(name=XSS, stage=1, world_size=2, seed=4)
    xss_id, _ = _store(app.state.db, xss_spec, host=XSS)
    with TestClient(app) as c:
        c.ids = {"wide": run_id, "xss": xss_id}  # type: ignore[attr-defined]
        c.events = events  # type: ignore[attr-defined]
        yield c


def _db(client):  # type: ignore[no-untyped-def]
    return client.app.state.db


# -- queries ------------------------------------------------------------------------------------


def test_rank_view_of_the_straggler_shows_its_busy_time_above_the_median(client):
    view = rank_pages.rank_view(db=_db(client), run_id=client.ids["wide"], rank=STRAGGLER)
    assert view is not None and view.host == "sim-node-0001" and view.local_rank == 5
    assert view.steps == list(range(STEPS))
    e5 = next(e for e in client.events if e.step == 5 and e.rank == STRAGGLER)
    assert view.busy.values[5] == pytest.approx(e5.step_time_s - e5.exposed_comm_s)
    at5 = [e for e in client.events if e.step == 5]
    assert view.step_time_median.values[5] == pytest.approx(
        statistics.median(e.step_time_s for e in at5)
    )
    assert view.busy_ratio is not None and view.busy_ratio > 1.2  # straggler_factor 1.3
    # The rank's parts add up to its mean step; the run's to the mean rank's mean step.
    mine = [e for e in client.events if e.rank == STRAGGLER]
    assert sum(view.parts.values()) == pytest.approx(statistics.mean(e.step_time_s for e in mine))
    assert sum(view.parts_run.values()) == pytest.approx(
        statistics.mean(e.step_time_s for e in client.events)
    )
    ag = [c for c in e5.collectives if c.op == "all_gather"]
    assert view.latency["all_gather"].values[5] == pytest.approx(
        sum(c.latency_sum_s for c in ag) / sum(c.count for c in ag)
    )
    assert view.busbw_median["all_gather"] and view.latency_median["all_gather"]
    assert view.memory_step == STEPS - 1 and view.peaks and view.peaks_median
    assert set(view.model_state) == set(view.model_state_median)
    assert view.loss and view.loss_median and view.grad_norm_median


def test_rank_view_of_a_median_rank_sits_on_the_median(client):
    view = rank_pages.rank_view(db=_db(client), run_id=client.ids["wide"], rank=40)
    assert view is not None and view.busy_ratio == pytest.approx(1.0, abs=0.06)


def test_rank_view_is_none_for_an_unknown_run_or_a_rank_outside_the_world(client):
    db = _db(client)
    assert rank_pages.rank_view(db=db, run_id="nope", rank=0) is None
    assert rank_pages.rank_view(db=db, run_id=client.ids["wide"], rank=WORLD) is None
    assert rank_pages.rank_view(db=db, run_id=client.ids["wide"], rank=-1) is None


def test_host_view_lists_the_8_ranks_of_the_node_straggler_first(client):
    view = rank_pages.host_view(db=_db(client), run_id=client.ids["wide"], host="sim-node-0001")
    assert view is not None
    assert sorted(r.rank for r in view.ranks) == list(range(8, 16))
    assert view.ranks[0].rank == STRAGGLER and view.ranks[0].ratio is not None
    assert view.ranks[0].ratio > 1.2
    assert all(abs((r.ratio or 0) - 1) < 0.06 for r in view.ranks[1:])
    assert all(len(r.busy.steps) == STEPS for r in view.ranks)
    assert rank_pages.host_view(db=_db(client), run_id=client.ids["wide"], host="nope") is None


def test_rank_and_host_views_sample_a_long_run(client):
    db, rid = _db(client), client.ids["wide"]
    view = rank_pages.rank_view(db=db, run_id=rid, rank=0, max_points=4)
    assert view is not None and view.steps == [0, 4, 7, 11]
    assert view.busy_median.steps == view.steps
    host = rank_pages.host_view(db=db, run_id=rid, host="sim-node-0000", max_points=4)
    assert host is not None and all(r.busy.steps == [0, 4, 7, 11] for r in host.ranks)


# -- figures ------------------------------------------------------------------------------------


def test_rank_figures_draw_the_rank_beside_the_median(client):
    view = rank_pages.rank_view(db=_db(client), run_id=client.ids["wide"], rank=STRAGGLER)
    assert view is not None
    figs = rank_figs.rank_figures(view)
    assert list(figs) == ["steptime", "parts", "collectives", "memory", "training"]
    names = [t.name for t in figs["steptime"].data]
    assert names == [f"rank {STRAGGLER} step time", "median rank step time",
                     f"rank {STRAGGLER} busy time", "median rank busy time"]  # fmt: skip
    assert figs["parts"].data[0].x[0] > 0  # the rank's bar, in ms
    assert {t.name for t in figs["memory"].data} == {f"rank {STRAGGLER}", "median rank"}


def test_ratio_to_median_uses_only_the_steps_both_have():
    mine = Series([1, 2, 3], [2.0, None, 4.0])
    median = Series([1, 3, 4], [1.0, 2.0, 100.0])
    assert rank_figs.ratio_to_median(mine, median) == pytest.approx(2.0)
    assert rank_figs.ratio_to_median(mine, Series()) is None


def test_host_figure_labels_escape_markup():
    r = rank_figs.HostRank(rank=0, local_rank=0, busy=Series([0], [1.0]), mean_busy_s=1.0,
                           ratio=1.0)  # fmt: skip
    view = rank_figs.HostView(run={}, host=XSS, busy_median=Series([0], [1.0]), ranks=[r])
    title = rank_figs.host_figures(view)["busy"].layout.title.text
    assert "<script>" not in title and "&lt;script&gt;" in title


# -- HTTP ---------------------------------------------------------------------------------------


def test_rank_page_links_back_to_the_run_and_to_its_node(client):
    rid = client.ids["wide"]
    got = client.get(f"/runs/{rid}/ranks/{STRAGGLER}")
    assert got.status_code == 200
    text = got.text
    assert f'href="/runs/{rid}"' in text
    assert f'href="/runs/{rid}/hosts/sim-node-0001"' in text
    assert "host: sim-node-0001" in text and "local rank: 5" in text
    for chart in ("steptime", "parts", "collectives", "memory", "training"):
        assert f'id="chart-{chart}"' in text


def test_host_page_lists_its_ranks_each_linking_to_its_rank_view(client):
    rid = client.ids["wide"]
    got = client.get(f"/runs/{rid}/hosts/sim-node-0001")
    assert got.status_code == 200
    rows = got.text.split('<tr data-rank="')[1:]
    ranks = [int(r.split('"')[0]) for r in rows]
    assert len(ranks) == 8 and ranks[0] == STRAGGLER
    for rank in range(8, 16):
        assert f'href="/runs/{rid}/ranks/{rank}"' in got.text


@pytest.mark.parametrize(
    "url",
    ["/runs/nope/ranks/0", "/runs/{wide}/ranks/64", "/runs/{wide}/ranks/-1",
     "/runs/{wide}/ranks/99999999999999999999999", "/runs/nope/hosts/sim-node-0000",
     "/runs/{wide}/hosts/nope", "/runs/{wide}/hosts/%20", "/runs/{wide}/hosts/a%2Fb"],
)  # fmt: skip
def test_unknown_run_rank_or_host_is_a_404_page(client, url):
    got = client.get(url.format(wide=client.ids["wide"]))
    assert got.status_code == 404, got.text
    assert "not found" in got.text


def test_run_and_host_names_that_are_markup_stay_text(client):
    rid = client.ids["xss"]
    for url in (f"/runs/{rid}/ranks/0", f"/runs/{rid}/hosts/%3Cscript%3Ealert(1)%3C%2Fscript%3E"):
        got = client.get(url)
        assert got.status_code == 200, url
        assert XSS not in got.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in got.text
    page = client.get(f"/runs/{rid}/ranks/0").text
    assert f'href="/runs/{rid}/hosts/%3Cscript%3Ealert%281%29%3C/script%3E"' in page


def test_rank_and_host_views_read_only_their_ranks_rows(client, monkeypatch):
    """Per-rank rows are read for the rank (or the host's ranks) only; the run's median
    comes from the rollups, so the page's cost does not follow the world size."""
    asked: list[object] = []
    real = rank_pages.series.rank_rows

    def spy(conn, pk, metric, *, ranks, **kw):  # type: ignore[no-untyped-def]
        asked.append(None if ranks is None else tuple(ranks))
        return real(conn, pk, metric, ranks=ranks, **kw)

    monkeypatch.setattr(rank_pages.series, "rank_rows", spy)
    db, rid = _db(client), client.ids["wide"]
    assert rank_pages.rank_view(db=db, run_id=rid, rank=STRAGGLER) is not None
    assert asked and set(asked) == {(STRAGGLER,)}
    asked.clear()
    assert rank_pages.host_view(db=db, run_id=rid, host="sim-node-0001") is not None
    assert asked == [tuple(range(8, 16))]
