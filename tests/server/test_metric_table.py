"""The metric table (server/read/metric_table.py): each step metric and collective field is
defined once, and every reader agrees with that definition: a rank's value read with SQL
(a per-rank series) equals the numpy extractor's (the rollups), on SQLite and PostgreSQL;
the store writes what the table names."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from zerowatch.server import models as m
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read import metric_table, series
from zerowatch.server.read.vocabulary import metric_unit, rank_table

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=3, stage=3, offload_optimizer=True, straggler_rank=1)


def _stored_run(db: Database) -> int:
    rc = simulate.run_create(SPEC)
    pk, _ = store.create_run(db, run=rc)
    events = [e for step in simulate.steps(SPEC, 3) for e in step]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    return pk


def _by_rank_step(conn, pk: int, metric: str) -> dict[tuple[int, int], float]:  # type: ignore[no-untyped-def]
    rows = series.rank_rows(conn, pk, metric, ranks=None, step_from=None, step_to=None)
    return {(int(r), int(s)): float(v) for r, s, v in rows if v is not None}


def test_every_step_metric_and_collective_field_reads_the_same_with_sql_and_numpy(
    db: Database,
) -> None:
    pk = _stored_run(db)
    names = [metric.name for metric in metric_table.STEP_METRICS] + [
        f"collective.{op}.{f.name}" for op in ("all_gather", "reduce_scatter")
        for f in metric_table.COLLECTIVE_FIELDS
    ]  # fmt: skip
    s, c = m.steps.c, m.collectives.c
    with db.read() as conn:
        rows = conn.execute(
            select(*(s[n] for n in metric_table.ROLLUP_COLUMNS)).where(s.run == pk)
        ).all()
        colls = conn.execute(select(c).where(c.run == pk)).all()
        by_key: dict[tuple[int, int], list] = {(r.rank, r.seq): [] for r in rows}
        for cr in colls:
            by_key[(cr.rank, cr.seq)].append(cr._mapping)
        table = rank_table([r._mapping for r in rows], [by_key[(r.rank, r.seq)] for r in rows])
        for name in names:
            column = table[name].tolist() if name in table else [None] * len(rows)
            want = {
                (int(r.rank), int(r.step)): float(v)
                for r, v in zip(rows, column, strict=True)
                if v is not None and v == v
            }
            assert _by_rank_step(conn, pk, name) == pytest.approx(want), name
        # Every collective field and most step metrics held values (the simulator sends no
        # CPU times, for one).
        assert all(name in table for name in names if name.startswith("collective."))
        assert sum(name in table for name in names) >= len(names) // 2


def test_the_store_writes_the_columns_the_metric_table_names() -> None:
    e = next(iter(simulate.steps(SPEC, 1)))[0]
    row = store._step_row(7, e)
    assert len(row) == len(store.STEP_COLUMNS)
    values = dict(zip(store.STEP_COLUMNS, row, strict=True))
    for name in metric_table.METRIC_COLUMNS:
        assert values[name] == getattr(e, name), name
    assert values["phases"] == e.phases and values["gpu"] == e.gpu
    assert set(metric_table.ROLLUP_COLUMNS) <= set(store.STEP_COLUMNS)


def test_each_metric_has_its_unit_from_the_table() -> None:
    for metric in metric_table.STEP_METRICS:
        assert metric_unit(metric.name) == metric.unit
    for f in metric_table.COLLECTIVE_FIELDS:
        assert metric_unit(f"collective.all_reduce.{f.name}") == f.unit
    assert metric_unit("collective.all_reduce.busbw") == "B/s"
    assert metric_unit("phase.forward") == "s" and metric_unit("memory.peak") == "B"
    assert metric_unit("gpu.power_w") == "W" and metric_unit("offload.d2h.bytes") == "B"
