"""The pages of a wide run in a real headless Chromium: how long until every chart is drawn,
and how many bytes the page (HTML with its embedded figures) weighs.

    .venv/bin/python bench/pages.py                        # 4,096 ranks x 1,000 steps, SQLite
    .venv/bin/python bench/pages.py --ranks 1024 --steps 300

A simulated stage-3 run with one straggler is written through the store (`--fill-steps`
steps) while a `zerowatch serve` runs and rolls it up, then doubled in SQL to `--steps`
steps (bench/scale.py's method). Chromium (`/usr/bin/chromium`, driven by Playwright) then
opens the run page, a rank view, a node view, the compare page and the runs list, each
`--repeats` times with plotly.js cached (the first, cold load reported apart); it prints
the median time from navigation to every chart drawn, and the HTML's size.

Goal (issue 13): the run page of 4,096 ranks x 1,000 steps drawn in < 2 s, HTML + data < 1 MB.
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


def _load_s(page, url: str, charts: bool) -> float:  # type: ignore[no-untyped-def]
    page.goto(url)
    if charts:
        page.wait_for_function(DRAWN_JS, timeout=60_000, polling="raf")
    else:
        page.wait_for_load_state("load")
    return float(page.evaluate("performance.now()")) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--fill-steps", type=int, default=125)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as d:
        db_url = f"sqlite:///{d}/pages.db"
        with scale.server(db_url) as url:
            run_id = ib.fill(db_url, ranks=args.ranks, points=args.ranks * args.fill_steps)
            scale.wait_compacted(db_url, run_id)
            held = scale.double_until(db_url, run_id, args.fill_steps, args.steps)
            top = httpx.get(f"{url}/api/v1/runs/{run_id}/outliers", timeout=60).json()
            host = quote(top["ranks"][0]["host"], safe="")  # the straggler's node
            pages = [
                ("run page", f"/runs/{run_id}", True),
                ("rank view", f"/runs/{run_id}/ranks/{args.ranks // 2}", True),
                ("node view", f"/runs/{run_id}/hosts/{host}", True),
                ("compare", f"/compare?runs={run_id}", True),
                ("runs list", "/", False),
            ]
            print(f"\n{args.ranks:,} ranks x {held:,} steps ({args.ranks * held:,} rank-steps), "
                  f"SQLite; load {os.getloadavg()[0]:.1f}\n")  # fmt: skip
            print("| page | HTML bytes | cold load | drawn, median (cached) | each |")
            print("|---|---:|---:|---:|---|")
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
                try:
                    for name, path, charts in pages:
                        size = len(httpx.get(url + path, timeout=60).content)
                        page = browser.new_page(viewport={"width": 1400, "height": 900})
                        cold = _load_s(page, url + path, charts)
                        warm = [_load_s(page, url + path, charts) for _ in range(args.repeats)]
                        page.close()
                        print(f"| {name} | {size:,} | {cold:.2f} s | "
                              f"{statistics.median(warm):.2f} s | "
                              f"{', '.join(f'{w:.2f}' for w in warm)} |")  # fmt: skip
                finally:
                    browser.close()


if __name__ == "__main__":
    main()
