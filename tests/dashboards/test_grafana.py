"""dashboards/grafana/zerowatch.json: valid, importable as is, and every PromQL expression
names only metrics zerowatch exports (events.METRICS) and parses (promtool)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from zerowatch.events import METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "grafana" / "zerowatch.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_RE = re.compile(r"\bzerowatch_[a-z0-9_]+")


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
            for var in dash["templating"]["list"]:
                if var["type"] == "query":  # label_values(metric{...}, label) -> the metric
                    metric = var["definition"].split("(", 1)[1].rsplit(",", 1)[0]
                    assert prom.query(metric.replace("$project", ".*")), var["name"]
