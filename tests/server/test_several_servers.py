"""Several server processes on one PostgreSQL database (`zerowatch serve --workers N`, or
servers behind a load balancer) answer alike: ingest alternating between two of them
stores every rank-step exactly once and both expose the same /metrics and run; a server
killed in the middle of ingest loses nothing it acknowledged."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.live_server import LiveServer

from zerowatch import events as ev
from zerowatch import simulate

pytestmark = pytest.mark.slow

WORLD, STEPS = 16, 12


@pytest.fixture
def two_servers(pg_server: Any) -> Iterator[tuple[LiveServer, LiveServer]]:
    url = str(pg_server.create_database("multi_" + uuid.uuid4().hex[:10]))
    settings = {"stalled_after_s": 10**7, "rollup_interval_s": 0.2, "rollup_settle_s": 0.2}
    with (
        LiveServer(db_url=url, settings=settings) as a,
        LiveServer(db_url=url, settings=settings) as b,
    ):
        yield a, b


def _body(run_id: str, events: list[ev.StepEvent]) -> dict[str, Any]:
    return {"schema_version": ev.SCHEMA_VERSION, "run_id": run_id,
            "events": [dataclasses.asdict(e) for e in events]}  # fmt: skip


def _create(server: LiveServer, spec: simulate.SimSpec) -> str:
    rc = simulate.run_create(spec)
    r = httpx.post(f"{server.api}/runs", json=dataclasses.asdict(rc), timeout=30)
    assert r.status_code == 201, r.text
    return rc.run_id


def _batches(spec: simulate.SimSpec) -> list[list[ev.StepEvent]]:
    """Two steps of one rank per batch, as the agent sends them; ranks interleaved."""
    return [[simulate.step_event(spec, rank, s), simulate.step_event(spec, rank, s + 1)]
            for s in range(0, STEPS, 2) for rank in range(WORLD)]  # fmt: skip


def _run_metrics(text: str, run_id: str) -> list[str]:
    return sorted(ln for ln in text.splitlines() if f'run="{run_id}"' in ln)


def _ranks(server: LiveServer, run_id: str) -> list[tuple[int, int, int]]:
    run = httpx.get(f"{server.api}/runs/{run_id}", timeout=30).json()
    return [(r["rank"], r["steps"], r["last_step"]) for r in run["ranks"]]


def test_two_servers_on_one_postgresql_store_once_and_answer_alike(
    two_servers: tuple[LiveServer, LiveServer],
) -> None:
    a, b = two_servers
    spec = simulate.SimSpec(name="multi", world_size=WORLD, stage=3, spans_every=0,
                            straggler_rank=11, straggler_factor=1.5)  # fmt: skip
    run_id = _create(a, spec)
    accepted = duplicates = 0
    with httpx.Client(timeout=30) as ca, httpx.Client(timeout=30) as cb:
        for i, batch in enumerate(_batches(spec)):
            first, other = ((ca, a), (cb, b)) if i % 2 == 0 else ((cb, b), (ca, a))
            tries = [first, other] if i % 5 == 0 else [first]  # a retry lands on the other
            for client, server in tries:
                r = client.post(f"{server.api}/runs/{run_id}/events", json=_body(run_id, batch))
                assert r.status_code == 200, r.text
                accepted += r.json()["accepted"]
                duplicates += r.json()["duplicates"]
    n_batches = WORLD * STEPS // 2
    assert accepted == WORLD * STEPS
    assert duplicates == 2 * len(range(0, n_batches, 5))
    assert _ranks(a, run_id) == _ranks(b, run_id) == [(r, STEPS, STEPS - 1) for r in range(WORLD)]

    # Both compactors settle the same rollups: the two /metrics agree line for line.
    deadline = time.monotonic() + 30
    while True:
        ma = _run_metrics(httpx.get(f"{a.url}/metrics", timeout=30).text, run_id)
        mb = _run_metrics(httpx.get(f"{b.url}/metrics", timeout=30).text, run_id)
        if ma == mb or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ma == mb
    assert f'zerowatch_steps_total{{project="default",run="{run_id}"}} {float(WORLD * STEPS)}' in ma
    named = {m.group(1) for ln in ma if ln.startswith("zerowatch_busy_seconds{")
             for m in [re.search(r'rank="(\d+)"', ln)] if m}  # fmt: skip
    assert "11" in named and len(named) <= 8, named
    # And so do the run resource and a series, once both compactors have settled (a tick
    # of one may land between the two reads).
    for path in (f"/runs/{run_id}", f"/runs/{run_id}/series?metric=step_time_s"):
        deadline = time.monotonic() + 30
        while True:
            ra = httpx.get(a.api + path, timeout=30).json()
            rb = httpx.get(b.api + path, timeout=30).json()
            if ra == rb or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert ra == rb, path


def test_a_server_killed_mid_ingest_loses_nothing_it_acknowledged(
    two_servers: tuple[LiveServer, LiveServer],
) -> None:
    a, b = two_servers
    spec = simulate.SimSpec(name="killed", world_size=WORLD, stage=3, spans_every=0)
    run_id = _create(a, spec)
    batches = _batches(spec)
    acked: list[int] = []
    failed: list[int] = []
    lock = threading.Lock()
    started = threading.Event()

    def sender(idx: list[int]) -> None:
        with httpx.Client(timeout=30) as c:
            for i in idx:
                try:
                    r = c.post(f"{a.api}/runs/{run_id}/events", json=_body(run_id, batches[i]))
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                with lock:
                    (acked if ok else failed).append(i)
                if len(acked) >= 10:
                    started.set()

    # Four concurrent agents; server A is SIGKILLed once some batches are acknowledged,
    # while others are in flight.
    threads = [threading.Thread(target=sender, args=(list(range(k, len(batches), 4)),))
               for k in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    assert started.wait(60)
    a.kill()
    for t in threads:
        t.join(120)
    assert acked and failed, (len(acked), len(failed))
    # The agents retry what was not acknowledged against the server still up.
    with httpx.Client(timeout=30) as c:
        for i in sorted(failed):
            r = c.post(f"{b.api}/runs/{run_id}/events", json=_body(run_id, batches[i]))
            assert r.status_code == 200, r.text
    # Every acknowledged batch was stored by A before it died (none was sent again), and
    # every step of every rank is stored exactly once.
    assert _ranks(b, run_id) == [(r, STEPS, STEPS - 1) for r in range(WORLD)]
    got = httpx.get(f"{b.api}/runs/{run_id}/series", timeout=30,
                    params={"metric": "step_time_s", "rank": 5}).json()  # fmt: skip
    assert got["series"][0]["steps"] == list(range(STEPS))
