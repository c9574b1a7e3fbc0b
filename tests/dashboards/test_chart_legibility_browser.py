"""The run page's charts read cleanly in a real headless Chromium, on a 2-rank run as a new
user's first run is: no legend over a chart's title, whole ranks on the memory chart's
rank axis, and every op of the bandwidth scatter drawn where it can be seen."""

from __future__ import annotations

from pathlib import Path

import pytest
from charts import assert_all_drawn
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read.rollups import RollupWorker as Compactor

from zerowatch import events as ev
from zerowatch import simulate as sim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 12

#: Per chart div: the boxes of its title and of its legend (null where it has none).
BOXES_JS = """
(id) => {
  const div = document.getElementById(id);
  const box = (el) => { if (!el) return null; const r = el.getBoundingClientRect();
                        return {l: r.left, r: r.right, t: r.top, b: r.bottom}; };
  return {title: box(div.querySelector('.g-gtitle .gtitle')),
          legend: box(div.querySelector('.legend .bg') || div.querySelector('.legend'))};
}
"""


def _store(db_url: str) -> str:
    db = Database.open(db_url)
    try:
        spec = sim.SimSpec(name="two ranks", world_size=2, stage=3, spans_every=1, seed=2)
        rc = sim.run_create(spec)
        store.create_run(db, run=rc)
        for events in sim.steps(spec, STEPS):
            store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
        Compactor(db, max_steps=STEPS).flush()
        return rc.run_id
    finally:
        db.close()


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["l"] < b["r"] and b["l"] < a["r"] and a["t"] < b["b"] and b["t"] < a["b"]


@pytest.mark.parametrize("width", [1400, 1000])
def test_run_page_legends_stay_off_titles_and_rank_ticks_are_whole(width, browser,
                                                                  tmp_path: Path):  # fmt: skip
    from support.live_server import LiveServer

    db_url = f"sqlite:///{tmp_path / 'two.db'}"
    run_id = _store(db_url)
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        with LiveServer(db_url=db_url, settings={"stalled_after_s": 10**7}) as server:
            page.goto(f"{server.url}/runs/{run_id}")
            got = assert_all_drawn(page)
            assert {"breakdown", "memory", "bandwidth"} <= set(got)
            for cid in got:
                boxes = page.evaluate(BOXES_JS, f"chart-{cid}")
                if boxes["title"] and boxes["legend"]:
                    assert not _overlap(boxes["title"], boxes["legend"]), (cid, boxes)
            # 2 ranks sorted by peak: positions 0 and 1, never a tick at -0.5 or 0.5.
            ticks = page.evaluate(
                "() => Array.from(document.querySelectorAll('#chart-memory .xtick text'))"
                ".map(t => t.textContent)"
            )
            assert ticks and all(t.lstrip("−-").isdigit() for t in ticks), ticks
            assert not any(t.startswith(("−", "-")) for t in ticks), ticks
    finally:
        context.close()
    assert errors == []
