"""The pages of a wide run in a real headless Chromium: how long until every chart is drawn,
and how many bytes the page (HTML with its embedded figures) weighs.

    .venv/bin/python bench/pages.py                        # 4,096 ranks x 1,000 steps, SQLite
    .venv/bin/python bench/pages.py --ranks 1024 --steps 300
    .venv/bin/python bench/pages.py --db /tmp/pages.db     # keep the database, reuse it next time
    .venv/bin/python bench/pages.py --ranks 32 --steps 32768 --fill-steps 64 --runs 1
                                                     # the dashboards' large-run test's shape

A simulated stage-3 run with one straggler is written through the store (`--fill-steps`
steps) while a `zerowatch serve` runs and rolls it up, then doubled in SQL to `--steps`
steps (bench/scale.py's method). Chromium (`/usr/bin/chromium`, driven by Playwright) then
opens the run page, a rank view, a node view, the compare page and the runs list, each
`--repeats` times with plotly.js cached (the first, cold load reported apart), and
`--repeats` times in a new tab of the same browser profile (plotly.js from the cache,
parsed again); it prints the median time from navigation to every chart drawn, and the
HTML's size.

Many wide runs: the run is then copied into `--runs` runs in all (50 by default), each a
4,096-rank run with the rows the runs list and the compare page read (the run, its tags,
its ranks' states, its rollups and totals; not its per-rank step rows, which neither page
reads), and the bench also opens the runs list of them all and the compare page of the
most runs it shows side by side (pages.MAX_COMPARE, 12).

Goals: the run page of 4,096 ranks x 1,000 steps drawn in < 2 s, HTML + data < 1 MB; the
runs list and the compare page stay as fast with many runs of many ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ingest as ib
import scale

MAX_COMPARE = 12  # zerowatch.server.pages.MAX_COMPARE (not imported: it loads plotly)

DRAWN_JS = """
() => {
  const divs = Array.from(document.querySelectorAll('.chart'));
  return divs.length > 0 && divs.every(d => d.classList.contains('js-plotly-plot')
    && (d.data || []).length > 0
    && d.querySelectorAll('.scatterlayer .trace, .barlayer .trace, .heatmaplayer .hm image')
       .length > 0);
}
"""
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def _load_s(page, url: str, charts: bool) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(seconds to the HTML received, seconds to every chart drawn) from navigation start:
    the first is the server's share, the difference the browser's."""
    page.goto(url)
    if charts:
        page.wait_for_function(DRAWN_JS, timeout=60_000, polling="raf")
    else:
        page.wait_for_load_state("load")
    drawn = float(page.evaluate("performance.now()")) / 1000
    html = page.evaluate("performance.getEntriesByType('navigation')[0].responseEnd")
    return float(html) / 1000, drawn


def clone_runs(db_url: str, run_id: str, n: int) -> list[str]:
    """Copy run `run_id` into `n` new runs (the rows the runs list and compare read: see the
    module docstring); returns their ids."""
    from sqlalchemy import insert, literal, select
    from zerowatch.server import models as m
    from zerowatch.server.db import Database

    db = Database.open(db_url, migrate_schema=False)
    ids = []
    try:
        with db.write() as conn:
            row = conn.execute(select(m.runs).where(m.runs.c.run_id == run_id)).one()
            for i in range(n):
                new_id = f"{run_id}-copy{i}"
                values = {k: v for k, v in row._mapping.items() if k != "id"}
                values.update(run_id=new_id, name=f"{row.name} copy {i}",
                              created_at=row.created_at + i + 1)  # fmt: skip
                pk = conn.execute(insert(m.runs).values(**values)).inserted_primary_key[0]
                for table in (m.run_tags, m.rank_states, m.step_rollups, m.run_totals):
                    cols = list(table.c)
                    exprs = [literal(pk).label("run") if c.name == "run" else c for c in cols]
                    conn.execute(insert(table).from_select(
                        [c.name for c in cols], select(*exprs).where(table.c.run == row.id)
                    ))  # fmt: skip
                ids.append(new_id)
    finally:
        db.close()
    return ids


