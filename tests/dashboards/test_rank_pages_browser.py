"""The rank view and the node view in a real headless Chromium against a live server holding
a simulated 64-rank run with a straggler: every chart draws, no console errors, the node
view ranks the straggler first and its link reaches the straggler's rank view."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from charts import assert_all_drawn
from support.screenshots import screenshot

from zerowatch import simulate as sim

pytestmark = pytest.mark.slow

STRAGGLER = 13  # local rank 5 of sim-node-0001
RANK_CHARTS = {"steptime", "parts", "collectives", "memory", "training"}


@pytest.fixture(scope="module")
def wide_run() -> Iterator[tuple[str, str]]:
    """(server URL, run id) of a 64-rank, 20-step simulated run posted through the API."""
    from support.dashboard_runs import post_simulated_run
    from support.live_server import LiveServer

    with LiveServer(settings={"stalled_after_s": 3600}) as server:
        spec = sim.SimSpec(name="wide <b>run</b>", world_size=64, stage=3,
                           straggler_rank=STRAGGLER, seed=11)  # fmt: skip
        yield server.url, post_simulated_run(server.url, spec, 20, end="finished")


def test_rank_view_draws_every_chart_without_console_errors(wide_run, probe):
    url, run_id = wide_run
    page = probe.page
    page.goto(f"{url}/runs/{run_id}/ranks/{STRAGGLER}")
    assert_all_drawn(page, RANK_CHARTS)
    assert page.locator("#rank-host").inner_text() == "host: sim-node-0001"
    assert page.locator("#rank-local").inner_text() == "local rank: 5"
    assert page.locator("#run-link").inner_text() == "wide <b>run</b>"  # text, not markup
    ratio = float(page.locator("#stat-ratio").inner_text().split("×")[0])
    assert ratio > 1.2
    screenshot(page, "rank-view")
    assert probe.errors == [] and probe.dialogs == []


def test_node_view_ranks_the_straggler_first_and_links_to_its_rank_view(wide_run, probe):
    url, run_id = wide_run
    page = probe.page
    page.goto(f"{url}/runs/{run_id}/hosts/sim-node-0001")
    got = assert_all_drawn(page, {"busy"})
    assert got["busy"]["traces"] == 9  # 8 ranks and the median
    rows = page.locator("#host-ranks tbody tr")
    assert rows.count() == 8
    assert rows.first.get_attribute("data-rank") == str(STRAGGLER)
    screenshot(page, "node-view")
    rows.first.locator("a").click()
    page.wait_for_url(f"**/runs/{run_id}/ranks/{STRAGGLER}")
    assert_all_drawn(page, RANK_CHARTS)
    assert probe.errors == [] and probe.dialogs == []
