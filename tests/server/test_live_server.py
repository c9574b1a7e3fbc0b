"""The real server over HTTP: a real Prometheus scrapes it while a simulated run streams in,
and many ranks of several runs ingest at once with nothing lost or doubled (on SQLite and
on PostgreSQL)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
from support.live_server import LiveServer
from support.prometheus import prometheus

from zerowatch import events as ev
from zerowatch import simulate

pytestmark = pytest.mark.slow


def _post(client: httpx.Client, run_id: str, events: list[ev.StepEvent | ev.EndEvent]) -> dict:  # type: ignore[type-arg]
    body = {
        "schema_version": 1,
        "run_id": run_id,
        "events": [dataclasses.asdict(e) for e in events],
    }
    r = client.post(f"/api/v1/runs/{run_id}/events", content=gzip.compress(json.dumps(body).encode()),
                    headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_prometheus_scrapes_the_step_time_of_a_simulated_run() -> None:
    spec = simulate.SimSpec(name="prom", world_size=2, stage=3, step_time_s=0.25)
    with (
        LiveServer(token="t0k") as server,
        httpx.Client(base_url=server.url, headers=server.headers) as c,
    ):
        rc = simulate.run_create(spec)
        assert c.post("/api/v1/runs", json=dataclasses.asdict(rc)).status_code == 201
        with prometheus(targets=[server.url + "/metrics"]) as prom:
            stop = threading.Event()
            sent: list[ev.StepEvent] = []

            def feed() -> None:
                step = 0
                while not stop.is_set():
                    evs = [simulate.step_event(spec, r, step) for r in range(spec.world_size)]
                    _post(c, rc.run_id, evs)  # type: ignore[arg-type]
                    sent.extend(evs)
                    step += 1
                    stop.wait(0.2)

            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
            try:
                expr = f'zerowatch_step_time_seconds{{run="{rc.run_id}",rank="1"}}'
                result = prom.wait_for(lambda: prom.query(expr), timeout=30)
            finally:
                stop.set()
                feeder.join(10)
            value = float(result[0]["value"][1])
            assert result[0]["metric"]["project"] == "default"
            # the scraped value is the step time of one of the steps rank 1 sent
            assert any(abs(value - e.step_time_s) < 1e-9 for e in sent if e.rank == 1)
            assert 0.2 < value < 0.3
            hist = prom.wait_for(
                lambda: prom.query(
                    f'zerowatch_collective_latency_seconds_count{{run="{rc.run_id}",op="all_gather"}}'
                )
            )
            assert float(hist[0]["value"][1]) > 0


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    db_url = None
    if request.param == "postgresql":
        pg = request.getfixturevalue("pg_server")
        db_url = pg.create_database("live_" + uuid.uuid4().hex[:10])
    with LiveServer(db_url=db_url) as s:
        yield s


def test_concurrent_ingest_from_many_ranks_of_several_runs(server: LiveServer) -> None:
    """3 runs x 8 ranks, one thread per rank, 5-step batches, every third batch sent twice
    (a retry after a lost answer): each rank ends with exactly its 30 steps."""
    n_runs, world, n_steps, per_batch = 3, 8, 30, 5
    specs = [
        simulate.SimSpec(name=f"c{i}", world_size=world, stage=3, spans_every=0)
        for i in range(n_runs)
    ]
    run_ids = []
    with httpx.Client(base_url=server.url) as c:
        for spec in specs:
            rc = simulate.run_create(spec)
            assert c.post("/api/v1/runs", json=dataclasses.asdict(rc)).status_code == 201
            run_ids.append(rc.run_id)
    totals = {"accepted": 0, "duplicates": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def rank_worker(spec: simulate.SimSpec, run_id: str, rank: int) -> None:
        rng = random.Random(rank)
        try:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                for b, start in enumerate(range(0, n_steps, per_batch)):
                    evs = [
                        simulate.step_event(spec, rank, s) for s in range(start, start + per_batch)
                    ]
                    tries = 2 if b % 3 == 0 else 1
                    for _ in range(tries):
                        out = _post(c, run_id, evs)  # type: ignore[arg-type]
                        with lock:
                            totals["accepted"] += out["accepted"]
                            totals["duplicates"] += out["duplicates"]
                    if rng.random() < 0.3:
                        threading.Event().wait(0.01)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_worker, args=(spec, rid, r))
               for spec, rid in zip(specs, run_ids, strict=True) for r in range(world)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    batches_twice = len(range(0, n_steps, per_batch)[::3])
    assert totals["accepted"] == n_runs * world * n_steps
    assert totals["duplicates"] == n_runs * world * batches_twice * per_batch
    with httpx.Client(base_url=server.url) as c:
        for rid in run_ids:
            run = c.get(f"/api/v1/runs/{rid}").json()
            assert [(r["rank"], r["steps"], r["last_step"]) for r in run["ranks"]] == [
                (r, n_steps, n_steps - 1) for r in range(world)
            ]
            series = c.get(
                f"/api/v1/runs/{rid}/series", params={"metric": "step_time_s", "ranks": "0-63"}
            ).json()
            for s in series["series"]:
                assert s["steps"] == list(range(n_steps)), s["rank"]
            coll = c.get(f"/api/v1/runs/{rid}/series",
                         params={"metric": "collective.all_gather.count", "ranks": "0-63"}).json()  # fmt: skip
            expected = simulate.step_event(specs[0], 0, 0).collectives[0].count
            assert all(v == expected for s in coll["series"] for v in s["values"])
