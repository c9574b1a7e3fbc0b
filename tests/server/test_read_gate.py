"""Reads first (server/read_gate.py): the ingest writer waits while a read is in flight, for
a bounded time, and every GET or HEAD counts as a read while it runs."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from zerowatch.server import store
from zerowatch.server.app import create_app
from zerowatch.server.db import Database
from zerowatch.server.ingest import Ingestor
from zerowatch.server.read import rollups
from zerowatch.server.read.rollups import reader
from zerowatch.server.read.rollups.live_memo import LiveMemo
from zerowatch.server.read_gate import ReadGate, ReadGateMiddleware
from zerowatch.server.settings import Settings

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=2)


def test_a_wait_ends_when_the_reads_leave_or_after_max_wait() -> None:
    gate = ReadGate(max_wait_s=0.2)
    t = time.perf_counter()
    gate.yield_to_reads()  # nothing in flight: no wait
    assert time.perf_counter() - t < 0.05 and gate.yielded == 0
    gate.enter()
    t = time.perf_counter()
    gate.yield_to_reads()  # a read that never leaves: the wait is bounded
    assert 0.15 < time.perf_counter() - t < 2.0 and gate.yielded == 1
    threading.Timer(0.05, gate.leave).start()
    gate.max_wait_s = 10.0
    t = time.perf_counter()
    gate.yield_to_reads()  # the read leaves: the wait ends with it
    assert time.perf_counter() - t < 5.0 and gate.reads == 0


def test_the_writer_takes_no_group_while_a_read_is_in_flight(sqlite_url: str) -> None:
    db = Database.open(sqlite_url)
    gate = ReadGate(max_wait_s=30.0)
    ingestor = Ingestor(db, gate=gate)
    try:
        rc = simulate.run_create(SPEC)
        store.create_run(db, run=rc)
        batch = ev.EventBatch(rc.run_id, [simulate.step_event(SPEC, 0, 0)])
        ingestor.submit(run_id=rc.run_id, batch=batch)  # the writer is up and idle
        gate.enter()
        done = threading.Event()
        later = ev.EventBatch(rc.run_id, [simulate.step_event(SPEC, 1, 0)])
        threading.Thread(
            target=lambda: (ingestor.submit(run_id=rc.run_id, batch=later), done.set())
        ).start()
        assert not done.wait(0.5), "the writer wrote while a read was in flight"
        assert ingestor.groups == 1
        gate.leave()
        assert done.wait(10), "the writer did not go on once the read was done"
        assert ingestor.groups == 2
    finally:
        ingestor.close()
        db.close()


def test_every_get_and_head_counts_as_a_read_while_it_runs() -> None:
    gate = ReadGate(max_wait_s=0.05)
    seen: list[tuple[str, int]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((scope["method"], gate.reads))

    async def call(method: str) -> None:
        await ReadGateMiddleware(app, gate=gate)(
            {"type": "http", "method": method, "path": "/"}, None, None
        )

    for method in ("GET", "HEAD", "POST", "DELETE"):
        # A loop of its own on a thread of its own: the suite's earlier tests may leave one
        # running on this thread (asyncio.run refuses to start inside it).
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, call(method)).result()
    assert seen == [("GET", 1), ("HEAD", 1), ("POST", 0), ("DELETE", 0)]
    assert gate.reads == 0


def test_a_page_computes_each_dirty_step_once_however_often_its_mark_moves(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run page reads the newest steps' rollups several times (charts, memory, outliers,
    the doctor). With every write bumping their marks in between (as in a recovery storm,
    played here by a memo that never hits), each read computed them anew; within one
    request each dirty step is computed once. Outside a request nothing is shared."""
    spec = simulate.SimSpec(world_size=4, stage=3)
    settings = Settings(db_url=sqlite_url, rollup_interval_s=3600.0)  # steps stay dirty
    computed: list[int] = []
    real = reader.compute

    def counting(conn: Any, pk: int, steps: Any, **kw: Any) -> Any:
        computed.extend(steps)
        return real(conn, pk, steps, **kw)

    monkeypatch.setattr(reader, "compute", counting)
    monkeypatch.setattr(LiveMemo, "get", lambda self, key: None)
    with TestClient(create_app(settings)) as c:
        rc = simulate.run_create(spec, run_id="dirty")
        assert c.post("/api/v1/runs", json=dataclasses.asdict(rc)).status_code == 201
        events = [simulate.step_event(spec, r, s) for s in range(6) for r in range(4)]
        body = {"run_id": "dirty", "events": [dataclasses.asdict(e) for e in events]}
        assert c.post("/api/v1/runs/dirty/events", json=body).json()["accepted"] == 24
        assert c.get("/runs/dirty").status_code == 200
        assert sorted(computed) == list(range(6)), computed
        computed.clear()
        assert c.get("/runs/dirty/figures.json").status_code == 200
        assert sorted(computed) == list(range(6)), computed  # a new request, a new view
    db = Database.open(sqlite_url)
    try:
        with db.read() as conn:
            computed.clear()
            rollups.read(conn, 1, ["step_time_s"])
            rollups.read(conn, 1, ["step_time_s"])
            assert sorted(computed) == sorted([*range(6), *range(6)])
    finally:
        db.close()
