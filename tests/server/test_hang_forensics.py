"""The hang and desync findings from stored heartbeats (server/read/forensics.py) on
simulated runs: a 4,096-rank job whose one node's 8 ranks never reach the collective
the other 4,088 wait in is named as that node's 8 ranks with their stack; a rank that
stopped sending heartbeats is silent; ranks at one seq in different ops are a desync."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from support.sim_agents import post_heartbeats
from zerowatch.agent import codec

from zerowatch import events as ev
from zerowatch import simulate

NODE = 37  # the stuck node: ranks 296-303


def _create(client: TestClient, spec: simulate.SimSpec) -> str:
    rc = simulate.run_create(spec)
    client.post("/api/v1/runs", json=codec.to_dict(rc)).raise_for_status()
    return rc.run_id


JSON = {"Content-Type": "application/json"}


def _findings(client: TestClient, run_id: str) -> list[dict]:
    client.app.state.heartbeats.flush()  # type: ignore[attr-defined]  # (written each second)
    r = client.get(f"/api/v1/runs/{run_id}/findings")
    r.raise_for_status()
    return r.json()["findings"]


def test_one_node_stuck_in_its_loader_at_4096_ranks_is_named_as_its_8_ranks(client) -> None:
    stuck = tuple(range(NODE * 8, NODE * 8 + 8))
    spec = simulate.SimSpec(world_size=4096, hang_at=40, hang_ranks=stuck, node_ids=True)
    run_id = _create(client, spec)
    for events in simulate.steps(spec, 2, start=38):
        for i in range(0, len(events), 1024):
            batch = ev.EventBatch(run_id, events[i : i + 1024])
            client.post(f"/api/v1/runs/{run_id}/events", content=codec.dumps(codec.to_dict(batch)),
                        headers={"Content-Type": "application/json"}).raise_for_status()  # fmt: skip
    assert post_heartbeats(client, spec, run_id) == 4096
    t0 = time.perf_counter()
    found = _findings(client, run_id)
    elapsed = time.perf_counter() - t0
    print(f"\nfindings of a 4,096-rank hang: {elapsed * 1e3:.0f} ms")
    (hang,) = [f for f in found if f["kind"] == "hang"]
    assert hang["severity"] == "critical" and found[0]["kind"] == "hang"
    assert hang["ranks"] == list(stuck)
    coll = hang["evidence"]["collective"]
    assert (coll["group"], coll["seq"], coll["op"]) == ("0", 40 * 24 + 1, "reduce_scatter")
    assert hang["evidence"]["waiting"]["count"] == 4088
    (where,) = hang["evidence"]["not_launched"]
    assert where["ranks"] == list(stuck) and where["nodes"] == [f"sim-node-{NODE:04d}#{NODE}"]
    assert where["last_step"] == 39 and where["phase"] == "between_steps"
    assert ("data/loader.py", "next_batch", 57) in [
        (f["file"], f["function"], f["line"]) for f in where["stack"]
    ]
    assert (
        "4,088 ranks" not in hang["message"]
        or "8 ranks on 1 node never launched it" in (hang["message"])
    )
    assert "8 ranks on 1 node never launched it" in hang["message"]
    assert "next_batch (data/loader.py:57)" in hang["message"]
    assert not [f for f in found if f["kind"] == "desync"]


def test_a_rank_without_heartbeats_is_silent_and_named(client) -> None:
    spec = simulate.SimSpec(world_size=16, hang_at=5, hang_ranks=())
    run_id = _create(client, spec)
    beats = [b for b in simulate.heartbeats(spec) if b.rank != 11]
    body = codec.dumps({"heartbeats": [codec.to_dict(b) for b in beats]})
    client.post(f"/api/v1/runs/{run_id}/heartbeats", content=body, headers=JSON).raise_for_status()
    (hang,) = [f for f in _findings(client, run_id) if f["kind"] == "hang"]
    assert hang["ranks"] == [11] and hang["evidence"]["silent"] == [11]
    assert "rank 11 silent" in hang["message"]


def test_ranks_at_one_seq_in_different_ops_are_a_desync(client) -> None:
    spec = simulate.SimSpec(world_size=8)
    run_id = _create(client, spec)
    beats = [simulate.heartbeat(spec, r, t=time.time(), step=10) for r in range(8)]
    calls = beats[5].groups["0"].calls
    calls[-1] = [calls[-1][0], "all_reduce", 3, "float32", *calls[-1][4:]]
    body = codec.dumps({"heartbeats": [codec.to_dict(b) for b in beats]})
    client.post(f"/api/v1/runs/{run_id}/heartbeats", content=body, headers=JSON).raise_for_status()
    found = _findings(client, run_id)
    assert not [f for f in found if f["kind"] == "hang"]  # nobody is stalled
    (desync,) = [f for f in found if f["kind"] == "desync"]
    assert desync["ranks"] == [5]
    assert "rank 5: all_reduce of 3 float32 elements" in desync["message"]


def test_heartbeats_of_an_unknown_run_or_rank_are_refused(client) -> None:
    spec = simulate.SimSpec(world_size=2)
    body = codec.dumps({"heartbeats": [codec.to_dict(simulate.heartbeat(spec, 1, t=0.0))]})
    assert (
        client.post("/api/v1/runs/nope/heartbeats", content=body, headers=JSON).status_code == 404
    )
    run_id = _create(client, spec)
    bad = codec.dumps({"heartbeats": [codec.to_dict(simulate.heartbeat(spec, 2, t=0.0))]})
    r = client.post(f"/api/v1/runs/{run_id}/heartbeats", content=bad, headers=JSON)
    assert r.status_code == 422 and "rank" in r.text


def test_the_run_page_shows_a_hang_as_a_banner_naming_the_ranks_and_their_stack(client) -> None:
    spec = simulate.SimSpec(world_size=16, hang_at=3, hang_ranks=(9,), node_ids=True)
    run_id = _create(client, spec)
    for events in simulate.steps(spec, 3):
        batch = ev.EventBatch(run_id, events)
        client.post(f"/api/v1/runs/{run_id}/events", content=codec.dumps(codec.to_dict(batch)),
                    headers=JSON).raise_for_status()  # fmt: skip
    post_heartbeats(client, spec, run_id)
    client.app.state.heartbeats.flush()  # type: ignore[attr-defined]
    page = client.get(f"/runs/{run_id}")
    assert page.status_code == 200
    banner = page.text.split('id="banner-hang"', 1)[1].split("</section>", 1)[0]
    assert "rank 9" in banner and "next_batch (data/loader.py:57)" in banner
    assert "Hang: 15 ranks (ranks 0, 1," in banner and ") wait in reduce_scatter" in banner
