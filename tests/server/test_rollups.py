"""The rollups equal a direct computation over the per-rank rows: right after ingest (dirty
steps computed by the reader) and after the compactor wrote them, with late, missing and
replayed ranks, on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

import pytest
from sqlalchemy import select, text
from zerowatch.server import models as m
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read import rollups

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=7, stage=3, straggler_rank=4, offload_optimizer=True)


def _q(vals: list[float], q: float) -> float:
    s = sorted(vals)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _expect(events: list[ev.StepEvent], value) -> dict[str, float]:  # type: ignore[no-untyped-def]
    pairs = [(value(e), e.rank) for e in events]
    vals = [v for v, _ in pairs]
    return {
        "n": len(vals),
        "min": min(vals),
        "max": max(vals),
        "mean": statistics.fmean(vals),
        "p50": statistics.median(vals),
        "p10": _q(vals, 0.1),
        "p90": _q(vals, 0.9),
        "min_rank": min(r for v, r in pairs if v == min(vals)),
        "max_rank": min(r for v, r in pairs if v == max(vals)),
    }


def _check(db: Database, pk: int, stored: dict[int, list[ev.StepEvent]]) -> None:
    metrics = ["step_time_s", "busy_s", "phase.backward", "collective.all_gather.bytes",
               "memory.peak"]  # fmt: skip
    getters = {
        "step_time_s": lambda e: e.step_time_s,
        "busy_s": lambda e: e.step_time_s - e.exposed_comm_s,
        "phase.backward": lambda e: e.phases["backward"],
        "collective.all_gather.bytes": lambda e: sum(
            c.bytes for c in e.collectives if c.op == "all_gather"
        ),
        "memory.peak": lambda e: max(e.memory.peak_by_phase.values()) if e.memory else 0,
    }
    with db.read() as conn:
        got = rollups.read(conn, pk, metrics)
    for name in metrics:
        assert sorted(got[name]) == sorted(stored), name
        for step, events in stored.items():
            st = got[name][step]
            want = _expect(events, getters[name])
            for k, v in want.items():
                assert getattr(st, k) == pytest.approx(v), (name, step, k)


def test_rollups_equal_a_direct_computation_with_late_missing_and_replayed_ranks(
    db: Database,
) -> None:
    rng = random.Random(3)
    rc = simulate.run_create(SPEC)
    pk, _ = store.create_run(db, run=rc)
    every = {s: [simulate.step_event(SPEC, r, s) for r in range(SPEC.world_size)] for s in range(8)}
    missing = {(5, 2), (6, 0)}  # rank 2 never sends step 5, rank 0 never sends step 6
    late = {(3, 6)}  # rank 6's step 3 comes after the compactor rolled step 3 up
    first = [e for s, evs in every.items() for e in evs
             if (s, e.rank) not in missing | late]  # fmt: skip
    rng.shuffle(first)
    for i in range(0, len(first), 9):
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, first[i : i + 9]))
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, first[:10]))  # replay
    stored = {s: [e for e in evs if (s, e.rank) not in missing | late] for s, evs in every.items()}
    _check(db, pk, stored)  # dirty: computed by the reader
    compactor = rollups.RollupWorker(db)
    assert compactor.flush() == 8
    _check(db, pk, stored)  # from the stored rollups
    late_events = [every[s][r] for s, r in late]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, late_events))
    stored[3] = every[3]
    _check(db, pk, stored)  # the late rank is in at once
    assert compactor.flush() == 1
    _check(db, pk, stored)
    # Totals: skipped steps and the all-gather histogram summed over every stored rank-step.
    skipped = dataclasses.replace(every[7][0], seq=100, step=8, skipped=True)
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [skipped]))
    compactor.flush()
    with db.read() as conn:
        totals = rollups.totals(conn, pk)
    assert totals[rollups.SKIPPED][0] == 1.0
    hist = [0] * (len(ev.LATENCY_BUCKETS) + 1)
    for e in [*[e for evs in stored.values() for e in evs], skipped]:
        for c in e.collectives:
            if c.op == "all_gather":
                hist = [a + b for a, b in zip(hist, c.buckets, strict=True)]
    assert totals["hist.all_gather"][1] == hist


def test_compactors_of_several_server_processes_never_compute_the_same_run(pg_server) -> None:
    """On PostgreSQL every server process runs a compactor: a run one of them has claimed is
    skipped by the others, and every step is rolled up once."""
    import uuid

    url = str(pg_server.create_database("compact_" + uuid.uuid4().hex[:10]))
    db = Database.open(url)
    try:
        pks = []
        for seed in (1, 2):
            spec = simulate.SimSpec(world_size=4, stage=3, spans_every=0, seed=seed)
            rc = simulate.run_create(spec)
            pks.append(store.create_run(db, run=rc)[0])
            for events in simulate.steps(spec, 6):
                store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
        a, b = rollups.RollupWorker(db), rollups.RollupWorker(db, claim_idle_s=0.0)
        try:
            assert a._claim(pks[0], time.time())  # A holds the first run
            assert b.flush() == 6  # B rolls up only the other run
            with db.read() as conn:
                assert rollups.dirty_in(conn, pks[0]) == list(range(6))
                assert rollups.dirty_in(conn, pks[1]) == []
            assert a._claim(pks[0], time.time())  # kept: a claim outlives the round
            assert b.flush() == 0
        finally:
            a.close()  # its claims are released before its session ends
        with db.read() as conn:  # at once, not when the closed session's backend exits
            held = conn.execute(
                text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = :pk"),
                {"pk": pks[0]},
            )
            assert held.scalar() == 0
        try:
            assert b.flush() == 6  # now the first run
            with db.read() as conn:
                assert rollups.dirty_in(conn, pks[0]) == []
            time.sleep(0.01)
            b.run_once()  # idle claims are released at the next round
            assert b.claims.held == frozenset()
        finally:
            b.close()
    finally:
        db.close()


def test_a_server_process_shares_its_part_of_a_run_another_process_rolls_up(pg_server) -> None:
    """Two server processes on one PostgreSQL (two engines, each with its own cache): the
    one whose compactor finds the run claimed publishes its part of the steps, and the
    claiming compactor rolls every step up from the two caches alone (no row read back), to
    the same rollups as from the rows."""
    import uuid

    from zerowatch.server.ingest import Ingestor
    from zerowatch.server.read.rollups.compute import summarize
    from zerowatch.server.read.rollups.rows import columns_from_rows

    url = str(pg_server.create_database("share_" + uuid.uuid4().hex[:10]))
    db_a, db_b = Database.open(url), Database.open(url)
    a, b = rollups.RollupWorker(db_a), rollups.RollupWorker(db_b)
    try:
        spec = simulate.SimSpec(world_size=6, stage=3, spans_every=0, seed=3)
        rc = simulate.run_create(spec)
        pk = store.create_run(db_a, run=rc)[0]
        steps = list(simulate.steps(spec, 5))
        ingest_a, ingest_b = Ingestor(db_a), Ingestor(db_b)
        try:
            for i, events in enumerate(steps):  # both processes store part of every step
                for ingestor, part in ((ingest_a, events[::2]), (ingest_b, events[1::2])):
                    ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, part))
                if i == 1:  # B's compactor finds the run A claimed: B shares from now on
                    assert a._claim(pk, time.time())
                    ingest_b.close()  # (what B's writer holds is in its cache)
                    assert b.run_once(settle=False) == 0
                    ingest_b = Ingestor(db_b)
        finally:
            ingest_a.close()
            ingest_b.close()
        cache_a, cache_b = db_a.caches.fresh, db_b.caches.fresh
        cache_b.flush_shared()
        assert (
            cache_b.shared is not None and cache_b.shared.published == 5 * 3
        )  # B's three ranks of every step
        want = {}
        with db_a.read() as conn:
            for events in steps:
                step = events[0].step
                want[step] = columns_from_rows(conn, pk, [step])[step]
        assert a.flush() == 5
        assert cache_a.taken == 5 * 3
        assert (cache_a.hits, cache_a.partial, cache_a.misses) == (5, 0, 0)
        with db_a.read() as conn:
            stored = rollups.read(conn, pk, None, extra=True)
        for step, cols in want.items():
            for name, st in summarize(cols, top_k=db_a.caches.tuning.top_k).items():
                assert stored[name][step] == pytest.approx(st), (step, name)
    finally:
        a.close()
        b.close()
        db_a.close()
        db_b.close()


def test_a_settled_step_waits_for_its_missing_ranks_unless_nobody_wrote_to_it_for_long(
    db: Database,
) -> None:
    spec = simulate.SimSpec(name="incomplete", world_size=4, stage=3)
    rc = simulate.run_create(spec)
    pk, _ = store.create_run(db, run=rc)
    events = [simulate.step_event(spec, r, 0) for r in range(3)]  # rank 3 is late for step 0
    events += [simulate.step_event(spec, r, 1) for r in range(4)]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    compactor = rollups.RollupWorker(db, settle_s=0.5, incomplete_s=30.0)
    now = time.time()
    assert compactor.run_once(now=now + 1) == 1  # step 1: every rank is in
    with db.read() as conn:
        assert rollups.dirty_in(conn, pk) == [0]
    assert compactor.run_once(now=now + 31) == 1  # step 0: nobody wrote to it for 30 s
    with db.read() as conn:
        assert rollups.dirty_in(conn, pk) == []
        assert rollups.read(conn, pk, ["step_time_s"])["step_time_s"][0].n == 3


def test_a_reader_computes_a_bounded_number_of_rank_steps_of_a_backlog(tuned_db: Any) -> None:
    # Ten dirty steps of an 8-rank run and a budget of 24 rank-steps: a reader computes the
    # newest 3 steps itself (24 // 8) and leaves the older 7 to the worker, whatever the
    # step bound (max_live_steps) would allow. Once rolled up, every step is there.
    db = tuned_db(max_live_rank_steps=24)
    spec = simulate.SimSpec(name="backlog", world_size=8, stage=3)
    rc = simulate.run_create(spec)
    pk, _ = store.create_run(db, run=rc)
    events = [simulate.step_event(spec, r, s) for s in range(10) for r in range(8)]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    with db.read() as conn:
        assert rollups.live_steps(conn, pk) == 3
        assert sorted(rollups.read(conn, pk, ["step_time_s"])["step_time_s"]) == [7, 8, 9]
    rollups.RollupWorker(db).flush()
    with db.read() as conn:
        got = rollups.read(conn, pk, ["step_time_s"])["step_time_s"]
        assert sorted(got) == list(range(10)) and all(st.n == 8 for st in got.values())


def test_in_a_backlog_a_reader_computes_a_quarter_of_its_share(tuned_db: Any) -> None:
    # A budget of 64 rank-steps of an 8-rank run: 8 steps. With 40 steps dirty (more than
    # backlog_factor x 8: the worker is behind) a reader computes the newest 2 itself.
    db = tuned_db(max_live_rank_steps=64)
    spec = simulate.SimSpec(name="storm", world_size=8, stage=3)
    rc = simulate.run_create(spec)
    pk, _ = store.create_run(db, run=rc)
    events = [simulate.step_event(spec, r, s) for s in range(40) for r in range(8)]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    with db.read() as conn:
        assert rollups.live_steps(conn, pk, dirty=32) == 8  # no backlog: its whole share
        assert rollups.live_steps(conn, pk, dirty=40) == 2
        assert sorted(rollups.read(conn, pk, ["step_time_s"])["step_time_s"]) == [38, 39]
        # The backlog is the run's: a read of a range of it computes as little.
        got = rollups.read(conn, pk, ["step_time_s"], step_from=30)["step_time_s"]
        assert sorted(got) == [38, 39]
    rollups.RollupWorker(db).run_once(settle=False)  # max_steps 256: the backlog is gone
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [
        simulate.step_event(spec, r, s) for s in range(40, 60) for r in range(8)
    ]))  # fmt: skip
    with db.read() as conn:
        got = rollups.read(conn, pk, ["step_time_s"], step_from=50)["step_time_s"]
        assert sorted(got) == list(range(52, 60))  # 20 dirty: no backlog, the whole share


def test_a_read_without_live_steps_gives_the_stored_rollups_alone(db: Database) -> None:
    """What /metrics reads for a run that has rolled-up steps: a rank arriving late marks
    a step dirty again, and the read keeps the stored rollup until the compactor's pass."""
    spec = simulate.SimSpec(name="late", world_size=3, stage=3)
    rc = simulate.run_create(spec)
    pk, _ = store.create_run(db, run=rc)
    first = [simulate.step_event(spec, r, s) for s in range(3) for r in range(2)]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, first))
    with db.read() as conn:
        assert rollups.read(conn, pk, ["step_time_s"], live=False)["step_time_s"] == {}
        assert sorted(rollups.read(conn, pk, ["step_time_s"])["step_time_s"]) == [0, 1, 2]
    rollups.RollupWorker(db).flush()
    late = [simulate.step_event(spec, 2, s) for s in range(3)]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, late))
    with db.read() as conn:
        stored = rollups.read(conn, pk, ["step_time_s"], live=False)["step_time_s"]
        current = rollups.read(conn, pk, ["step_time_s"])["step_time_s"]
    assert [st.n for st in stored.values()] == [2, 2, 2]
    assert [st.n for st in current.values()] == [3, 3, 3]


