"""/metrics: the documented names and labels, values of the newest step, a cumulative
latency histogram, and finished runs dropping out after the grace period."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from support.server_api import create_sim_run, post_events
from zerowatch.server.app import create_app
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


def test_metrics_expose_the_newest_step_of_every_rank(client: TestClient) -> None:
    rid = create_sim_run(client, SPEC)
    batches = list(simulate.steps(SPEC, 5))
    for evs in batches:
        post_events(client, rid, evs)
    post_events(client, rid, batches[1])  # a replay changes nothing
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    s = _samples(resp.text)
    for key in ("step_time", "phase", "optimizer_step", "collective_busbw", "offload_bw",
                "memory_peak", "model_state", "model_state_theory", "grad_norm", "loss",
                "loss_scale", "samples_per_second", "last_event", "run_running",
                "memory_capacity", "exposed_comm", "collective_bytes"):  # fmt: skip
        assert ev.METRICS[key] in s, key
    newest = {e.rank: e for e in batches[-1]}
    step = {x.labels["rank"]: x for x in s["zerowatch_step_time_seconds"]}
    assert set(step) == {"0", "1"}
    assert step["1"].value == newest[1].step_time_s
    assert step["1"].labels["run"] == rid and step["1"].labels["project"] == "default"
    phases = {(x.labels["rank"], x.labels["phase"]): x.value for x in s["zerowatch_phase_seconds"]}
    assert phases[("0", "backward")] == newest[0].phases["backward"]
    assert {x.labels["direction"] for x in s["zerowatch_offload_bandwidth_bytes_per_second"]} == {
        "d2h",
        "h2d",
    }
    assert s["zerowatch_loss_scale"][0].value == 65536.0
    assert s["zerowatch_run_running"][0].value == 1.0
    assert s["zerowatch_steps_total"][0].value == 5  # not 6: the replay was dropped
    # The histogram is cumulative over the run: count = all calls of the op on that rank.
    counts = {(x.labels["rank"], x.labels["op"]): x.value
              for x in s["zerowatch_collective_latency_seconds_count"]}  # fmt: skip
    expected = sum(c.count for evs in batches for e in evs if e.rank == 0
                   for c in e.collectives if c.op == "all_gather")  # fmt: skip
    assert counts[("0", "all_gather")] == expected
    buckets = [x for x in s["zerowatch_collective_latency_seconds_bucket"]
               if x.labels["rank"] == "0" and x.labels["op"] == "all_gather"]  # fmt: skip
    assert len(buckets) == len(ev.LATENCY_BUCKETS) + 1
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == expected
    assert [b.value for b in buckets] == sorted(b.value for b in buckets)


def test_finished_runs_leave_after_the_grace_period(tmp_path: Path) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}", finished_grace_s=1.0)
    with TestClient(create_app(settings)) as client:
        spec = simulate.SimSpec(world_size=1)
        rid = create_sim_run(client, spec)
        post_events(client, rid, next(simulate.steps(spec, 1)))
        end = ev.EndEvent(rank=0, seq=1, time=time.time(), status="finished")
        post_events(client, rid, [end])
        assert client.get(f"/api/v1/runs/{rid}").json()["status"] == "finished"
        s = _samples(client.get("/metrics").text)
        assert s["zerowatch_run_running"][0].value == 0.0
        time.sleep(1.3)
        assert rid not in client.get("/metrics").text


def test_a_restarted_server_exposes_live_runs_again(tmp_path: Path) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'z.db'}")
    with TestClient(create_app(settings)) as client:
        rid = create_sim_run(client, SPEC)
        batches = list(simulate.steps(SPEC, 3))
        for evs in batches:
            post_events(client, rid, evs)
    with TestClient(create_app(settings)) as client:
        s = _samples(client.get("/metrics").text)
        assert {x.labels["rank"] for x in s["zerowatch_step_time_seconds"]} == {"0", "1"}
        assert s["zerowatch_run_running"][0].labels["run"] == rid
        # the newest step comes back whole, its collectives too
        newest = {e.rank: e for e in batches[-1]}
        ops = {(x.labels["rank"], x.labels["op"])
               for x in s["zerowatch_collective_bus_bandwidth_bytes_per_second"]}  # fmt: skip
        assert ops == {(str(r), c.op) for r, e in newest.items() for c in e.collectives}
        counts = {(x.labels["rank"], x.labels["op"]): x.value
                  for x in s["zerowatch_collective_latency_seconds_count"]}  # fmt: skip
        assert counts[("1", "all_gather")] == sum(
            c.count for c in newest[1].collectives if c.op == "all_gather"
        )


def test_a_run_killed_without_its_end_event_is_forgotten_after_a_day() -> None:
    from zerowatch.server.live import LiveCache

    live = LiveCache()
    spec = simulate.SimSpec(world_size=1)
    rc = simulate.run_create(spec)
    live.register({"run_id": rc.run_id, "project": "p", "name": "n", "zero_stage": 3,
                   "precision": "bf16", "offload_optimizer": "none", "offload_param": "none",
                   "engine": "x", "world_size": 1})  # fmt: skip
    now = time.time()
    live.apply(rc.run_id, next(simulate.steps(spec, 1)), status="running", last_event_at=now)
    assert [r.run_id for r in live.snapshot(grace_s=60, forget_after_s=86400, now=now + 3600)] == [
        rc.run_id
    ]
    assert live.snapshot(grace_s=60, forget_after_s=86400, now=now + 86401) == []
