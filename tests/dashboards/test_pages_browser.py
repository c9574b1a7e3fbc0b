"""Every page in a real headless Chromium against a live server holding real instrumented
runs of ZeRO stages 1, 2 and 3: no console errors, every chart drew its data, live runs
update in place, and data that looks like markup stays text."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from charts import assert_all_drawn, charts
from support.dashboard_runs import REAL_STEPS
from support.screenshots import XSS_NAME, screenshot

from zerowatch import simulate as sim

pytestmark = pytest.mark.slow

RUN_CHARTS = {"breakdown", "spread", "phases", "collectives", "bandwidth", "memory", "training",
              "ranks", "waterfall"}  # fmt: skip


def test_run_page_follows_a_real_run_live_as_it_trains(seeded, probe):
    """First in the module: the real runs are still training. The stage-3 run's page, opened
    after its first steps, takes the next ones and the end of the run in place."""
    page = probe.page
    tag = seeded.training.tags[3]
    deadline = time.monotonic() + 240
    run = None
    while time.monotonic() < deadline and run is None:
        found = httpx.get(f"{seeded.url}/api/v1/runs", params={"tag": tag}, timeout=10).json()
        if found["runs"] and found["runs"][0]["steps"] >= 1:
            run = found["runs"][0]
        time.sleep(0.1)
    assert run is not None, f"the stage-3 run stored no step: {seeded.training.logs[3]}"
    page.goto(f"{seeded.url}/runs/{run['run_id']}")
    assert_all_drawn(page)
    assert page.locator("#run-status .badge").inner_text() == "running", (
        "the run ended before its page opened: nothing left to watch"
    )
    first = int(page.locator("#stat-steps").inner_text())
    assert first < REAL_STEPS
    page.evaluate(
        "() => { window.__zwKeep = 1; document.getElementById('chart-breakdown').__zwKeep = 1; }"
    )
    page.wait_for_function(
        f"() => +document.getElementById('stat-steps').textContent > {first}", timeout=120_000
    )
    page.wait_for_function(
        "() => document.querySelector('#run-status .badge').textContent === 'finished'",
        timeout=180_000,
    )
    assert page.locator("#stat-steps").inner_text() == str(REAL_STEPS)
    assert charts(page)["breakdown"]["maxX"] == REAL_STEPS - 1
    kept = page.evaluate(
        "() => [window.__zwKeep, document.getElementById('chart-breakdown').__zwKeep]"
    )
    assert kept == [1, 1], "the page reloaded or redrew the chart element from scratch"
    assert_all_drawn(page)
    screenshot(page, "run-live-finished")
    assert probe.errors == []


def test_runs_page_lists_runs_with_badges_filters_and_compare_selected(seeded, probe):
    page = probe.page
    page.goto(seeded.url + "/")
    rows = page.locator("#runs-table tbody tr")
    assert rows.count() == 5
    for stage, run_id in seeded.stages.items():
        row = page.locator(f'tr[data-run-id="{run_id}"]')
        assert row.locator("td.name a").inner_text().startswith(f"tiny-gpt stage {stage}")
        assert row.locator("td").nth(4).inner_text() == f"ZeRO-{stage}"
        assert row.locator("td").nth(8).inner_text() == str(REAL_STEPS)  # steps
        assert re.fullmatch(r"[\d.]+ (µs|ms|s)", row.locator("td").nth(10).inner_text())
        assert row.locator(".badge").inner_text() == "finished"
    assert page.locator(f'tr[data-run-id="{seeded.xss}"] .badge').inner_text() == "running"
    assert page.locator(f'tr[data-run-id="{seeded.failed}"] .badge').inner_text() == "failed"
    # Each status has its own colour.
    colors = {
        status: page.locator(f'tr[data-run-id="{rid}"] .badge').evaluate(
            "e => getComputedStyle(e).color"
        )
        for status, rid in (("finished", seeded.stages[1]), ("running", seeded.xss),
                            ("failed", seeded.failed))
    }  # fmt: skip
    assert colors == {"finished": "rgb(39, 174, 96)", "running": "rgb(46, 134, 222)",
                      "failed": "rgb(192, 57, 43)"}  # fmt: skip
    assert page.locator(f'tr[data-run-id="{seeded.stages[3]}"] td').nth(6).inner_text() == "fp16"
    assert page.locator(f'tr[data-run-id="{seeded.stages[2]}"]').get_by_text(
        "optimizer → cpu").count() == 1  # fmt: skip
    screenshot(page, "runs")

    # Filter by project, then by status, through the form.
    page.select_option("select[name=project]", "zero-stages")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"project=zero-stages"))
    assert page.locator("#runs-table tbody tr").count() == 3
    page.select_option("select[name=status]", "running")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"status=running"))
    assert page.locator("#runs-table tbody tr").count() == 0
    page.goto(seeded.url + "/?status=running")
    assert page.locator("#runs-table tbody tr").count() == 1
    page.goto(seeded.url + "/?tag=stage3")
    assert page.locator("#runs-table tbody tr").count() == 1
    page.goto(seeded.url + "/?status=failed")
    assert page.locator("#runs-table tbody tr").get_attribute("data-run-id") == seeded.failed

    # Compare selected: tick the three stage runs, press the button.
    page.goto(seeded.url + "/")
    assert page.locator("#compare-selected").is_disabled()
    for run_id in seeded.stages.values():
        page.check(f'input[name=runs][value="{run_id}"]')
    page.click("#compare-selected")
    page.wait_for_url(re.compile(r"/compare\?runs="))
    assert page.locator("#compare-table tbody tr").count() == 3
    assert_all_drawn(page)
    assert probe.errors == []


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_run_page_draws_every_chart_without_console_errors(seeded, probe, stage):
    page = probe.page
    run_id = seeded.stages[stage]
    page.goto(f"{seeded.url}/runs/{run_id}")
    expected = RUN_CHARTS | ({"offload"} if stage == 2 else set())
    got = assert_all_drawn(page, expected)
    assert got["breakdown"]["maxX"] == REAL_STEPS - 1  # every stored step reached the chart
    assert got["ranks"]["points"] == [2 * REAL_STEPS]  # 2 ranks x every step
    title = page.locator("#chart-ranks .gtitle").text_content() or ""
    assert "straggler" in title
    # fp16: the loss-scale panel
    assert "loss scale" in (page.locator("#chart-training").text_content() or "")
    assert page.locator("#run-name").inner_text() == f"tiny-gpt stage {stage}"
    assert (
        page.locator("a", has_text="Trace export").get_attribute("href")
        == f"/api/v1/runs/{run_id}/trace"
    )
    assert page.locator("a", has_text="Run JSON").get_attribute("href") == f"/api/v1/runs/{run_id}"
    assert f'"stage": {stage}' in page.locator("#run-config").inner_text()
    screenshot(page, f"run-stage{stage}")
    assert probe.errors == []


def test_run_page_links_answer(seeded, probe):
    page = probe.page
    run_id = seeded.stages[3]
    for path in (f"/api/v1/runs/{run_id}", f"/api/v1/runs/{run_id}/trace"):
        resp = page.request.get(seeded.url + path)
        assert resp.status == 200, path
        assert resp.json()


def test_live_run_page_updates_in_place_when_steps_arrive(seeded, probe):
    from support.dashboard_runs import post_simulated_run

    page = probe.page
    spec = sim.SimSpec(name="live run", project="zero-stages", world_size=4, stage=3,
                       precision="fp16", straggler_rank=2, step_time_s=0.55, seed=3)  # fmt: skip
    run_id = post_simulated_run(seeded.url, spec, 10)
    page.goto(f"{seeded.url}/runs/{run_id}")
    assert_all_drawn(page)
    before = charts(page)["breakdown"]["maxX"]
    assert before == 9
    # The ranks that stand out: the simulated straggler first, linking to its rank's view.
    first = page.locator("#outliers tbody tr").first
    assert first.get_attribute("data-rank") == "2"
    assert first.locator("a").first.get_attribute("href") == f"/runs/{run_id}/ranks/2"
    # A click on a heatmap row opens that rank's view (Plotly's click event, as the page
    # receives it).
    with page.expect_navigation():
        page.evaluate(
            "() => { const d = document.getElementById('chart-ranks');"
            " d.emit('plotly_click', {points: [{y: 'rank 2', data: d.data[0]}]}); }"
        )
    assert page.url.endswith(f"/runs/{run_id}/ranks/2")
    page.goto(f"{seeded.url}/runs/{run_id}")
    assert_all_drawn(page)
    # Mark the document and a chart's element: a reload or a fresh div would lose them.
    page.evaluate(
        "() => { window.__zwKeep = 1; document.getElementById('chart-breakdown').__zwKeep = 1; }"
    )
    post_simulated_run(seeded.url, spec, 5, start=int(before) + 1, run_id=run_id, end="finished")
    page.wait_for_function(
        f"() => document.getElementById('stat-steps').textContent === '{int(before) + 6}'",
        timeout=20_000,
    )
    page.wait_for_function(
        "() => Math.max(...document.getElementById('chart-breakdown').data[0].x) >= "
        f"{int(before) + 5}",
        timeout=10_000,
    )
    page.wait_for_function(
        "() => document.querySelector('#run-status .badge').textContent === 'finished'",
        timeout=10_000,
    )
    kept = page.evaluate(
        "() => [window.__zwKeep, document.getElementById('chart-breakdown').__zwKeep]"
    )
    assert kept == [1, 1], "the page reloaded or redrew the chart element from scratch"
    assert_all_drawn(page)
    assert probe.errors == []


def test_compare_page_shows_the_three_stages_side_by_side(seeded, probe):
    page = probe.page
    ids = [seeded.stages[s] for s in (1, 2, 3)]
    page.goto(f"{seeded.url}/compare?runs={','.join(ids)}")
    rows = page.locator("#compare-table tbody tr")
    assert [rows.nth(i).get_attribute("data-run-id") for i in range(3)] == ids
    got = assert_all_drawn(page, {"model_state", "comm", "phases", "throughput", "tradeoff"})
    # One category per run on the bar charts, one point per run on the trade-off.
    bars = page.evaluate(
        "() => document.getElementById('chart-model_state').data.filter(t => t.type === 'bar')"
        ".map(t => t.x.length)"
    )
    assert bars and all(n == 3 for n in bars)
    assert got["tradeoff"]["traces"] == 3
    # Memory per rank goes down from stage 1 to stage 3; communication goes up at stage 3.
    mem = page.evaluate(
        """() => { const d = document.getElementById('chart-model_state').data.filter(t => t.type === 'bar' && !t.name.includes('host'));
                  return [0, 1, 2].map(i => d.reduce((s, t) => s + (t.y[i] || 0), 0)); }"""
    )
    comm = page.evaluate(
        """() => { const d = document.getElementById('chart-comm').data.filter(t => t.type === 'bar');
                  return [0, 1, 2].map(i => d.reduce((s, t) => s + (t.y[i] || 0), 0)); }"""
    )
    assert mem[0] > mem[2] and comm[2] > comm[0]
    screenshot(page, "compare")
    assert probe.errors == []


def test_plan_page_answers_the_form(seeded, probe):
    page = probe.page
    page.goto(seeded.url + "/plan")
    assert_all_drawn(page, {"memory", "comm"})
    page.fill("input[name=params]", "70B")
    page.fill("input[name=gpus]", "64")
    page.fill("input[name=bandwidth]", "100GB/s")
    page.click("form.plan-form button[type=submit]")
    page.wait_for_url(re.compile(r"params=70B"))
    assert_all_drawn(page, {"memory", "comm"})
    rows = page.locator("#plan-table tbody tr")
    assert rows.count() == 8
    assert rows.nth(0).locator(".badge").inner_text() == "does not fit"  # 70B under DDP
    assert "ZeRO-3" in page.locator("#plan-recommendation").inner_text()
    assert "Comm time" in page.locator("#plan-table thead").inner_text()
    screenshot(page, "plan")
    assert probe.errors == []


def test_plan_page_names_the_bad_field(seeded, probe):
    page = probe.page
    resp = page.goto(seeded.url + "/plan?params=lots&gpus=8")
    assert resp.status == 422
    assert "params" in page.locator("#plan-error").inner_text()
    assert "lots" in page.locator("#plan-error").inner_text()


def test_markup_in_run_data_shows_as_text_on_every_page(seeded, probe):
    page = probe.page
    ids = [seeded.xss, *seeded.stages.values()]
    for path in ("/", f"/runs/{seeded.xss}", f"/compare?runs={','.join(ids)}",
                 "/?project=%3Cb%3Emarkup%3C%2Fb%3E"):  # fmt: skip
        page.goto(seeded.url + path)
        if page.locator(".chart").count():
            assert_all_drawn(page)
        assert page.get_by_text(XSS_NAME).first.is_visible(), path
        assert page.locator("img[src=x]").count() == 0, path
        assert page.locator("b", has_text="markup").count() == 0, path
    page.goto(f"{seeded.url}/runs/{seeded.xss}")
    assert page.locator("#run-name").inner_text() == XSS_NAME
    assert page.get_by_text("<img src=x onerror=alert(2)>").first.is_visible()
    assert "</script><script>alert(3)</script>" in page.locator("#run-config").inner_text()
    page.goto(f"{seeded.url}/compare?runs={','.join(ids)}")
    ticks = page.locator("#chart-throughput .xtick text").all_text_contents()
    assert any(XSS_NAME in t for t in ticks), ticks
    screenshot(page, "markup-compare")
    assert probe.dialogs == []
    assert probe.errors == []


def test_unknown_run_is_a_404_page_that_escapes_the_id(seeded, probe):
    page = probe.page
    resp = page.goto(seeded.url + "/runs/%22%3E%3Csvg%20onload%3Dalert(4)%3E")
    assert resp.status == 404
    assert '"><svg onload=alert(4)>' in page.locator("main").inner_text()
    assert page.locator("main svg").count() == 0
    assert probe.dialogs == []


def test_assets_come_from_the_server_not_a_cdn(seeded, probe):
    page = probe.page
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    page.goto(f"{seeded.url}/runs/{seeded.stages[1]}")
    assert_all_drawn(page)
    assert requested and all(u.startswith(seeded.url) for u in requested), requested
    assert any("/static/plotly.min.js?v=" in u for u in requested)