def test_retention_thins_old_rank_rows_with_their_collectives_and_keeps_every_rollup(
    db: Database,
) -> None:
    """Retention (full_steps 10, every 5) over 30 steps: the per-rank rows of steps 0-19
    not on the every-5th grid go, each step's collectives and spans with them, steps 20-29
    keep all; the rollups keep every step, equal to those computed before the thinning."""
    spec = simulate.SimSpec(world_size=4, stage=3, spans_every=1)
    rc = simulate.run_create(spec)
    pk, _ = store.create_run(db, run=rc)
    for evs in simulate.steps(spec, 30):
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, evs))
    compactor = rollups.RollupWorker(db, retention=rollups.Retention(full_steps=10, every=5))
    assert compactor.flush() == 30
    with db.read() as conn:
        before = rollups.read(conn, pk, ["step_time_s", "collective.all_gather.latency_s"])
    assert compactor.apply_retention() == 4 * 16  # steps 1-4, 6-9, 11-14, 16-19 of 4 ranks
    kept = [s for s in range(30) if s >= 20 or s % 5 == 0]
    with db.read() as conn:
        steps = conn.execute(select(m.steps.c.rank, m.steps.c.seq, m.steps.c.step)).all()
        colls = conn.execute(select(m.collectives.c.rank, m.collectives.c.seq)).all()
        spans = conn.execute(select(m.spans.c.step)).scalars().all()
        after = rollups.read(conn, pk, ["step_time_s", "collective.all_gather.latency_s"])
    assert sorted({s for _, _, s in steps}) == kept and len(steps) == 4 * len(kept)
    ops = len({c.op for c in simulate.step_event(spec, 0, 0).collectives})
    assert sorted(colls) == sorted((r, q) for r, q, _ in steps for _ in range(ops))
    assert sorted(set(spans)) == kept
    assert after == before and sorted(after["step_time_s"]) == list(range(30))
