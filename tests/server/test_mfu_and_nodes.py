"""What the server makes of the agent's MFU (a /metrics gauge beside tokens/s, the run page's
tile, the doctor's evidence) and of its node identity (the launcher's node index beside the
host name: two containers with one host name on two nodes stay two nodes)."""

from __future__ import annotations

import dataclasses
import re
import statistics

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from support.server_api import asdict, create_sim_run, gz, post_events

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=4, stage=3, spans_every=0, peak_flops=989.5e12)


def _family(text: str, name: str) -> list:  # type: ignore[type-arg]
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_mfu_is_exposed_beside_tokens_per_second_shown_and_in_the_doctors_evidence(
    client: TestClient,
) -> None:
    rid = create_sim_run(client, SPEC)
    batches = list(simulate.steps(SPEC, 4))
    for events in batches:
        post_events(client, rid, events)
    client.app.state.rollup_worker.flush()  # type: ignore[attr-defined]
    text = client.get("/metrics").text
    assert ev.METRICS["mfu"] == "zerowatch_mfu_ratio"
    mfu = {s.labels["stat"]: s.value for s in _family(text, "zerowatch_mfu_ratio")
           if s.labels.get("stat")}  # fmt: skip
    newest = [e.mfu for e in batches[-1]]
    assert all(m is not None and 0 < m < 1 for m in newest)
    assert mfu["mean"] == statistics.fmean(newest)  # type: ignore[arg-type]
    assert mfu["min"] == min(newest) and mfu["max"] == max(newest)  # type: ignore[type-var]
    assert "sum" not in mfu  # a ratio of the job is the mean of its ranks' shares
    assert _family(text, "zerowatch_tokens_per_second")

    run = client.get(f"/api/v1/runs/{rid}").json()
    per_step = [statistics.fmean(e.mfu for e in evs) for evs in batches]  # type: ignore[misc]
    assert abs(run["mfu"] - statistics.median(per_step)) < 1e-12
    page = client.get(f"/runs/{rid}").text
    tile = re.search(r'id="stat-mfu">([^<]*)<', page)
    assert tile is not None and tile.group(1) == f"{run['mfu']:.1%}"

    found = client.get(f"/api/v1/runs/{rid}/findings").json()
    lo, hi = found["window"]  # the doctor's window leaves the warm-up out
    assert abs(found["throughput"]["mfu"] - statistics.median(per_step[lo : hi + 1])) < 1e-12
    assert found["throughput"]["tokens_per_s"] > 0


def test_a_run_without_mfu_shows_a_dash_and_exposes_no_mfu(client: TestClient) -> None:
    spec = dataclasses.replace(SPEC, peak_flops=None)
    rid = create_sim_run(client, spec)
    post_events(client, rid, next(simulate.steps(spec, 1)))
    client.app.state.rollup_worker.flush()  # type: ignore[attr-defined]
    assert not _family(client.get("/metrics").text, "zerowatch_mfu_ratio")
    assert client.get(f"/api/v1/runs/{rid}").json()["mfu"] is None
    assert 'id="stat-mfu">–<' in client.get(f"/runs/{rid}").text


def test_two_containers_with_one_host_name_on_two_nodes_stay_two_nodes(
    client: TestClient,
) -> None:
    spec = simulate.SimSpec(world_size=4, ranks_per_host=2, spans_every=0)
    rid = create_sim_run(client, spec)
    events = [dataclasses.replace(e, host="worker", node=e.rank // 2)
              for e in next(simulate.steps(spec, 1))]  # fmt: skip
    assert post_events(client, rid, events).status_code == 200
    hosts = client.get(f"/api/v1/runs/{rid}/hosts").json()["hosts"]
    assert hosts == [{"host": "worker#0", "ranks": [0, 1]}, {"host": "worker#1", "ranks": [2, 3]}]
    assert client.get(f"/api/v1/runs/{rid}").json()["rank_summary"]["hosts"] == 2
    # An agent that predates node ids: the host name alone.
    old = simulate.SimSpec(world_size=2, ranks_per_host=2, spans_every=0)
    rid_old = create_sim_run(client, old)
    post_events(client, rid_old, next(simulate.steps(old, 1)))
    assert client.get(f"/api/v1/runs/{rid_old}/hosts").json()["hosts"] == [
        {"host": "sim-node-0000", "ranks": [0, 1]}
    ]


def test_a_run_created_gzipped_without_hosts_and_an_old_agents_creation_are_both_read(
    client: TestClient,
) -> None:
    rc = simulate.run_create(simulate.SimSpec(world_size=2), "new-agent-run")
    body = {**asdict(rc), "hosts": []}
    resp = client.post("/api/v1/runs", content=gz(body),
                       headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})  # fmt: skip
    assert resp.status_code == 201, resp.text
    old = simulate.run_create(simulate.SimSpec(world_size=16), "old-agent-run")
    assert len(old.hosts) == 2
    assert client.post("/api/v1/runs", json=asdict(old)).status_code == 201
    assert client.get("/api/v1/runs/old-agent-run").json()["hosts"] == old.hosts
