"""/metrics: the documented names and labels, values of the newest step, a cumulative
latency histogram, and finished runs dropping out after the grace period."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from support.server_api import create_sim_run, post_events
from zerowatch.server import metrics as metrics_module
from zerowatch.server import store
from zerowatch.server.app import create_app
from zerowatch.server.db import Database
from zerowatch.server.metrics import exposition
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=2, stage=3, offload_optimizer=True, precision="fp16")


def _samples(text: str) -> dict[str, list]:  # type: ignore[type-arg]
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_metrics_expose_rank_statistics_and_outlier_ranks(client: TestClient) -> None:
    rid = create_sim_run(client, SPEC)
    batches = list(simulate.steps(SPEC, 5))
    for evs in batches:
        post_events(client, rid, evs)
    post_events(client, rid, batches[1])  # a replay changes nothing
    client.app.state.rollup_worker.flush()  # type: ignore[attr-defined]
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    s = _samples(resp.text)
    for key in ("step_time", "busy", "phase", "step_part", "optimizer_step", "collective_busbw",
                "offload_bw", "memory_peak", "model_state", "model_state_theory", "grad_norm",
                "loss", "loss_scale", "samples_per_second", "last_event", "run_running",
                "memory_capacity", "exposed_comm", "collective_bytes"):  # fmt: skip
        assert ev.METRICS[key] in s, key
    newest = {e.rank: e for e in batches[-1]}
    st = s["zerowatch_step_time_seconds"]
    stats = {x.labels["stat"]: x.value for x in st if x.labels["stat"]}
    per_rank = {x.labels["rank"]: x.value for x in st if x.labels["rank"]}
    assert set(stats) == {"min", "p50", "p90", "max", "mean"}
    times = [newest[0].step_time_s, newest[1].step_time_s]
    assert stats["min"] == min(times) and stats["max"] == max(times)
    assert stats["p50"] == stats["mean"] == sum(times) / 2
    assert per_rank == {"0": newest[0].step_time_s, "1": newest[1].step_time_s}
    assert all(x.labels["run"] == rid and x.labels["project"] == "default" for x in st)
    phases = {(x.labels["rank"], x.labels["phase"]): x.value for x in s["zerowatch_phase_seconds"]}
    assert phases[("0", "backward")] == newest[0].phases["backward"]
    assert {x.labels["direction"] for x in s["zerowatch_offload_bandwidth_bytes_per_second"]} == {
        "d2h",
        "h2d",
    }
    assert {x.value for x in s["zerowatch_loss_scale"]} == {65536.0}
    assert s["zerowatch_run_running"][0].value == 1.0
    assert s["zerowatch_steps_total"][0].value == 10  # 2 ranks x 5 steps: the replay dropped
    # One histogram per run and op, summed over ranks, cumulative over the run.
    counts = {x.labels["op"]: x.value for x in s["zerowatch_collective_latency_seconds_count"]}
    expected = sum(c.count for evs in batches for e in evs
                   for c in e.collectives if c.op == "all_gather")  # fmt: skip
    assert counts["all_gather"] == expected
    buckets = [x for x in s["zerowatch_collective_latency_seconds_bucket"]
               if x.labels["op"] == "all_gather"]  # fmt: skip
    assert len(buckets) == len(ev.LATENCY_BUCKETS) + 1
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == expected
    assert [b.value for b in buckets] == sorted(b.value for b in buckets)
    assert "rank" not in buckets[0].labels


def test_the_sum_stat_of_throughput_is_the_jobs_throughput(tmp_path: Path) -> None:
    """`stat="sum"` of samples/s and tokens/s is the sum over the newest step's ranks (and
    no other gauge has one), also when the ranks differ in speed."""
    spec = simulate.SimSpec(world_size=16, stage=2, straggler_rank=5, straggler_factor=1.7,
                            spans_every=0)  # fmt: skip
    db = Database.open(f"sqlite:///{tmp_path / 'z.db'}")
    try:
        rc = simulate.run_create(spec)
        store.create_run(db, run=rc)
        for events in (batches := list(simulate.steps(spec, 3))):
            store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
        s = _samples(exposition(db, grace_s=300).decode())
    finally:
        db.close()
    newest = batches[-1]
    for key, field in (("samples_per_second", "samples_per_s"),
                       ("tokens_per_second", "tokens_per_s")):  # fmt: skip
        sums = [x.value for x in s[ev.METRICS[key]] if x.labels["stat"] == "sum"]
        expected = sum(getattr(e, field) for e in newest)
        assert len(sums) == 1 and abs(sums[0] - expected) <= 1e-9 * expected, (key, sums)
    with_sum = {name for name, xs in s.items() if any(x.labels.get("stat") == "sum" for x in xs)}
    assert with_sum == {ev.METRICS["samples_per_second"], ev.METRICS["tokens_per_second"]}


def test_finished_runs_leave_after_the_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", finished_grace_s=60.0)
    with TestClient(create_app(settings)) as client:
        spec = simulate.SimSpec(world_size=1)
        rid = create_sim_run(client, spec)
        post_events(client, rid, next(simulate.steps(spec, 1)))
        end = ev.EndEvent(rank=0, seq=1, time=time.time(), status="finished")
        post_events(client, rid, [end])
        run = client.get(f"/api/v1/runs/{rid}").json()
        assert run["status"] == "finished"
        s = _samples(client.get("/metrics").text)
        assert s["zerowatch_run_running"][0].value == 0.0
        # /metrics reads the clock once per scrape: scrape at chosen times, not after a sleep.
        ended = run["ended_at"]
        for at, shown in ((ended + 59.0, True), (ended + 61.0, False)):
            monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=lambda at=at: at))
            assert (rid in client.get("/metrics").text) is shown, at - ended


def test_a_restarted_server_exposes_live_runs_again(tmp_path: Path) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}")
    with TestClient(create_app(settings)) as client:
        rid = create_sim_run(client, SPEC)
        batches = list(simulate.steps(SPEC, 3))
        for evs in batches:
            post_events(client, rid, evs)
    with TestClient(create_app(settings)) as client:
        s = _samples(client.get("/metrics").text)
        ranks = {x.labels["rank"] for x in s["zerowatch_step_time_seconds"]} - {""}
        assert ranks == {"0", "1"}
        assert s["zerowatch_run_running"][0].labels["run"] == rid
        # the newest step comes back whole, its collectives too
        newest = {e.rank: e for e in batches[-1]}
        ops = {x.labels["op"] for x in s["zerowatch_collective_bus_bandwidth_bytes_per_second"]}
        assert ops == {c.op for e in newest.values() for c in e.collectives}
        client.app.state.rollup_worker.flush()  # type: ignore[attr-defined]
        s = _samples(client.get("/metrics").text)
        counts = {x.labels["op"]: x.value for x in s["zerowatch_collective_latency_seconds_count"]}
        assert counts["all_gather"] == sum(
            c.count for evs in batches for e in evs for c in e.collectives if c.op == "all_gather"
        )


def test_a_run_killed_without_its_end_event_is_forgotten_after_a_day(tmp_path: Path) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", forget_silent_after_s=86400)
    with TestClient(create_app(settings)) as client:
        spec = simulate.SimSpec(world_size=1)
        silent = create_sim_run(client, spec)
        long_ago = time.time() - 86400 - 3600
        post_events(client, silent, next(simulate.steps(spec, 1, t0=long_ago)))
        recent = create_sim_run(client, spec)
        post_events(client, recent, next(simulate.steps(spec, 1, t0=time.time() - 3600)))
        text = client.get("/metrics").text
        assert recent in text and silent not in text
