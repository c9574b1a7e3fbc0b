"""dashboards/grafana/zerowatch.json: valid, importable as is, and every PromQL expression
names only metrics zerowatch exports (events.METRICS), parses (promtool), and selects one
rank statistic (`stat`) or the outlier ranks of every gauge it reads, so that nothing
aggregates min, p50, max... together by accident."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from zerowatch.server.metrics import KEYED, SCALARS, STATS, SUMMED

from zerowatch.events import METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "grafana" / "zerowatch.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_RE = re.compile(r"\bzerowatch_[a-z0-9_]+")
#: A metric and its selector's matchers: `zerowatch_x{a="b", c!=""}` -> ("zerowatch_x", ...).
SELECTOR_RE = re.compile(r"\b(zerowatch_[a-z0-9_]+)(?:\{([^}]*)\})?")
MATCHER_RE = re.compile(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
#: Gauge families with `stat` and `rank` labels (server/metrics.py): rank statistics, or
#: the outlier ranks' own values.
STAT_FAMILIES = {METRICS[k] for k in (*SCALARS, *KEYED)}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["definition"])
    return out


def test_dashboard_is_valid_json_with_unique_panel_ids_and_grid_positions():
    dash = load()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        assert p["type"] == "row" or p["targets"], p["title"]


def test_dashboard_has_a_datasource_input_and_every_panel_uses_it():
    dash = load()
    assert dash["__inputs"][0]["type"] == "datasource"
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def test_every_promql_references_existing_metric_names():
    known = set(METRICS.values())
    known |= {METRICS["collective_latency"] + s for s in HISTOGRAM_SUFFIXES}
    used = {m for e in exprs(load()) for m in METRIC_RE.findall(e)}
    assert used, "no metric found in the dashboard"
    assert used <= known, f"unknown metrics: {sorted(used - known)}"


def test_the_panels_cover_what_the_dashboard_promises():
    text = " ".join(exprs(load()))
    for name in ("step_time", "phase", "collective_busbw", "memory_peak", "grad_norm"):
        assert METRICS[name] in text, name
    assert "histogram_quantile(0.5," in text and "histogram_quantile(0.99," in text
    assert METRICS["collective_latency"] + "_bucket" in text


def stat_selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """(metric, {label: (op, value)}) of every selector of a stat-labelled family."""
    return [
        (name, {lb: (op, v) for lb, op, v in MATCHER_RE.findall(body or "")})
        for name, body in SELECTOR_RE.findall(expr)
        if name in STAT_FAMILIES
    ]


def mixed_stat_selectors(expr: str) -> list[str]:
    """The stat-labelled families `expr` reads without picking `stat="<one>"` (one of STATS,
    or "sum" for throughput) or the outlier ranks (`rank!=""`)."""
    summed = {METRICS[k] for k in SUMMED}
    bad = []
    for name, matchers in stat_selectors(expr):
        allowed = {*STATS, "sum"} if name in summed else set(STATS)
        stat, rank = matchers.get("stat"), matchers.get("rank")
        one_stat = stat is not None and stat[0] == "=" and stat[1] in allowed and rank is None
        if not (one_stat or (stat is None and rank == ("!=", ""))):
            bad.append(name)
    return bad


def test_every_gauge_selector_picks_one_stat_or_the_outlier_ranks():
    """Never a selector that mixes the statistics, which an aggregation would then add or
    average together (`sum by (run) (zerowatch_model_state_bytes)` adds min + p50 + ...)."""
    found = {e: mixed_stat_selectors(e) for e in exprs(load()) if stat_selectors(e)}
    assert found, "no stat-labelled gauge in the dashboard"
    assert {e: bad for e, bad in found.items() if bad} == {}
    text = " ".join(exprs(load()))
    assert 'zerowatch_samples_per_second{project=~"$project", run=~"$run", stat="sum"}' in text
    assert 'zerowatch_busy_seconds{project=~"$project", run=~"$run", rank!=""}' in text


def test_the_stat_check_flags_selectors_over_every_stat():
    assert mixed_stat_selectors('sum by (run) (zerowatch_model_state_bytes{run=~"$run"})') == [
        "zerowatch_model_state_bytes"
    ]
    assert mixed_stat_selectors("zerowatch_steps_total + zerowatch_grad_norm") == [
        "zerowatch_grad_norm"
    ]
    assert mixed_stat_selectors('zerowatch_loss{stat=~"p50|max"}') == ["zerowatch_loss"]
    assert mixed_stat_selectors('zerowatch_loss{stat="sum"}') == ["zerowatch_loss"]
    assert mixed_stat_selectors('zerowatch_loss{stat="max", rank="3"}') == ["zerowatch_loss"]
    assert mixed_stat_selectors('max(zerowatch_loss{stat="max"}) / zerowatch_loss{rank!=""}') == []
    assert mixed_stat_selectors('zerowatch_tokens_per_second{stat="sum"}') == []


def test_every_promql_parses_with_promtool(tmp_path: Path):
    if shutil.which("promtool") is None:
        pytest.fail("promtool not installed: run .ci/system-deps (apt-get install prometheus)")

    # Grafana's variables replaced by what Grafana sends for "All" and a 1-minute interval.
    def concrete(expr: str) -> str:
        return (
            expr.replace("$__rate_interval", "1m").replace("$project", ".*").replace("$run", ".*")
        )

    panel_exprs = [t["expr"] for p in load()["panels"] for t in p.get("targets", [])]
    rules = {
        "groups": [
            {
                "name": "grafana",
                "rules": [
                    {"record": f"zerowatch:grafana_panel_{i}", "expr": concrete(e)}
                    for i, e in enumerate(panel_exprs)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(panel_exprs)} rules found" in out.stdout


@pytest.mark.slow
def test_every_panel_query_returns_data_from_a_real_prometheus_scraping_zerowatch():
    """Prometheus (Debian's) scrapes a live server fed a simulated fp16 stage-2 offload run;
    each panel's query, as Grafana would send it with "All" selected, returns series."""
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus not installed: run .ci/system-deps")
    from support.dashboard_runs import post_simulated_run
    from support.live_server import LiveServer
    from support.prometheus import prometheus

    from zerowatch import simulate as sim

    spec = sim.SimSpec(name="grafana", project="dash", world_size=2, stage=2,
                       offload_optimizer=True, precision="fp16", spans_every=0)  # fmt: skip
    dash = load()
    queries = [
        (p["title"], t["expr"].replace("$__rate_interval", "1m").replace("$project", ".*")
         .replace("$run", ".*"))
        for p in dash["panels"] for t in p.get("targets", [])
    ]  # fmt: skip
    with LiveServer() as server:
        run_id = post_simulated_run(server.url, spec, 5)
        with prometheus(targets=[server.url + "/metrics"]) as prom:
            prom.wait_for(lambda: prom.query("zerowatch_step_time_seconds"), timeout=30)
            # More steps after the first scrape, so counters and histograms move.
            post_simulated_run(server.url, spec, 5, start=5, run_id=run_id)
            # steps_total counts the run's rank-steps: 10 steps of 2 ranks.
            prom.wait_for(lambda: prom.query("max(zerowatch_steps_total) >= 20"), timeout=30)
            # Rates need two scrapes after the move; give every panel that long to fill.
            with contextlib.suppress(Exception):
                prom.wait_for(lambda: all(prom.query(q) for _, q in queries), timeout=20)
            empty = [(title, q) for title, q in queries if not prom.query(q)]
            assert empty == [], empty
            # Each gauge selector, as Prometheus stores the series, holds one stat (or only
            # outlier ranks, whose stat label is empty and so absent).
            for title, q in queries:
                for match in SELECTOR_RE.finditer(q):
                    if match.group(1) in STAT_FAMILIES:
                        found = prom.query(match.group(0))
                        assert found, (title, match.group(0))
                        stats = {x["metric"].get("stat", "") for x in found}
                        assert len(stats) == 1, (title, match.group(0), stats)
            for var in dash["templating"]["list"]:
                if var["type"] == "query":  # label_values(metric{...}, label) -> the metric
                    metric = var["definition"].split("(", 1)[1].rsplit(",", 1)[0]
                    assert prom.query(metric.replace("$project", ".*")), var["name"]
