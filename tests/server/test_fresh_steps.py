"""The roll-up worker's shortcut (read/rollups/fresh.py): steps rolled up from the metric columns the
ingest writer kept equal, to the last bit, the rollups computed from the stored rows, with
late, missing and replayed ranks and with rank-steps another server process stored, on
SQLite and PostgreSQL; the rows are used wherever the cache does not hold every rank-step."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.ingest import Ingestor
from zerowatch.server.read import rollups
from zerowatch.server.read.rollups import ReadTuning, fresh, reader
from zerowatch.server.read.rollups.columns import N_BUCKETS, Block
from zerowatch.server.read.rollups.shared_blocks import pack, unpack

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=6, stage=3, offload_optimizer=True, straggler_rank=2,
                        spans_every=3)  # fmt: skip


def _from_rows(db: Database, pk: int, steps: list[int]) -> dict:
    """`rollups.compute` through another handle on the database, whose cache is empty: every
    step from its rows."""
    other = Database.open(db.engine.url.render_as_string(hide_password=False))
    try:
        with other.read() as conn:
            return rollups.compute(conn, pk, steps)
    finally:
        other.close()


def _events(rng: random.Random, steps: int) -> list[ev.StepEvent]:
    out = []
    for s in range(steps):
        for r in range(SPEC.world_size):
            e = simulate.step_event(SPEC, r, s)
            if rng.random() < 0.3:  # user scalars on some rank-steps only
                e = dataclasses.replace(e, scalars={"loss_ema": rng.random()})
            out.append(e)
    return out


def test_rollups_from_the_writers_columns_equal_those_from_the_rows(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(11)
    rc = simulate.run_create(SPEC)
    pk, _ = store.create_run(db, run=rc)
    events = _events(rng, 8)
    missing = {(2, 5)}  # (step, rank) never sent
    # Stored by another server process (not in this cache): two ranks of step 3, step 7.
    other = {(3, 0), (3, 4), *((7, r) for r in range(SPEC.world_size))}
    restarted = {(6, 1)}  # rank 1 restarted and sent step 6 again with a newer seq
    mine = [e for e in events if (e.step, e.rank) not in missing | other]
    rng.shuffle(mine)
    ingestor = Ingestor(db)
    try:
        for i in range(0, len(mine), 5):
            ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, mine[i : i + 5]))
        # A replay of stored events changes nothing and is not kept twice.
        ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, mine[:7]))
        again = [dataclasses.replace(e, seq=e.seq + 1000, step_time_s=e.step_time_s * 2)
                 for e in events if (e.step, e.rank) in restarted]  # fmt: skip
        ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, again))
    finally:
        ingestor.close()
    second = Database.open(db.engine.url.render_as_string(hide_password=False))
    try:
        other_events = [e for e in events if (e.step, e.rank) in other]
        store.ingest_batch(second, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, other_events))
    finally:
        second.close()

    cache = db.caches.fresh
    steps = list(range(8))
    with db.read() as conn:
        got = rollups.compute(conn, pk, steps)
    want = _from_rows(db, pk, steps)
    assert sorted(got) == sorted(want) == steps
    for step in steps:
        assert got[step].keys() == want[step].keys(), step
        for name, st in want[step].items():
            assert got[step][name] == st, (step, name)
    # Step 7 only from its rows; step 3 from the writer's columns and the rows of the two
    # ranks this process never saw; every other step from the writer's columns (the
    # restarted rank's newer row included).
    assert (cache.hits, cache.partial, cache.misses) == (6, 1, 1)
    assert got[6]["step_time_s"].n == SPEC.world_size
    assert got[2]["step_time_s"].n == SPEC.world_size - 1

    compactor = rollups.RollupWorker(db)
    assert compactor.flush() == 8
    assert len(cache) == 0  # rolled up: forgotten
    with db.read() as conn:
        stored = rollups.read(conn, pk, None, extra=True)
    for step in steps:
        for name, st in want[step].items():
            assert stored[name][step] == pytest.approx(st), (step, name)


def test_a_full_cache_keeps_no_more_rank_steps_and_their_steps_take_the_rows(
    sqlite_url: str,
) -> None:
    # Room for three steps; every group converted at once.
    tuning = ReadTuning(fresh_max_rank_steps=3 * SPEC.world_size, fresh_convert_rows=1)
    db = Database.open(sqlite_url, tuning=tuning)
    try:
        rc = simulate.run_create(SPEC)
        pk, _ = store.create_run(db, run=rc)
        cache = db.caches.fresh
        ingestor = Ingestor(db)
        try:
            for s in range(5):
                batch = [simulate.step_event(SPEC, r, s) for r in range(SPEC.world_size)]
                ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, batch))
        finally:
            ingestor.close()
        assert len(cache) == 3 * SPEC.world_size
        with db.read() as conn:
            got = rollups.compute(conn, pk, range(5))
        # Steps 0-2 filled it; steps 3 and 4 were not kept.
        assert (cache.hits, cache.misses, cache.refused) == (3, 2, 2 * SPEC.world_size)
        want = _from_rows(db, pk, list(range(5)))
        assert got == want
    finally:
        db.close()


def test_steps_older_than_max_age_are_forgotten(sqlite_url: str) -> None:
    """With several server processes another one's worker may roll a step up: this
    process's copy of it goes after `fresh_max_age_s`, not never."""
    db = Database.open(sqlite_url, tuning=ReadTuning(fresh_convert_rows=1))
    try:
        rc = simulate.run_create(SPEC)
        store.create_run(db, run=rc)
        cache = db.caches.fresh
        ingestor = Ingestor(db)
        try:
            batch = [simulate.step_event(SPEC, r, 0) for r in range(SPEC.world_size)]
            ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, batch))
            ingestor.close()  # the writer hands rows to the cache after answering: wait for it
            assert len(cache) == SPEC.world_size
            cache.max_age_s = 0.0
            batch = [simulate.step_event(SPEC, r, 1) for r in range(SPEC.world_size)]
            ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, batch))
        finally:
            ingestor.close()
        assert len(cache) == 0
    finally:
        db.close()


