"""Concurrent batches share transactions (group commit) without one batch's fault touching
another's events."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from zerowatch.server import read as queries
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.ingest import Ingestor

from zerowatch import events as ev
from zerowatch import simulate

T = TypeVar("T")

SPEC = simulate.SimSpec(world_size=8, stage=3, spans_every=0)


def stored_run(db: Database) -> ev.RunCreate:
    """A simulated run of SPEC, created in the store."""
    rc = simulate.run_create(SPEC)
    store.create_run(db, run=rc)
    return rc


def test_concurrent_batches_are_grouped_and_a_bad_one_fails_alone(db: Database) -> None:
    rc = stored_run(db)
    ingestor = Ingestor(db)
    errors: dict[int, BaseException] = {}
    results: dict[int, store.IngestResult | None] = {}
    barrier = threading.Barrier(8)

    def rank(r: int) -> None:
        barrier.wait()
        for s in range(20):
            e = simulate.step_event(SPEC, r, s)
            if r == 5 and s == 7:
                e.rank = 99  # outside the world: this batch alone is refused
            try:
                results[r * 100 + s] = ingestor.submit(
                    run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [e])
                )
            except store.BatchError as err:
                errors[r * 100 + s] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert list(errors) == [507] and errors[507].loc[-1] == "rank"
    assert ingestor.batches == 160 and ingestor.groups < ingestor.batches
    run = queries.get_run(db=db, run_id=rc.run_id)
    assert run is not None
    assert [x["steps"] for x in run["ranks"]] == [20, 20, 20, 20, 20, 19, 20, 20]
    assert ingestor.submit(run_id="missing", batch=ev.EventBatch("missing", [])) is None


def test_a_failing_group_is_retried_batch_by_batch(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    rc = stored_run(db)
    ingestor = Ingestor(db)
    monkeypatch.setattr(
        ingestor, "_write_group", lambda group: (_ for _ in ()).throw(RuntimeError("x"))
    )
    out = ingestor.submit(
        run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [simulate.step_event(SPEC, 0, 0)])
    )
    assert out is not None and out.accepted == 1


def test_one_statement_per_table_keeps_each_batch_its_own_outcome(db: Database) -> None:
    rc = stored_run(db)
    a = [simulate.step_event(SPEC, r, 0) for r in range(4)]
    b = [simulate.step_event(SPEC, r, 0) for r in range(2, 6)]  # ranks 2, 3 repeat a's
    bad = [simulate.step_event(SPEC, 0, 1)]
    bad[0].collectives[0].buckets = []
    end = [ev.EndEvent(rank=7, seq=0, time=1.0, status="finished")]
    with db.write() as conn:
        ref = store.run_ref(conn, run_id=rc.run_id)
        assert ref is not None
        out = store.ingest_many(conn, [(ref, ev.EventBatch(rc.run_id, x)) for x in (a, bad, b, end)],
                                trace_sample_every=1, now=1e12)  # fmt: skip
    ra, rbad, rb, rend = out
    assert isinstance(rbad, store.BatchError)
    assert isinstance(ra, store.IngestResult) and isinstance(rb, store.IngestResult)
    assert (ra.accepted, ra.duplicates, rb.accepted, rb.duplicates) == (4, 0, 2, 2)
    assert isinstance(rend, store.IngestResult) and rend.accepted == 1
    run = queries.get_run(db=db, run_id=rc.run_id)
    assert run is not None
    assert [(x["rank"], x["steps"]) for x in run["ranks"]] == [(r, 1) for r in range(6)] + [(7, 0)]


def on_own_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh event loop in its own thread, as uvicorn's loop runs beside
    the writer thread (and whatever loop the test process already has stays out of it)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result(timeout=60)


def test_requests_awaiting_on_an_event_loop_share_groups_and_each_gets_its_own_answer(
    db: Database,
) -> None:
    rc = stored_run(db)
    ingestor = Ingestor(db)

    def batch(rank: int, step: int) -> ev.EventBatch:
        return ev.EventBatch(rc.run_id, [simulate.step_event(SPEC, rank, step)])

    async def requests() -> list[object]:
        calls = [ingestor.submit_async(run_id=rc.run_id, batch=batch(r, s))
                 for s in range(10) for r in range(8)]  # fmt: skip
        bad = batch(3, 10)
        bad.events[0].rank = 99  # outside the world: refused alone
        calls.append(ingestor.submit_async(run_id=rc.run_id, batch=bad))
        calls.append(ingestor.submit_async(run_id="missing", batch=batch(0, 0)))
        calls.append(ingestor.submit_async(run_id=rc.run_id, batch=batch(0, 0)))  # a replay
        return await asyncio.gather(*calls, return_exceptions=True)

    out = on_own_loop(requests())
    assert all(isinstance(r, store.IngestResult) and r.accepted == 1 for r in out[:80])
    assert isinstance(out[80], store.BatchError) and out[80].loc[-1] == "rank"
    assert out[81] is None
    assert isinstance(out[82], store.IngestResult) and (out[82].accepted, out[82].duplicates) == (
        0,
        1,
    )
    assert ingestor.batches == 83 and ingestor.groups < ingestor.batches  # they were grouped
    run = queries.get_run(db=db, run_id=rc.run_id)
    assert run is not None and [x["steps"] for x in run["ranks"]] == [10] * 8
    ingestor.close()


def test_a_cancelled_request_still_stores_its_batch_and_the_writer_goes_on(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    rc = stored_run(db)
    ingestor = Ingestor(db)
    writing, release = threading.Event(), threading.Event()
    write_group = ingestor._write_group

    def held(group):  # the first group says it is being written, then waits for the test
        writing.set()
        release.wait(10)
        write_group(group)

    monkeypatch.setattr(ingestor, "_write_group", held)

    async def scenario() -> store.IngestResult | None:
        first = asyncio.ensure_future(ingestor.submit_async(
            run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [simulate.step_event(SPEC, 0, 0)])))  # fmt: skip
        # The cancel lands while the writer holds the batch, whatever the machine's speed.
        assert await asyncio.to_thread(writing.wait, 10), "the writer never took the batch"
        first.cancel()  # the client went away while its batch was being written
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await ingestor.submit_async(
            run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [simulate.step_event(SPEC, 1, 0)])
        )

    second = on_own_loop(scenario())
    assert second is not None and second.accepted == 1
    run = queries.get_run(db=db, run_id=rc.run_id)
    assert run is not None and [x["steps"] for x in run["ranks"]][:2] == [1, 1]
    # close() writes what is queued and stops the writer; a later batch starts it again.
    ingestor.close()
    later = ingestor.submit(
        run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [simulate.step_event(SPEC, 2, 0)])
    )
    assert later is not None and later.accepted == 1
    ingestor.close()
