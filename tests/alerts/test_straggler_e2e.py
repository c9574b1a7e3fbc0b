"""End to end at scale: a real Prometheus loads the rendered rules and scrapes a live
zerowatch server holding a simulated 4,096-rank run with one slow rank; it raises
ZeroWatchStragglerRank for exactly that rank, from the bounded /metrics (rank statistics
and a handful of outlier ranks, not 4,096 series per metric).

The rules are rendered with windows of seconds; the run is stored before the server starts
(4,096 ranks x 3 steps through the store's own ingest, then rolled up by the compactor as
a live server would), so Prometheus sees the same newest step at every scrape."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.live_server import LiveServer
from support.prometheus import PrometheusError, prometheus
from zerowatch.alerts import AlertSettings, render_rules
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read.rollups import RollupWorker as Compactor

from zerowatch import events as ev
from zerowatch import simulate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WORLD, STRAGGLER = 4096, 3001
SETTINGS = AlertSettings.load(None, ["window=4s", "straggler_for=3s"])


def _store_run(db_url: str) -> str:
    db = Database.open(db_url)
    try:
        spec = simulate.SimSpec(name="wide", project="e2e", world_size=WORLD, stage=3,
                                straggler_rank=STRAGGLER, straggler_factor=1.5,
                                spans_every=0)  # fmt: skip
        rc = simulate.run_create(spec)
        store.create_run(db, run=rc)
        for events in simulate.steps(spec, 3):
            store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
        Compactor(db).flush()
        return rc.run_id
    finally:
        db.close()


def test_prometheus_names_the_one_slow_rank_of_a_4096_rank_run(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'wide.db'}"
    run_id = _store_run(db_url)
    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules(SETTINGS))
    server = LiveServer(db_url=db_url, settings={"stalled_after_s": 10**7})
    with prometheus(targets=[f"{server.url}/metrics"], rule_files=[rules]) as prom, server:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        series = [ln for ln in text.splitlines() if run_id in ln and not ln.startswith("#")]
        assert len(series) <= 1000, len(series)
        named = {m.group(1) for ln in series if ln.startswith("zerowatch_busy_seconds{")
                 for m in [re.search(r'rank="(\d+)"', ln)] if m}  # fmt: skip
        assert str(STRAGGLER) in named and len(named) <= 8, named

        def stragglers() -> list[dict[str, Any]]:
            return [a for a in prom.alerts() if a["labels"]["alertname"] == "ZeroWatchStragglerRank"
                    and a["state"] == "firing"]  # fmt: skip

        t = time.monotonic()
        try:
            firing = prom.wait_for(stragglers, timeout=60)
        except PrometheusError as e:
            pytest.fail(f"no straggler alert; alerts now: {prom.alerts()}\n{e}")
        print(f"\nZeroWatchStragglerRank firing after {time.monotonic() - t:.1f} s")
        # A few more evaluations: still exactly the one rank, with the run's labels.
        time.sleep(3)
        firing = stragglers()
        assert [(a["labels"]["run"], a["labels"]["rank"]) for a in firing] == [
            (run_id, str(STRAGGLER))
        ], firing
        alert = firing[0]
        assert alert["labels"]["project"] == "e2e"
        assert float(alert["value"]) > SETTINGS.straggler_ratio
        assert f"Rank {STRAGGLER} straggles in run wide" == alert["annotations"]["summary"]
