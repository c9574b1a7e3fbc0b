"""The run page of wide runs in a real headless Chromium: simulated stage-3 runs of 64, 1,024
and 4,096 ranks with one slow rank, stored through the store and rolled up by the server's
compactor. Every chart draws data with no console error (the spread over ranks of busy,
step and exposed time, of each phase and of the collectives; memory over ranks as a sorted
line), the table of ranks that stand out
names the injected straggler first (with its node), the heatmap shows at most ~256 rows,
and a click on the straggler's heatmap row (its block of ranks on a wide run) reaches the
straggler's own rank view. Screenshots of the
4,096-rank run page and rank view are kept (artifacts/screenshots)."""

from __future__ import annotations

from pathlib import Path

import pytest
from charts import assert_all_drawn, charts
from support.screenshots import screenshot
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read.rollups import RollupWorker as Compactor

from zerowatch import events as ev
from zerowatch import simulate as sim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 8
RUN_CHARTS = {"breakdown", "spread", "phases", "collectives", "bandwidth", "memory", "training",
              "ranks", "waterfall"}  # fmt: skip


def _store(db_url: str, world: int, straggler: int) -> tuple[str, sim.SimSpec]:
    db = Database.open(db_url)
    try:
        spec = sim.SimSpec(name=f"wide {world}", world_size=world, stage=3, spans_every=0,
                           straggler_rank=straggler, straggler_factor=1.5, seed=world)  # fmt: skip
        rc = sim.run_create(spec)
        store.create_run(db, run=rc)
        for events in sim.steps(spec, STEPS):
            store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
        Compactor(db, max_steps=STEPS).flush()
        return rc.run_id, spec
    finally:
        db.close()


@pytest.mark.parametrize(("world", "straggler"), [(64, 37), (1024, 777), (4096, 3001)])
def test_a_wide_run_page_names_its_straggler_and_leads_to_its_rank(world, straggler, probe,
                                                                 tmp_path: Path):  # fmt: skip
    from support.live_server import LiveServer

    db_url = f"sqlite:///{tmp_path / 'wide.db'}"
    run_id, spec = _store(db_url, world, straggler)
    with LiveServer(db_url=db_url, settings={"stalled_after_s": 10**7}) as server:
        page = probe.page
        page.goto(f"{server.url}/runs/{run_id}")
        got = assert_all_drawn(page, RUN_CHARTS)
        assert len(got["ranks"]["points"]) == 1 and got["ranks"]["points"][0] <= 256 * STEPS
        # Memory over ranks: a sorted line of at most the 32 named ranks and 3 quantiles,
        # never a bar per rank; bands for every phase of a stage-3 step.
        assert got["memory"]["points"][0] <= min(world, 2 * 16 + 3)
        assert got["phases"]["traces"] >= 5 * 5
        first = page.locator("#outliers tbody tr").first
        assert first.get_attribute("data-rank") == str(straggler)
        assert sim.host_of(spec, straggler) in first.inner_text()
        if world == 4096:
            screenshot(page, "run-4096-ranks")
        # The straggler's heatmap row (its block of ranks on a wide run) opens a rank view.
        rows = page.evaluate("() => document.getElementById('chart-ranks').data[0].y")
        row = next(y for y in rows if _holds(y, straggler))
        with page.expect_navigation():
            page.evaluate(
                "(y) => { const d = document.getElementById('chart-ranks');"
                " d.emit('plotly_click', {points: [{y: y, data: d.data[0]}]}); }",
                row,
            )
        # A block's row leads to its slowest rank: the straggler itself, not the block's first.
        assert page.url.endswith(f"/runs/{run_id}/ranks/{straggler}")
        assert_all_drawn(page)
        if world == 4096:
            screenshot(page, "rank-view-4096-ranks")
        assert charts(page)
    assert probe.errors == [] and probe.dialogs == []


def _holds(label: str, rank: int) -> bool:
    """Whether a heatmap row label ("rank 7" or "ranks 16-31") covers `rank`."""
    span = label.split()[1]
    lo, _, hi = span.partition("-")
    return int(lo) <= rank <= int(hi or lo)