def _existing(db_url: str) -> tuple[str, list[str], int] | None:
    """(first run, its copies, steps) of a database this bench filled before, or None."""
    from sqlalchemy import func, select
    from zerowatch.server import models as m
    from zerowatch.server.db import Database

    db = Database.open(db_url, migrate_schema=False)
    try:
        with db.read() as conn:
            ids = list(conn.execute(select(m.runs.c.run_id).order_by(m.runs.c.id)).scalars())
            if not ids:
                return None
            pk = conn.execute(select(m.runs.c.id).where(m.runs.c.run_id == ids[0])).scalar()
            steps = conn.execute(select(func.max(m.rank_states.c.steps))
                                 .where(m.rank_states.c.run == pk)).scalar()  # fmt: skip
    finally:
        db.close()
    return ids[0], ids[1:], int(steps or 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--fill-steps", type=int, default=125)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=50, help="runs in all, for the runs list")
    ap.add_argument("--db", help="SQLite file to keep (reused when it exists)")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as d:
        db_url = f"sqlite:///{args.db or f'{d}/pages.db'}"
        found = _existing(db_url) if args.db and Path(args.db).exists() else None
        # Every stored row stays: on a run longer than the default retention's 10,000 full
        # steps the server would otherwise thin its old steps in the background while the
        # pages are timed (a run of 32 ranks x 32,768 steps: ~650,000 rows, seconds of a core).
        with scale.server(db_url, settings={"ZEROWATCH_RETENTION_FULL_STEPS": "0"}) as url:
            if found is None:
                run_id = ib.fill(db_url, ranks=args.ranks, points=args.ranks * args.fill_steps)
                scale.wait_compacted(db_url, run_id)
                held = scale.double_until(db_url, run_id, args.fill_steps, args.steps)
                copies = clone_runs(db_url, run_id, args.runs - 1)
            else:
                run_id, copies, held = found
            top = httpx.get(f"{url}/api/v1/runs/{run_id}/outliers", timeout=60).json()
            host = quote(top["ranks"][0]["host"], safe="")  # the straggler's node
            wide = ",".join([run_id, *copies][:MAX_COMPARE])
            pages = [
                ("run page", f"/runs/{run_id}", True),
                ("rank view", f"/runs/{run_id}/ranks/{args.ranks // 2}", True),
                ("node view", f"/runs/{run_id}/hosts/{host}", True),
                ("compare, 1 run", f"/compare?runs={run_id}", True),
                (f"compare, {wide.count(',') + 1} runs", f"/compare?runs={wide}", True),
                (f"runs list, {len(copies) + 1} runs", "/", False),
            ]
            print(f"\n{args.ranks:,} ranks x {held:,} steps ({args.ranks * held:,} rank-steps), "
                  f"{len(copies) + 1} runs, SQLite; load {os.getloadavg()[0]:.1f}\n")  # fmt: skip
            print("| page | HTML bytes | cold load | drawn, median (cached) | new tab, median | "
                  "HTML received (server) | drawing (browser) | each |")  # fmt: skip
            print("|---|---:|---:|---:|---:|---:|---:|---|")
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
                try:
                    for name, path, charts in pages:
                        size = len(httpx.get(url + path, timeout=60).content)
                        # One browser profile (its HTTP cache shared by its tabs), as a user's.
                        context = browser.new_context(viewport={"width": 1400, "height": 900})
                        page = context.new_page()
                        cold = _load_s(page, url + path, charts)[1]
                        got = [_load_s(page, url + path, charts) for _ in range(args.repeats)]
                        page.close()
                        # A new tab each time (alerts, chat and the runs list open runs so):
                        # plotly.js comes from the cache, but is parsed and run again.
                        tabs = []
                        for _ in range(args.repeats):
                            tab = context.new_page()
                            tabs.append(_load_s(tab, url + path, charts)[1])
                            tab.close()
                        context.close()
                        warm = [d for _, d in got]
                        server = statistics.median(h for h, _ in got)
                        draw = statistics.median(d - h for h, d in got)
                        print(f"| {name} | {size:,} | {cold:.2f} s | "
                              f"{statistics.median(warm):.2f} s | {statistics.median(tabs):.2f} s | "
                              f"{server:.2f} s | {draw:.2f} s | "
                              f"{', '.join(f'{w:.2f}' for w in warm)} |")  # fmt: skip
                finally:
                    browser.close()


if __name__ == "__main__":
    main()