def test_a_dirty_step_is_computed_once_per_version_of_its_mark(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run page reads the same newest dirty steps several times: computed once, until a
    late rank changes the step."""
    rc = simulate.run_create(SPEC)
    pk, _ = store.create_run(db, run=rc)
    first = [simulate.step_event(SPEC, r, s) for s in range(3) for r in range(SPEC.world_size - 1)]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, first))
    computed: list[list[int]] = []
    compute = reader.compute

    def counted(conn, pk_, steps, **kw):  # type: ignore[no-untyped-def]
        computed.append(sorted(steps))
        return compute(conn, pk_, steps, **kw)

    monkeypatch.setattr(reader, "compute", counted)
    with db.read() as conn:
        a = rollups.read(conn, pk, ["step_time_s"])
        b = rollups.read(conn, pk, ["step_time_s", "busy_s"])
    assert computed == [[0, 1, 2]]  # the second read took the first one's results
    assert a["step_time_s"] == b["step_time_s"]
    assert all(st.n == SPEC.world_size - 1 for st in b["step_time_s"].values())
    late = [simulate.step_event(SPEC, SPEC.world_size - 1, 1)]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, late))
    with db.read() as conn:
        c = rollups.read(conn, pk, ["step_time_s"])["step_time_s"]
    assert computed == [[0, 1, 2], [1]]  # only the step the late rank changed
    assert c[1].n == SPEC.world_size and c[0] == a["step_time_s"][0]
    monkeypatch.undo()
    with db.read() as conn:
        fresh_read = rollups.compute(conn, pk, [0, 1, 2])
    assert {st: v["step_time_s"] for st, v in fresh_read.items()} == c


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_step_rolled_up_in_the_middle_of_a_read_is_not_lost(
    db: Database, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The worker commits between two statements of a read (just before or just after
    the dirty marks are read): the step is still read, from its rows or its rollups, with
    every metric."""
    rc = simulate.run_create(SPEC)
    pk, _ = store.create_run(db, run=rc)
    events = [simulate.step_event(SPEC, r, 0) for r in range(SPEC.world_size)]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    compactor = rollups.RollupWorker(db)
    marks = reader.dirty_versions

    def then_compact(conn, pk_, **kw):  # type: ignore[no-untyped-def]
        if when == "before":
            assert compactor.flush() == 1  # commits while the read goes on
        got = marks(conn, pk_, **kw)
        if when == "after":
            assert compactor.flush() == 1
        return got

    monkeypatch.setattr(reader, "dirty_versions", then_compact)
    with db.read() as conn:
        got = rollups.read(conn, pk, None, steps_in=[0])
    assert got["step_time_s"][0].n == SPEC.world_size
    assert got["collective.all_gather.busbw"][0].n == SPEC.world_size


def test_held_finds_each_newest_row_with_the_later_copy_winning() -> None:
    """`fresh._held` (which cached rank-step is each rank's newest row): the int64-key path
    and the dict path for ranks or seqs past that key agree, and a (rank, seq) kept twice
    (stored again after retention deleted it) is found in its later piece."""
    import numpy as np

    rng = np.random.default_rng(7)

    def piece(ranks: list[int], seqs: list[int], at0: int) -> Any:
        at = np.arange(at0, at0 + len(ranks), dtype=np.int64)
        return fresh._Piece(
            None, at, np.array(ranks, dtype=np.int64), np.array(seqs, dtype=np.int64)
        )  # type: ignore[arg-type]

    for offset in (0, 1 << 41):  # seqs within the key, and past it (the dict)
        ranks = rng.permutation(64)
        seqs = rng.integers(0, 5, 64) + offset
        pieces = [piece(ranks[:40].tolist(), seqs[:40].tolist(), 0),
                  piece(ranks[30:].tolist(), seqs[30:].tolist(), 100)]  # fmt: skip
        ask_ranks = np.arange(70, dtype=np.int64)
        ask_seqs = np.full(70, offset, dtype=np.int64)
        ask_seqs[ranks] = seqs
        ask_seqs[5] += 1  # rank 5: a newer row this cache does not hold
        which, at = fresh._held(pieces, ask_ranks, ask_seqs)
        for r in range(70):
            if r >= 64 or r == 5:
                assert which[r] == -1, r
                continue
            i = int(np.flatnonzero(ranks == r)[0])
            want = (1, 100 + i - 30) if i >= 30 else (0, i)  # the later copy wins
            assert (which[r], at[r]) == want, r


def test_rank_steps_another_process_published_are_used_like_its_own(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two server processes on one database: the one that does not roll the run up shares
    it (its worker found the run claimed), so what it held and what it stores from then
    on is published; the other's worker takes that into its cache and matches it by
    (rank, seq) like its own, with the rows of a writer that published nothing, and never a
    published row that a newer one replaced. The rollups equal those from the rows."""
    from sqlalchemy import func, select
    from zerowatch.server import models as m

    rng = random.Random(5)
    rc = simulate.run_create(SPEC)
    pk, _ = store.create_run(db, run=rc)
    events = _events(rng, 6)
    theirs = [e for e in events if e.rank % 2]  # the other process's ranks
    third = {(4, 1), (4, 3)}  # stored without a cache (rows only)
    replaced = (5, 3)  # stored by the other process, then again by this one, newer
    second = Database.open(
        db.engine.url.render_as_string(hide_password=False), tuning=ReadTuning(share_delay_s=0)
    )
    try:
        other_cache = second.caches.fresh
        assert other_cache.shared is not None
        ingestor = Ingestor(second)
        try:
            early = [e for e in theirs if e.step < 2]
            ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, early))
        finally:
            ingestor.close()
        assert len(other_cache) == len(early) and other_cache.shared.published == 0
        other_cache.share(pk)  # its compactor found the run claimed
        assert other_cache.shared.published == len(early)
        late = [e for e in theirs if e.step >= 2 and (e.step, e.rank) not in third]
        ingestor = Ingestor(second)
        try:
            for i in range(0, len(late), 4):
                ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, late[i : i + 4]))
        finally:
            ingestor.close()
        other_cache.flush_shared()
        assert other_cache.shared.published == len(early) + len(late)
        rows_only = [e for e in theirs if (e.step, e.rank) in third]
        store.ingest_batch(second, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, rows_only))
        other_cache.retain(pk, [5])  # the others were rolled up elsewhere
        assert len(other_cache) == len([e for e in theirs if e.step == 5])
    finally:
        second.close()
    mine = [e for e in events if not e.rank % 2]
    mine += [dataclasses.replace(e, seq=e.seq + 1000, step_time_s=e.step_time_s * 3)
             for e in theirs if (e.step, e.rank) == replaced]  # fmt: skip
    ingestor = Ingestor(db)
    try:
        ingestor.submit(run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, mine))
    finally:
        ingestor.close()

    cache = db.caches.fresh
    with db.write() as conn:
        assert cache.take_shared(conn, pk) == len(early) + len(late)
    with db.read() as conn:  # taken once
        assert conn.execute(select(func.count()).select_from(m.fresh_blocks)).scalar() == 0
    steps = list(range(6))
    with db.read() as conn:
        got = rollups.compute(conn, pk, steps)
    want = _from_rows(db, pk, steps)
    assert got == want
    # Every step from the columns but step 4, whose two rows-only ranks came from the rows.
    assert (cache.hits, cache.partial, cache.misses) == (5, 1, 0)
    assert got[5]["step_time_s"].max == max(
        [e.step_time_s for e in events if e.step == 5 and (e.step, e.rank) != replaced]
        + [3 * e.step_time_s for e in events if (e.step, e.rank) == replaced]
    )
    assert rollups.RollupWorker(db).flush() == 6


def test_pack_gives_back_every_value_and_old_blocks_are_swept(sqlite_url: str) -> None:
    import numpy as np
    from sqlalchemy import func, insert, select
    from zerowatch.server import models as m

    rng = np.random.default_rng(3)
    n = 9
    hists = {"all_gather": rng.integers(0, 5, (n, N_BUCKETS)),
             "all_reduce": rng.integers(0, 2**40, (n, N_BUCKETS))}  # fmt: skip
    sums = {op: (rng.random(2 * n), rng.integers(0, n, 2 * n)) for op in hists}
    values = rng.random((3, n))
    values[1, 4] = np.nan
    block = Block(["a", "b", "c"], values, hists, sums)
    at = np.array([1, 4, 7], dtype=np.int64)
    steps, ranks, seqs = np.array([4, 4, 5]), np.array([3, 0, 9]), np.array([2**41, 5, 6])
    data = pack(block, at, steps, ranks, seqs)
    back, got_steps, got_ranks, got_seqs = unpack(data)
    assert got_steps.tolist() == [4, 4, 5] and got_ranks.tolist() == [3, 0, 9]
    assert got_seqs.tolist() == [2**41, 5, 6] and back.names == ["a", "b", "c"]
    np.testing.assert_array_equal(back.values, values[:, at])
    for op, h in hists.items():
        np.testing.assert_array_equal(back.hists[op], h[at])
        assert back.hists[op].dtype == np.int64
        lats, rows = sums[op]
        sel = np.isin(rows, at)
        got_lats, got_rows = back.latency_sums[op]
        np.testing.assert_array_equal(got_lats, lats[sel])
        np.testing.assert_array_equal(at[got_rows], rows[sel])
    with pytest.raises(ValueError, match="holds"):
        unpack(data + b"x")

    db = Database.open(sqlite_url)
    try:
        b = m.fresh_blocks
        with db.write() as conn:
            for created in (1.0, 1000.0):
                conn.execute(insert(b).values(run=1, n=3, created=created, data=data))
        assert (
            rollups.RollupWorker(db).sweep_shared(1000.0 + db.caches.tuning.fresh_max_age_s - 1)
            == 1
        )
        with db.read() as conn:
            assert conn.execute(select(func.count()).select_from(b)).scalar() == 1
    finally:
        db.close()
