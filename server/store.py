"""Writes: create a run, ingest batches of events, delete a run.

Ingest writes inside a transaction: `ingest_many` writes several batches in its caller's
(the ingest writer's group commit, server/ingest.py) with one statement per table,
`ingest_batch` one batch in a transaction of its own. Each batch is validated before
anything of it is written, so a batch is stored whole or not at all. Idempotency rests on
the primary key (run, rank, seq) of `steps`: step rows go in with `INSERT ... ON CONFLICT
DO NOTHING RETURNING run, rank, seq` (SQLite and PostgreSQL alike, through server/bulk.py),
and only the returned, newly stored steps get their collectives, spans and checkpoint calls
written, count towards the per-rank counters and mark their step dirty for the rollups; an
end event the rank's state already holds (the same seq) is a duplicate too. A replayed
batch therefore changes nothing.

Checks that a JSON schema cannot express (the run id in the body matches the URL, ranks lie
inside the world size, a histogram has one count per bucket: server/checks.py, whose names
this module re-exports) raise `BatchError` naming the field, before anything of the batch
is written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from sqlalchemy import (
    Connection,
    Float,
    bindparam,
    delete,
    func,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from zerowatch.server import models as m
from zerowatch.server.bulk import TupleInsert
from zerowatch.server.checks import (
    MAX_JOB_CHARS,
    MAX_RUN_ID_CHARS,
    MAX_SPANS_PER_STEP,
    BatchError,
    check_schema_version,
    validate_batch,
    validate_run_create,
    validate_run_id,
)
from zerowatch.server.db import Database
from zerowatch.server.read.metric_table import FAMILIES, METRIC_COLUMNS

from zerowatch import events as ev


class RunGone(Exception):
    """The run was deleted while a batch for it was being written."""


@dataclass
class RunRef:
    """What ingest needs to know about a run."""

    pk: int
    run_id: str
    world_size: int
    status: str


@dataclass
class IngestResult:
    """The outcome of one batch."""

    accepted: int = 0
    duplicates: int = 0
    #: The step events this batch stored (not duplicates): its accepted count and newest time.
    new_steps: list[ev.StepEvent] = field(default_factory=list)
    #: The end events that changed a rank's state.
    new_ends: list[ev.EndEvent] = field(default_factory=list)
    #: The run's status after the batch ("running", "finished" or "failed").
    status: str = "running"
    last_event_at: float | None = None


#: A newly stored rank-step: its steps row and its collectives rows (tuples in the order of
#: STEP_COLUMNS and COLLECTIVE_COLUMNS; JSON columns as Python values).
StoredRankStep = tuple[tuple[Any, ...], list[tuple[Any, ...]]]


def _insert(conn: Connection, table: Any) -> Any:
    return (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(table)


# -- runs ---------------------------------------------------------------------------------


def create_run(db: Database, *, run: ev.RunCreate, now: float | None = None) -> tuple[int, bool]:
    """Store `run` unless a run with its run_id exists.

    Returns:
        (the run's primary key, whether it was created by this call).
    """
    validate_run_create(run)
    now = time.time() if now is None else now
    values = {
        "run_id": run.run_id,
        "name": run.name,
        "project": run.project,
        "tags": list(run.tags),
        "status": "running",
        "zero_stage": run.zero_stage,
        "offload_optimizer": run.offload_optimizer,
        "offload_param": run.offload_param,
        "precision": run.precision,
        "world_size": run.world_size,
        "engine": run.engine,
        "engine_info": run.engine_info,
        "config": run.config,
        "param_count": run.param_count,
        "hosts": list(run.hosts),
        "torch_version": run.torch_version,
        "zerowatch_version": run.zerowatch_version,
        "theory": run.theory,
        "theory_comm": run.theory_comm,
        "started_at": run.started_at or now,
        "job": run.job,
        "created_at": now,
        "last_event_at": None,
        "ended_at": None,
    }
    # Every rank of a job creates its run (and again after an outage): an existing run is
    # answered from a read, without waiting for the write lock behind ingest.
    with db.read() as conn:
        existing = conn.execute(select(m.runs.c.id).where(m.runs.c.run_id == run.run_id))
        pk = existing.scalar()
    if pk is not None:
        return int(pk), False
    with db.write() as conn:
        stmt = (
            _insert(conn, m.runs)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["run_id"])
            .returning(m.runs.c.id)
        )
        pk = conn.execute(stmt).scalar()
        if pk is None:
            existing = conn.execute(select(m.runs.c.id).where(m.runs.c.run_id == run.run_id))
            return int(existing.scalar_one()), False
        tags = sorted(set(run.tags))
        if tags:
            conn.execute(m.run_tags.insert(), [{"run": pk, "tag": t} for t in tags])
        return int(pk), True


def run_ref(conn: Connection, *, run_id: str) -> RunRef | None:
    """The run's key, world size and stored status, or None if unknown."""
    row = conn.execute(
        select(m.runs.c.id, m.runs.c.world_size, m.runs.c.status).where(m.runs.c.run_id == run_id)
    ).first()
    if row is None:
        return None
    return RunRef(pk=row.id, run_id=run_id, world_size=row.world_size, status=row.status)


def delete_run(db: Database, *, run_id: str) -> bool:
    """Delete a run and everything stored for it. Returns False if it did not exist."""
    with db.write() as conn:
        ref = run_ref(conn, run_id=run_id)
        if ref is None:
            return False
        for table in (
            m.spans, m.collectives, m.steps, m.rank_states, m.run_tags, m.step_rollups,
            m.dirty_steps, m.run_totals, m.fresh_blocks, m.heartbeats, m.checkpoints,
        ):  # fmt: skip
            conn.execute(delete(table).where(table.c.run == ref.pk))
        conn.execute(delete(m.runs).where(m.runs.c.id == ref.pk))
    db.caches.fresh.forget_run(ref.pk)
    return True


# -- ingest -------------------------------------------------------------------------------


#: Column order of the rows the writer builds (store.ingest_many), one tuple per row: the
#: rank-step's keys, the columns of the metric table's step metrics (each an attribute of
#: the event of the same name), its families' JSON columns, the nonfinite forensics.
STEP_COLUMNS = (
    "run", "rank", "seq", "step", "time", *METRIC_COLUMNS, *FAMILIES.values(), "forensics",
)  # fmt: skip
#: A step event's values of the metric table's columns, in their order.
_metric_values = attrgetter(*METRIC_COLUMNS)
COLLECTIVE_COLUMNS = (
    "run", "rank", "seq", "op", "purpose", "step", "count", "bytes", "latency_sum_s",
    "latency_max_s", "buckets", "world_size", "algbw", "busbw", "async_count",
)  # fmt: skip
SPAN_COLUMNS = ("run", "rank", "seq", "step", "spans")
RANK_COLUMNS = ("run", "rank", "steps", "last_step", "last_time", "dropped_events",
                "agent_errors", "host", "local_rank")  # fmt: skip
DIRTY_COLUMNS = ("run", "step", "version", "since")


def _step_row(pk: int, e: ev.StepEvent) -> tuple[Any, ...]:
    offload = {
        o.direction: {
            "bytes": o.bytes,
            "seconds": o.seconds,
            "bandwidth": o.bandwidth_bytes_per_s or (o.bytes / o.seconds if o.seconds > 0 else 0.0),
        }
        for o in e.offload
    }
    # The dataclass itself: the JSON column writes it as the dict of its fields (orjson
    # serialises dataclasses natively), and rank_table reads its fields.
    memory: ev.MemoryStats | dict[str, Any] = e.memory if e.memory is not None else {}
    # In the order of FAMILIES: phases, parts, scalars, offload, memory, gpu.
    return (
        pk, e.rank, e.seq, e.step, e.time, *_metric_values(e), e.phases, e.parts, e.scalars,
        offload, memory, e.gpu, e.forensics,
    )  # fmt: skip


def _collective_rows(pk: int, e: ev.StepEvent) -> list[tuple[Any, ...]]:
    records = e.collectives
    # The usual case, kept as it came: one record per (op, purpose), bandwidths filled in.
    unique = len({(c.op, c.purpose) for c in records}) == len(records)
    if not (unique and all(c.algbw_bytes_per_s and c.busbw_bytes_per_s for c in records)):
        by_key: dict[tuple[str, str], list[ev.CollectiveStats]] = {}
        for c in records:
            by_key.setdefault((c.op, c.purpose), []).append(c)
        records = [_one_record(op, purpose, cs) for (op, purpose), cs in by_key.items()]
    return [
        (pk, e.rank, e.seq, c.op, c.purpose, e.step, c.count, c.bytes, c.latency_sum_s,
         c.latency_max_s, c.buckets, c.world_size, c.algbw_bytes_per_s, c.busbw_bytes_per_s,
         c.async_count)
        for c in records
    ]  # fmt: skip


def _one_record(op: str, purpose: str, cs: list[ev.CollectiveStats]) -> ev.CollectiveStats:
    """The step's record of one (op, purpose): the same pair twice in one step is added up,
    and bandwidths a client left out are filled in, both by the one builder of a step's
    record."""
    c = cs[0]
    if len(cs) == 1 and c.algbw_bytes_per_s and c.busbw_bytes_per_s:
        return c
    return ev.CollectiveStats.of_calls(
        op, purpose, world_size=c.world_size, count=sum(x.count for x in cs),
        nbytes=sum(x.bytes for x in cs), latency_sum_s=sum(x.latency_sum_s for x in cs),
        latency_max_s=max(x.latency_max_s for x in cs),
        buckets=[sum(b) for b in zip(*(x.buckets for x in cs), strict=True)],
        async_count=sum(x.async_count for x in cs),
    )  # fmt: skip


class _Statements:
    """The ingest statements of one dialect, built once (building them costs more than
    running them for a small batch). `insert(conn, name, rows)` runs the insert `name`
    (steps, collectives, spans, ranks, dirty) over `rows` (tuples in the order of that
    table's *_COLUMNS) through bulk.TupleInsert."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        ins = pg_insert if dialect == "postgresql" else sqlite_insert
        greatest = func.greatest if dialect == "postgresql" else func.max
        rs = m.rank_states
        up = ins(rs)
        dirty = ins(m.dirty_steps)
        statements: dict[str, tuple[Any, tuple[str, ...]]] = {
            "steps": (
                ins(m.steps)
                .on_conflict_do_nothing(index_elements=["run", "rank", "seq"])
                .returning(m.steps.c.run, m.steps.c.rank, m.steps.c.seq),
                STEP_COLUMNS,
            ),
            "collectives": (
                ins(m.collectives).on_conflict_do_nothing(
                    index_elements=["run", "rank", "seq", "op", "purpose"]
                ),
                COLLECTIVE_COLUMNS,
            ),
            "spans": (
                ins(m.spans).on_conflict_do_nothing(index_elements=["run", "rank", "seq"]),
                SPAN_COLUMNS,
            ),
            "ranks": (
                up.on_conflict_do_update(
                    index_elements=["run", "rank"],
                    set_={
                        "steps": rs.c.steps + up.excluded.steps,
                        "last_step": greatest(
                            func.coalesce(rs.c.last_step, -1), up.excluded.last_step
                        ),
                        "last_time": greatest(
                            func.coalesce(rs.c.last_time, 0.0), up.excluded.last_time
                        ),
                        "host": func.coalesce(up.excluded.host, rs.c.host),
                        "local_rank": func.coalesce(up.excluded.local_rank, rs.c.local_rank),
                    },
                ),
                RANK_COLUMNS,
            ),
            "dirty": (
                dirty.on_conflict_do_update(
                    index_elements=["run", "step"],
                    set_={"version": m.dirty_steps.c.version + 1, "since": dirty.excluded.since},
                ),
                DIRTY_COLUMNS,
            ),
        }
        self._inserts = {
            name: TupleInsert(stmt, columns, dialect)
            for name, (stmt, columns) in statements.items()
        }
        newest = bindparam("newest", type_=Float)
        self.touch = (
            update(m.runs)
            .where(m.runs.c.id == bindparam("pk"))
            .values(last_event_at=greatest(func.coalesce(m.runs.c.last_event_at, newest), newest))
        )

    def insert(self, conn: Connection, name: str, rows: list[tuple[Any, ...]]) -> list[Any]:
        return self._inserts[name].execute(conn, rows)


_STATEMENTS: dict[str, _Statements] = {}


def _stmts(conn: Connection) -> _Statements:
    name = conn.dialect.name
    if name not in _STATEMENTS:
        _STATEMENTS[name] = _Statements(name)
    return _STATEMENTS[name]


def ingest_batch(
    db: Database,
    *,
    run_id: str,
    batch: ev.EventBatch,
    trace_sample_every: int = 1,
    now: float | None = None,
) -> IngestResult | None:
    """Store a batch of events for `run_id` in one transaction.

    Args:
        db: the database.
        run_id: the run named by the URL.
        batch: the validated request body.
        trace_sample_every: keep spans of steps with `step % trace_sample_every == 0`.
        now: the server's clock (event times are capped at it).

    Returns:
        What was stored, or None when the run does not exist.

    Raises:
        BatchError: the batch is inconsistent with the run (nothing is stored).
    """
    now = time.time() if now is None else now
    try:
        with db.write() as conn:
            ref = run_ref(conn, run_id=run_id)
            if ref is None:
                return None
            return _ingest(conn, ref, batch, trace_sample_every=trace_sample_every, now=now)
    except RunGone:
        return None


def _ingest(
    conn: Connection, ref: RunRef, batch: ev.EventBatch, *, trace_sample_every: int, now: float
) -> IngestResult:
    """Write one batch inside the caller's transaction (see `ingest_many`).

    Raises:
        BatchError: the batch is inconsistent with its run; nothing of it was written.
    """
    (out,) = ingest_many(conn, [(ref, batch)], trace_sample_every=trace_sample_every, now=now)
    if isinstance(out, BatchError):
        raise out
    return out


def ingest_many(
    conn: Connection,
    items: list[tuple[RunRef, ev.EventBatch]],
    *,
    trace_sample_every: int,
    now: float,
    kept: list[StoredRankStep] | None = None,
) -> list[IngestResult | BatchError]:
    """Write several batches inside the caller's transaction, with one statement per table.

    `kept`, when given, gets the rows of every newly stored rank-step (the ingest writer
    hands them to the fresh-steps cache, read/rollups/fresh.py, once the transaction is
    committed).

    Each batch is validated first: a bad one gets its BatchError in the returned list and
    writes nothing; the others are written together (their rows in one multi-row INSERT per
    table), so a group of small batches costs about what one big batch does. Duplicates
    are decided in batch order: an event repeated within or across the batches counts as
    stored for the first batch that carries it and as a duplicate for the others.

    Raises:
        RunGone: a run was deleted meanwhile (the caller rolls back).
    """
    st = _stmts(conn)
    results: list[IngestResult | BatchError] = []
    valid: list[tuple[RunRef, ev.EventBatch, IngestResult]] = []
    for ref, batch in items:
        try:
            validate_batch(batch, run_id=ref.run_id, world_size=ref.world_size)
        except BatchError as err:
            results.append(err)
            continue
        res = IngestResult()
        results.append(res)
        valid.append((ref, batch, res))

    seen: set[tuple[int, int, int]] = set()
    owners: dict[tuple[int, int, int], tuple[IngestResult, ev.StepEvent]] = {}
    ends: list[tuple[RunRef, IngestResult, ev.EndEvent]] = []
    for ref, batch, res in valid:
        for e in batch.events:
            key = (ref.pk, e.rank, e.seq)
            if key in seen:
                res.duplicates += 1
                continue
            seen.add(key)
            if isinstance(e, ev.EndEvent):
                ends.append((ref, res, e))
            else:
                owners[key] = (res, e)  # type: ignore[assignment]

    new: list[tuple[int, ev.StepEvent]] = []
    if owners:
        rows = [_step_row(pk, e) for (pk, _, _), (_, e) in owners.items()]
        stored = {(r[0], r[1], r[2]) for r in st.insert(conn, "steps", rows)}
        new_rows = []
        for row, (key, (res, e)) in zip(rows, owners.items(), strict=True):
            if key in stored:
                res.new_steps.append(e)
                new.append((key[0], e))
                new_rows.append(row)
            else:
                res.duplicates += 1
        coll_rows = [_collective_rows(pk, e) for pk, e in new]
        if kept is not None:
            kept.extend(zip(new_rows, coll_rows, strict=True))
        _write_details(conn, st, new, coll_rows, trace_sample_every)
        _bump_ranks(conn, st, new)
        _mark_dirty(conn, st, new, now)

    carried: list[tuple[int, ev.StepEvent | ev.EndEvent]] = list(new)
    for ref, res, e in ends:
        if _record_end(conn, ref.pk, e):
            res.new_ends.append(e)
            carried.append((ref.pk, e))
        else:
            res.duplicates += 1
    _write_checkpoints(conn, carried)

    # One touch (and, after end events, one status check) per run.
    by_run: dict[int, tuple[RunRef, list[IngestResult]]] = {}
    for ref, _, res in valid:
        by_run.setdefault(ref.pk, (ref, []))[1].append(res)
    for pk, (ref, run_results) in by_run.items():
        times = [t for r in run_results for t in _times(r)]
        newest = min(max(times), now) if times else None
        if (
            newest is not None
            and conn.execute(st.touch, {"pk": pk, "newest": newest}).rowcount == 0
        ):
            raise RunGone(ref.run_id)  # deleted meanwhile: roll back, answer 404
        if any(r.new_ends for r in run_results):
            ref.status = _settle_status(conn, ref, now=now)
        for r in run_results:
            r.accepted = len(r.new_steps) + len(r.new_ends)
            r.status = ref.status
            own = _times(r)
            r.last_event_at = min(max(own), now) if own else None
    return results


def _times(r: IngestResult) -> list[float]:
    return [e.time for e in r.new_steps] + [e.time for e in r.new_ends]


def _write_details(
    conn: Connection,
    st: _Statements,
    new: list[tuple[int, ev.StepEvent]],
    coll_rows: list[list[tuple[Any, ...]]],
    trace_sample_every: int,
) -> None:
    flat = [row for rows in coll_rows for row in rows]
    if flat:
        st.insert(conn, "collectives", flat)
    span_rows = [
        (pk, e.rank, e.seq, e.step, e.spans)
        for pk, e in new
        if e.spans and e.step % trace_sample_every == 0
    ]
    if span_rows:
        st.insert(conn, "spans", span_rows)


def _write_checkpoints(conn: Connection, new: list[tuple[int, ev.StepEvent | ev.EndEvent]]) -> None:
    """The checkpoint calls the newly stored events carry (rare: a few per run)."""
    rows = [
        {"run": pk, "rank": e.rank, "seq": e.seq, "idx": i, "op": c.op, "step": c.step,
         "time": c.time, "seconds": c.seconds, "bytes": c.bytes, "tag": c.tag[:200]}
        for pk, e in new if e.checkpoints for i, c in enumerate(e.checkpoints)
    ]  # fmt: skip
    if rows:
        conn.execute(m.checkpoints.insert(), rows)


def _bump_ranks(conn: Connection, st: _Statements, new: list[tuple[int, ev.StepEvent]]) -> None:
    """One upsert row per (run, rank): PostgreSQL refuses to update a row twice in one
    statement, so the batches' steps are summed here first."""
    per_rank: dict[tuple[int, int], list[Any]] = {}
    for pk, e in new:
        acc = per_rank.setdefault((pk, e.rank), [0, -1, 0.0, None, None])
        acc[0] += 1
        acc[1] = max(acc[1], e.step)
        acc[2] = max(acc[2], e.time)
        if e.host:
            acc[3] = ev.node_key(e.host, e.node)
        if e.local_rank >= 0:
            acc[4] = e.local_rank
    if not per_rank:
        return
    rows = [
        (pk, rank, int(n), int(last), t, 0, 0, host, local_rank)
        for (pk, rank), (n, last, t, host, local_rank) in sorted(per_rank.items())
    ]
    st.insert(conn, "ranks", rows)


def _mark_dirty(
    conn: Connection, st: _Statements, new: list[tuple[int, ev.StepEvent]], now: float
) -> None:
    """Mark the steps that got new rank rows: their rollups are stale (read/rollups/:
    invariant 1 of its docstring)."""
    keys = sorted({(pk, e.step) for pk, e in new})
    if keys:
        rows = [(pk, step, 1, now) for pk, step in keys]
        st.insert(conn, "dirty", rows)


def _record_end(conn: Connection, pk: int, e: ev.EndEvent) -> bool:
    """Store a rank's end; False when this exact end event is already stored."""
    rs = m.rank_states
    current = conn.execute(select(rs.c.end_seq).where(rs.c.run == pk, rs.c.rank == e.rank)).first()
    if current is not None and current.end_seq == e.seq:
        return False
    values = {
        "end_status": e.status,
        "end_seq": e.seq,
        "end_time": e.time,
        "error": e.error,
        "dropped_events": e.dropped_events,
        "agent_errors": e.agent_errors,
        "crash": e.crash,
    }
    if current is None:
        conn.execute(rs.insert().values(run=pk, rank=e.rank, steps=0, **values))
    else:
        conn.execute(update(rs).where(rs.c.run == pk, rs.c.rank == e.rank).values(**values))
    return True


def _settle_status(conn: Connection, ref: RunRef, *, now: float) -> str:
    """Once every rank has ended, the run is finished (or failed if any rank failed); a
    rank that crashed crashes the run at once (its peers will wait for it in their next
    collective: the run is not running, nor stalled)."""
    rs = m.rank_states
    rows = conn.execute(
        select(rs.c.end_status, rs.c.end_time).where(
            rs.c.run == ref.pk, rs.c.end_status.is_not(None)
        )
    ).all()
    crashed = any(r.end_status == "crashed" for r in rows)
    if len(rows) < ref.world_size and not crashed:
        return ref.status
    if crashed:
        status = "crashed"
    else:
        status = "failed" if any(r.end_status == "failed" for r in rows) else "finished"
    ended_at = min(max(r.end_time for r in rows), now)
    conn.execute(
        update(m.runs).where(m.runs.c.id == ref.pk).values(status=status, ended_at=ended_at)
    )
    return status


__all__ = [
    "COLLECTIVE_COLUMNS",
    "MAX_JOB_CHARS",
    "MAX_RUN_ID_CHARS",
    "MAX_SPANS_PER_STEP",
    "STEP_COLUMNS",
    "BatchError",
    "IngestResult",
    "RunGone",
    "RunRef",
    "StoredRankStep",
    "check_schema_version",
    "create_run",
    "delete_run",
    "ingest_batch",
    "ingest_many",
    "run_ref",
    "validate_batch",
    "validate_run_create",
    "validate_run_id",
]
