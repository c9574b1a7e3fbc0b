"""A run of a million stored rank-steps: its pages draw every chart in a real browser from
sampled steps, not the stored rows (no line carries more than MAX_POINTS points). How long
they take is bench/pages.py's to measure: a test's wall-clock budget fails on a slower or
busier machine for that alone."""

from __future__ import annotations

import time

import httpx
import pytest
from charts import ALL_DRAWN_JS, charts
from support.screenshots import screenshot
from zerowatch.server.db import Database
from zerowatch.server.page_queries import MAX_POINTS

# Storing and rolling up a million rank-steps is the set-up (about a minute).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RANK_STEPS = 1_000_000
#: 32,768 steps of 32 ranks: 64 simulated steps, doubled in SQL nine times.
WORLD, SEED_STEPS = 32, 64


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):  # type: ignore[no-untyped-def]
    from support.dashboard_runs import store_big_run
    from support.live_server import LiveServer

    db_url = f"sqlite:///{tmp_path_factory.mktemp('big') / 'big.db'}"
    db = Database.open(db_url)
    t = time.perf_counter()
    run_id, stored = store_big_run(
        db, rank_steps=RANK_STEPS, world_size=WORLD, seed_steps=SEED_STEPS
    )
    print(f"\nstored and rolled up {stored:,} rank-steps in {time.perf_counter() - t:.1f} s")
    db.close()
    assert stored >= RANK_STEPS
    # Every stored row stays: with the default retention the server would start by thinning
    # the run's old steps (~650,000 rank rows, seconds of a core) while the pages are timed.
    settings = {"stalled_after_s": 10**7, "retention_full_steps": 0}
    with LiveServer(db_url=db_url, settings=settings) as server:
        yield server, run_id, stored


def _render_s(page, url: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds from navigation start to every chart drawn, measured by the browser."""
    page.goto(url)
    page.wait_for_function(ALL_DRAWN_JS, timeout=20_000, polling="raf")
    return float(page.evaluate("performance.now()")) / 1000


def test_run_page_of_a_million_rank_steps_draws_every_chart_from_sampled_steps(big_server, probe):
    server, run_id, stored = big_server
    url = f"{server.url}/runs/{run_id}"
    html_s = []
    for _ in range(2):
        t = time.perf_counter()
        assert httpx.get(url, timeout=30).status_code == 200
        html_s.append(time.perf_counter() - t)
    # A cold browser first (plotly.js not cached yet), then as a user arrives from the runs
    # list: plotly.js cached (the server lets browsers keep it for a day).
    cold = _render_s(probe.page, url)
    warm = [_render_s(probe.page, url) for _ in range(3)]
    print(f"\nrun page of {stored:,} rank-steps: HTML {html_s[0]:.3f} s (first request), "
          f"{html_s[1]:.3f} s (next); in the browser, navigation to every chart drawn: "
          f"{cold:.3f} s (plotly.js not cached), {', '.join(f'{w:.3f}' for w in warm)} s "
          "(cached)")  # fmt: skip
    screenshot(probe.page, "run-large")
    got = charts(probe.page)
    assert set(got) >= {"breakdown", "spread", "collectives", "bandwidth", "memory", "training",
                        "ranks"}  # fmt: skip
    for cid, c in got.items():  # downsampled: no line carries more than MAX_POINTS points
        limit = MAX_POINTS * WORLD if cid == "ranks" else MAX_POINTS
        assert max(c["points"]) <= limit, (cid, c["points"])
    assert got["breakdown"]["maxX"] == stored // WORLD - 1  # the x range still spans the run
    # The grad norm is then refined from the spike-keeping series: the run holds a 50x
    # grad-norm spike every SEED_STEPS steps, which the min/max downsampling keeps in every bucket.
    probe.page.wait_for_function(
        "() => document.getElementById('chart-training').hasAttribute('data-refined')",
        timeout=20_000,
    )
    norms = probe.page.evaluate("() => document.getElementById('chart-training').data[0].y")
    spikes = sum(1 for v in norms if v > 10)
    # Still at most MAX_POINTS points (whenever the test reads the charts), yet a third of
    # them are spikes: every bucket kept its maximum.
    assert 0 < len(norms) <= MAX_POINTS and spikes >= len(norms) // 3, (len(norms), spikes)
    assert probe.errors == []


def test_runs_and_compare_pages_with_a_million_rank_steps_render(big_server, probe):
    server, run_id, _ = big_server
    page = probe.page
    # Each test has its own browser context: warm it as the run page's test does (plotly.js
    # cached, as for a user arriving from the runs list), then time each page.
    _render_s(page, f"{server.url}/compare?runs={run_id}")
    page.goto(server.url + "/")
    t = time.perf_counter()
    page.goto(server.url + "/")
    runs_s = time.perf_counter() - t
    assert page.locator(f'tr[data-run-id="{run_id}"]').count() == 1
    compare_s = _render_s(page, f"{server.url}/compare?runs={run_id}")
    print(f"\nruns page {runs_s:.3f} s, compare page {compare_s:.3f} s")
    assert probe.errors == []
