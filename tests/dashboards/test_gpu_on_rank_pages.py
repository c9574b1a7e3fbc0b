"""The rank view and the node view say when a rank's GPU was throttled or erroring (the
agent's NVML telemetry, simulated): a 16-rank run whose straggler's GPU hits its power
cap in half the steps and one other rank whose GPU starts reporting XID and ECC errors."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from zerowatch.dashboards import rank as rank_figs
from zerowatch.server import rank_pages, store
from zerowatch.server.app import create_app
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate as sim

WORLD, STEPS, SLOW, BROKEN = 16, 12, 13, 9  # both on sim-node-0001


@pytest.fixture(scope="module")
def client(tmp_path_factory):  # type: ignore[no-untyped-def]
    db = tmp_path_factory.mktemp("gpu") / "z.db"
    app = create_app(Settings(db_url=f"sqlite:///{db}", stalled_after_s=3600))
    spec = sim.SimSpec(name="hot", stage=3, world_size=WORLD, straggler_rank=SLOW,
                       gpu_throttled_rank=SLOW, gpu_throttled_share=0.5,
                       gpu_error_rank=BROKEN, gpu_errors_at=8, seed=3)  # fmt: skip
    rc = sim.run_create(spec)
    store.create_run(app.state.db, run=rc)
    events = [e for step in sim.steps(spec, STEPS) for e in step]
    store.ingest_batch(app.state.db, run_id=rc.run_id,
                       batch=ev.EventBatch(run_id=rc.run_id, events=events))  # fmt: skip
    with TestClient(app) as c:
        c.run_id = rc.run_id  # type: ignore[attr-defined]
        yield c


def test_rank_view_of_a_throttled_rank_carries_its_gpu_health_and_clock(client):
    db = client.app.state.db
    view = rank_pages.rank_view(db=db, run_id=client.run_id, rank=SLOW)
    assert view is not None and view.gpu is not None
    assert view.gpu["throttled_share"] == pytest.approx(0.5)
    assert view.gpu["reasons"] == {"sw_power_cap": pytest.approx(0.5)}
    assert sorted(set(view.gpu_clock.values)) == [0.75, 1.0]
    assert set(view.gpu_clock_median.values) == {1.0}
    assert [
        s for s, v in zip(view.gpu_throttled.steps, view.gpu_throttled.values, strict=True) if v
    ] == [1, 3, 5, 7, 9, 11]
    assert "gpu" in rank_figs.rank_figures(view)
    assert rank_figs.gpu_text(view.gpu) == (
        "throttled (power cap) in 50% of steps, SM clock at 88% of max"
    )
    healthy = rank_pages.rank_view(db=db, run_id=client.run_id, rank=0)
    assert healthy is not None and rank_figs.gpu_text(healthy.gpu).startswith("healthy")


def test_rank_page_says_its_gpu_was_throttled(client):
    text = client.get(f"/runs/{client.run_id}/ranks/{SLOW}").text
    assert 'id="stat-gpu">throttled (power cap) in 50% of steps' in text
    assert 'id="chart-gpu"' in text


def test_node_page_names_the_throttled_and_the_erroring_gpu(client):
    text = client.get(f"/runs/{client.run_id}/hosts/sim-node-0001").text
    rows = {int(r.split('"')[0]): r for r in text.split('<tr data-rank="')[1:]}
    assert "throttled (power cap) in 50% of steps" in rows[SLOW]
    assert "4 XID / 4 ECC errors" in rows[BROKEN]  # steps 8-11
    assert "healthy" in rows[8]


def test_without_gpu_telemetry_the_pages_show_no_gpu_chart():
    assert rank_figs.gpu_text(None) == "–"
