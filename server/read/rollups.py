"""Per-step rollups across ranks: the read model every page, API read, /metrics, alert input
and the doctor stand on.

A 4,096-rank job stores 4,096 rows a step. Nobody reads them all: a person wants the step's
distribution over ranks and the ranks that stand out. So for every (run, step, metric) of
the vocabulary the compactor keeps one `step_rollups` row: n, min, p10, p50, p90, max, mean,
the ranks at the min and the max and, for the metrics that name outliers (`OUTLIER_METRICS`),
the `TOP_K` ranks at either end. A series over "all ranks" reads one row per step.

How the rollups stay exact:

1. Ingest writes the per-rank rows and, in the same transaction, bumps a version on the
   step's `dirty_steps` mark (store.py).
2. The `Compactor` thread takes marks that have settled (no rank wrote to the step for
   `settle_s`) of steps that every rank has reached (or that nobody wrote to for
   `incomplete_s`: a rank died): a step that is still arriving would be rolled up again
   and again, at the cost of all its rows each time. It reads the step's rows,
   computes the rollups, and
   in one short transaction replaces the step's rollup rows, applies the change to the
   run's totals, and clears the marks whose version it read. A rank that arrived meanwhile
   bumped the version: its mark stays and the step is rolled up again, late ranks included.
3. Readers (`read`) take stored rollups and compute any still-dirty steps in their range on
   the fly (the newest: at most `MAX_LIVE_STEPS`, and `MAX_LIVE_RANK_STEPS` rank-steps), so
   an answer is exact and current even before the compactor ran, and costs the same at any
   world size; during a backlog (a recovery storm) older dirty steps wait for the compactor,
   and a reader computes a quarter as many (`BACKLOG_FACTOR`). One read request computes a
   dirty step once, however many reads it makes (read_gate.request_view).

Quantiles are linear interpolations between order statistics (numpy's default); ties for
the min or max name the lowest rank. Several server processes may compact at once: on
PostgreSQL each claims the runs it rolls up with a session advisory lock that the others
skip (no step is computed twice), kept while the run has steps to roll up; the others
publish their part of its fresh steps for it (fresh.py); and a transaction-scoped advisory
lock per run serialises the writes of one run with retention.

Retention (`Retention`): per-rank rows of steps older than the newest `full_steps` are
thinned to every `every`-th step; rollups are kept whole. A late rank of a thinned step is
dropped with its mark (its step's rollup was exact when the step was complete).
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import orjson
from sqlalchemy import Connection, and_, delete, func, select, text, tuple_
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.read import fresh
from zerowatch.server.read.vocabulary import rank_table_of_columns
from zerowatch.server.read_gate import ReadGate, request_view

from zerowatch import events as ev

log = logging.getLogger(__name__)

STATS = ("min", "p10", "p50", "p90", "max", "mean")
#: Ranks kept at each end of an outlier metric's distribution, per step.
TOP_K = 16
#: Metrics whose rollups keep the ranks at both ends (outlier tables, /metrics' per-rank
#: series, the doctor's straggler finding).
OUTLIER_METRICS = frozenset(
    {
        "busy_s",
        "step_time_s",
        "exposed_comm_s",
        "memory.peak",
        "memory.state",
        *(f"collective.{op}.busbw" for op in ev.COLLECTIVE_OPS),
        *(f"collective.{op}.latency_s" for op in ev.COLLECTIVE_OPS),
        *(f"part.{p}" for p in ev.STEP_PARTS),
    }
)
#: Dirty steps a reader computes itself (the newest); older ones wait for the compactor.
MAX_LIVE_STEPS = 256
#: ... and at most this many rank-steps of them: 8 steps of a 4,096-rank run. Bounded in
#: steps alone, a page read during a recovery storm (thousands of dirty steps) read 256
#: steps x 4,096 ranks of rows per request, and a few such requests at once took the
#: server past 12 GB (bench/faults.py, 4,096 ranks).
MAX_LIVE_RANK_STEPS = 32_768
#: A backlog: more dirty steps than this many times what a reader computes (the compactor
#: is behind, as in a recovery storm). A reader then computes a quarter as many: the newest
#: steps of a backlog are partial anyway (their ranks are still replaying), and while the
#: writer and the compactor have minutes of work on the same cores, every page's read of
#: them from the rows was what kept a run page from answering in under 2 s
#: (bench/faults.py).
BACKLOG_FACTOR = 4
N_BUCKETS = len(ev.LATENCY_BUCKETS) + 1
_CHUNK = 400
#: ... and at most this many rank-steps a chunk (one step at 4,096 ranks): a chunk's rows
#: are held as dicts with their JSON decoded (400 steps of a 4,096-rank run, 1.6 million
#: rows, took the compactor past 7 GB after a recovery storm), and the compactor steps
#: aside for reads between chunks, so a chunk is what a read may wait behind (at 32,768
#: rank-steps a /metrics scrape in a 4,096-rank storm took up to 1.8 s; bench/faults.py).
_CHUNK_RANK_STEPS = 4_096


@dataclass(slots=True)
class Stats:
    """One metric of one step over the step's ranks."""

    n: int
    min: float
    p10: float
    p50: float
    p90: float
    max: float
    mean: float
    min_rank: int
    max_rank: int
    #: {"hi": [[rank, value], ...] highest first, "lo": [...] lowest first} for outlier
    #: metrics; {"hist": [...], "sum": s} (latency histogram over ranks) for latency_s.
    extra: dict[str, Any] = field(default_factory=dict)

    def get(self, stat: str) -> float:
        return float(getattr(self, stat))


def quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics of an ascending, non-empty sequence."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# -- computing rollups from the per-rank rows ------------------------------------------------

#: The steps columns a rollup reads: the rank-step's keys and the columns
#: `vocabulary.rank_table` reads.
STEP_COLS = (
    "rank", "seq", "step", "step_time_s", "exposed_comm_s", "hidden_comm_s", "grad_norm",
    "loss", "lr", "loss_scale", "samples_per_s", "tokens_per_s", "mfu", "samples", "tokens",
    "skipped", "nonfinite", "clipped", "phases", "parts", "offload", "memory", "scalars",
    "thread_cpu_s", "other_cpu_s", "gpu",
)  # fmt: skip
_COLL_COLS = ("rank", "seq", "op", "count", "bytes", "latency_sum_s", "latency_max_s", "busbw",
              "buckets")  # fmt: skip


def _stats_of(values: np.ndarray, ranks: np.ndarray, *, ends: bool, k: int = TOP_K) -> Stats | None:
    """The Stats of one step's column of a metric: `values[i]` is rank `ranks[i]`'s (NaN
    where the rank has none), ranks ascending. None when no rank has a value.

    One sort by (value, rank) gives the order statistics (`quantile`'s linear
    interpolation) and the ranks at the ends, the lowest rank among equal values; the mean
    is math.fsum's. With `ends`, the k highest and k lowest (rank, value) pairs go in
    `extra`."""
    have = ~np.isnan(values)
    if not have.all():
        values, ranks = values[have], ranks[have]
    n = len(values)
    if n == 0:
        return None
    order = np.lexsort((ranks, values))
    vals, rks = values[order], ranks[order]
    ordered = vals.tolist()
    top = ordered[-1]
    st = Stats(
        n=n,
        min=ordered[0],
        p10=quantile(ordered, 0.1),
        p50=quantile(ordered, 0.5),
        p90=quantile(ordered, 0.9),
        max=top,
        mean=math.fsum(ordered) / n,
        min_rank=int(rks[0]),
        max_rank=int(rks[int(np.searchsorted(vals, top, side="left"))]),
    )
    if ends and n > 1:
        tail_v, tail_r = vals[-k:], rks[-k:]
        hi = np.lexsort((tail_r, -tail_v))
        st.extra = {
            "hi": [[r, v] for r, v in zip(tail_r[hi].tolist(), tail_v[hi].tolist(), strict=True)],
            "lo": [[r, v] for r, v in zip(rks[:k].tolist(), ordered[:k], strict=True)],
        }
    return st


def _json(value: Any) -> Any:
    """A JSON column as the driver gave it: text (SQLite) or already decoded (psycopg)."""
    if isinstance(value, (str, bytes)):  # a tuple: no union type built per call
        return orjson.loads(value)
    return value


def compute(
    conn: Connection,
    pk: int,
    steps: Iterable[int],
    *,
    world: int | None = None,
    pause: Callable[[], None] | None = None,
) -> dict[int, dict[str, Stats]]:
    """The rollups of `steps` of run `pk`, from its per-rank rows (steps without rows are
    absent). A rank with several rows for one step (a restart that replayed step numbers)
    counts once, with its newest.

    A step whose newest rows this process's writer just stored is computed from the metric
    columns it kept (fresh.py: the database is asked only which (rank, seq) it holds);
    any other from the rows, read as the driver returns them (no per-value result
    processing), each step's metrics from `vocabulary.rank_table` (a column over its ranks
    for each metric). Either way each column is summarised with numpy (`_stats_of`)."""
    wanted = sorted(set(steps))
    out: dict[int, dict[str, Stats]] = {}
    if not wanted:
        return out
    s = m.steps.c
    cache = fresh.of(conn.engine)
    world = world if world is not None else _world_size(conn, pk)
    per_chunk = max(1, min(_CHUNK, _CHUNK_RANK_STEPS // world))
    for i in range(0, len(wanted), per_chunk):
        if pause is not None:
            pause()  # the compactor steps aside for reads between chunks (read_gate.py)
        chunk = wanted[i : i + per_chunk]
        if not len(cache):
            for step, cols in _columns_from_rows(conn, pk, chunk).items():
                out[step] = _summarize_columns(cols)
            continue
        query = select(s.step, s.rank, s.seq).where(s.run == pk, s.step.in_(chunk))
        from_rows = []
        for step, ranks, seqs in _newest_keys(_raw_rows(conn, query)):
            found, missing = cache.lookup(pk, step, ranks, seqs)
            if not len(found.ranks):
                from_rows.append(step)
                continue
            cols = fresh.columns(found)
            if missing.any():  # stored by another process and not published: their rows
                rest = _columns_from_rows(conn, pk, [step], ranks=ranks[missing].tolist())
                if step in rest:
                    cols = cols.merged(rest[step])
            out[step] = _summarize_columns(cols)
        for step, cols in _columns_from_rows(conn, pk, from_rows).items():
            out[step] = _summarize_columns(cols)
    return dict(sorted(out.items()))


def _newest_keys(rows: Sequence[Sequence[int]]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(step, ranks, seqs) for each step of (step, rank, seq) rows, steps ascending: its
    ranks ascending, each with its newest seq (a restart that replayed step numbers)."""
    if not rows:
        return
    a = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=3 * len(rows)).reshape(-1, 3)
    a = a[np.lexsort((a[:, 2], a[:, 1], a[:, 0]))]
    last = np.ones(len(a), dtype=bool)
    last[:-1] = (a[1:, 0] != a[:-1, 0]) | (a[1:, 1] != a[:-1, 1])
    a = a[last]
    bounds = np.flatnonzero(np.diff(a[:, 0])) + 1
    for part in np.split(a, bounds):
        yield int(part[0, 0]), part[:, 1].copy(), part[:, 2].copy()


def _summarize_columns(cols: fresh.StepColumns) -> dict[str, Stats]:
    """A step's Stats from its metric columns over its ranks and, per collective op, its
    latency histogram and latency sum over ranks."""
    stats: dict[str, Stats] = {}
    for name, column in cols.table.items():
        st = _stats_of(column, cols.ranks, ends=name in OUTLIER_METRICS)
        if st is not None:
            stats[name] = st
    for op, counts in cols.counts.items():
        lat = stats.get(f"collective.{op}.latency_s")
        if lat is not None:
            lat.extra["hist"] = counts.tolist()
            lat.extra["sum"] = math.fsum(cols.latency_sums[op])
    return stats


def _columns_from_rows(
    conn: Connection, pk: int, chunk: list[int], *, ranks: list[int] | None = None
) -> dict[int, fresh.StepColumns]:
    """The StepColumns of a chunk of steps (of some `ranks` only, when given) from their rows;
    a step without rows is absent.

    The rows stay the driver's tuples: sorted by (step, rank, seq), a rank's newest row of a
    step is the last, the JSON columns are decoded a column at a time, and the metrics of
    the whole chunk come from one `rank_table_of_columns` (cut by step afterwards), with
    the collectives' histograms and latency sums added up per step and op in numpy."""
    if not chunk:
        return {}
    s, c = m.steps.c, m.collectives.c
    query = select(*(s[n] for n in STEP_COLS)).where(s.run == pk, s.step.in_(chunk))
    coll_query = select(*(c[n] for n in _COLL_COLS)).where(
        c.run == pk, c.op.in_(ev.COLLECTIVE_OPS), c.step.in_(chunk)
    )
    if ranks is not None:
        query = query.where(s.rank.in_(ranks))
        coll_query = coll_query.where(c.rank.in_(ranks))
    rows = _raw_rows(conn, query)
    if not rows:
        return {}
    rows.sort(key=_STEP_RANK_SEQ)
    # The newest row of each (step, rank): a key keeps its first place and its last value.
    newest = list({(r[_STEP], r[_RANK]): r for r in rows}.values())
    n = len(newest)
    by_position: list[Sequence[Any]] = list(zip(*newest, strict=True))
    for j in _JSON_AT:
        by_position[j] = _json_column(by_position[j])
    steps = np.array(by_position[_STEP], dtype=np.int64)
    rank_steps = {(r[_RANK], r[_SEQ]): i for i, r in enumerate(newest)}
    # Each collectives row with the rank-step it belongs to (rows of older seqs: none).
    coll_rows = [
        (i, cr) for cr in _raw_rows(conn, coll_query)
        if (i := rank_steps.get((cr[0], cr[1]))) is not None
    ]  # fmt: skip
    at = np.array([i for i, _ in coll_rows], dtype=np.int64)
    coll_position: list[Sequence[Any]] | None = (
        list(zip(*(cr for _, cr in coll_rows), strict=True)) if coll_rows else None
    )
    if coll_position is not None:
        coll_position[_BUCKETS] = _json_column(coll_position[_BUCKETS])
    table = rank_table_of_columns(
        n,
        lambda name: by_position[_STEP_AT[name]],
        at,
        (lambda name: coll_position[_COLL_AT[name]]) if coll_position is not None else None,
    )
    bounds = np.flatnonzero(np.diff(steps)) + 1
    starts = [0, *bounds.tolist()]
    ends = [*bounds.tolist(), n]
    rank_of = np.array(by_position[_RANK], dtype=np.int64)
    hists = _step_hists(coll_position, at, steps) if coll_position is not None else {}
    out: dict[int, fresh.StepColumns] = {}
    for a, b in zip(starts, ends, strict=True):
        step = int(steps[a])
        cut = {name: col[a:b] for name, col in table.items()}
        counts, sums = hists.get(step, ({}, {}))
        out[step] = fresh.StepColumns(
            rank_of[a:b],
            {name: col for name, col in cut.items() if not np.isnan(col).all()},
            counts,
            sums,
        )
    return out


_STEP_AT = {name: i for i, name in enumerate(STEP_COLS)}
_COLL_AT = {name: i for i, name in enumerate(_COLL_COLS)}
_STEP, _RANK, _SEQ = _STEP_AT["step"], _STEP_AT["rank"], _STEP_AT["seq"]
_STEP_RANK_SEQ = operator.itemgetter(_STEP, _RANK, _SEQ)
_JSON_AT = [_STEP_AT[name] for name in ("phases", "parts", "offload", "memory", "scalars", "gpu")]
_BUCKETS = _COLL_AT["buckets"]


def _json_column(values: Sequence[Any]) -> list[Any]:
    """A JSON column as the driver gave it, decoded (see `_json`)."""
    if all(type(v) is str for v in values):
        try:
            return list(map(orjson.loads, values))
        except orjson.JSONDecodeError:
            pass
    return [_json(v) for v in values]


def _step_hists(
    coll_position: list[Sequence[Any]], at: np.ndarray, steps: np.ndarray
) -> dict[int, tuple[dict[str, np.ndarray], dict[str, list[float]]]]:
    """Per step and op: the latency histogram summed over the step's rows (a short bucket
    list, from an old row, counts what it has) and every row's latency sum."""
    buckets = coll_position[_BUCKETS]
    if all(len(b) == N_BUCKETS for b in buckets):
        counts = np.array(buckets, dtype=np.int64).reshape(len(buckets), N_BUCKETS)
    else:
        counts = np.zeros((len(buckets), N_BUCKETS), dtype=np.int64)
        for j, b in enumerate(buckets):
            b = b[:N_BUCKETS]
            counts[j, : len(b)] = b
    ops = np.array(coll_position[_COLL_AT["op"]], dtype=object)
    lats = coll_position[_COLL_AT["latency_sum_s"]]
    row_steps = steps[at]
    out: dict[int, tuple[dict[str, np.ndarray], dict[str, list[float]]]] = {}
    for op in dict.fromkeys(ops.tolist()):
        is_op = ops == op
        for step in np.unique(row_steps[is_op]).tolist():
            sel = np.flatnonzero(is_op & (row_steps == step))
            hist, sums = out.setdefault(int(step), ({}, {}))
            hist[op] = counts[sel].sum(axis=0)
            sums[op] = [lats[j] for j in sel.tolist()]
    return out


def _raw_rows(conn: Connection, query: Any) -> list[tuple[Any, ...]]:
    """The rows of a Core select as the DBAPI returns them (JSON columns as text on SQLite),
    without SQLAlchemy's per-value result processing."""
    compiled = query.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    if compiled.positiontup is not None:  # qmark (SQLite)
        params: Any = tuple(compiled.params[k] for k in compiled.positiontup)
    else:
        params = compiled.params
    return list(conn.exec_driver_sql(str(compiled), params).fetchall())


# -- reading ----------------------------------------------------------------------------------


def dirty_in(
    conn: Connection, pk: int, *, step_from: int | None = None, step_to: int | None = None
) -> list[int]:
    """Steps of run `pk` (in the range) whose rollups are stale, ascending."""
    return list(dirty_versions(conn, pk, step_from=step_from, step_to=step_to))


def dirty_versions(
    conn: Connection, pk: int, *, step_from: int | None = None, step_to: int | None = None
) -> dict[int, tuple[int, float]]:
    """{step: (version, since) of its mark} of run `pk`'s stale steps (in the range),
    ascending. Together the two name one state of a step's rows: every write bumps the
    version and sets `since`, and a mark the compactor cleared that a late rank sets again
    starts at version 1 again, but at a later `since`."""
    d = m.dirty_steps.c
    conds = [d.run == pk]
    if step_from is not None:
        conds.append(d.step >= step_from)
    if step_to is not None:
        conds.append(d.step <= step_to)
    q = select(d.step, d.version, d.since).where(*conds).order_by(d.step)
    return {int(st): (int(v), float(since)) for st, v, since in conn.execute(q)}


def _live(
    conn: Connection, pk: int, versions: dict[int, tuple[int, float]], world: int
) -> dict[int, dict[str, Stats]]:
    """The rollups of dirty steps ({step: its mark's (version, since)}), computed from the
    rows once per version: a run page reads the rollups of the same newest steps several
    times (its charts, the run resource, the doctor), and while a backlog lasts each of
    those reads computed up to `MAX_LIVE_RANK_STEPS` rank-steps again (a run page took 8 s
    after a 1,024-rank recovery storm). A mark's version changes in the transaction that
    writes the step's rows, so a result computed after reading version v holds at least
    the rows of v; a later rank bumps the version and the step is computed anew. Within
    one read request a step is computed once, whatever its version does meanwhile
    (read_gate.request_view)."""
    memo = fresh.of(conn.engine).live
    view = request_view()  # this request's picture of each step (read_gate.py)
    out, todo = {}, []
    for step, version in versions.items():
        got = view.get((pk, step)) if view is not None else None
        if got is None:
            got = memo.get((pk, step, version))
        if got is None:
            todo.append(step)
        else:
            out[step] = got
    if todo:
        computed = compute(conn, pk, todo, world=world)
        for step in todo:
            stats = computed.get(step)
            if stats is not None:
                memo.put((pk, step, versions[step]), stats)
                out[step] = stats
    if view is not None:
        view.update({(pk, step): stats for step, stats in out.items()})
    return dict(sorted(out.items()))


def _world_size(conn: Connection, pk: int) -> int:
    world = conn.execute(select(m.runs.c.world_size).where(m.runs.c.id == pk)).scalar()
    return max(int(world or 1), 1)


def in_backlog(conn: Connection, pk: int, world: int | None = None) -> bool:
    """Whether run `pk`'s dirty steps are a backlog (`BACKLOG_FACTOR`): the compactor is
    behind, as in a recovery storm."""
    dirty = conn.execute(select(func.count()).where(m.dirty_steps.c.run == pk)).scalar_one()
    return live_steps(conn, pk, world, dirty=dirty) < live_steps(conn, pk, world)


def live_steps(conn: Connection, pk: int, world: int | None = None, *, dirty: int = 0) -> int:
    """How many dirty steps of run `pk` (of `world` ranks, else looked up) a reader computes
    itself (see `read`), when `dirty` steps are dirty (a backlog: BACKLOG_FACTOR)."""
    world = world if world is not None else _world_size(conn, pk)
    n = max(1, min(MAX_LIVE_STEPS, MAX_LIVE_RANK_STEPS // world))
    return max(1, n // BACKLOG_FACTOR) if dirty > BACKLOG_FACTOR * n else n


def read(
    conn: Connection,
    pk: int,
    metrics: Sequence[str] | None,
    *,
    step_from: int | None = None,
    step_to: int | None = None,
    steps_in: Sequence[int] | None = None,
    extra: bool = False,
    live: bool = True,
) -> dict[str, dict[int, Stats]]:
    """{metric: {step: Stats}} for run `pk`, current to the last ingested rank-step
    (`live=False`: the stored rollups alone, as the compactor last left them).

    Stored rollups, with the newest dirty steps of the range computed from the per-rank
    rows (see the module docstring): at most `MAX_LIVE_STEPS`, and at most
    `MAX_LIVE_RANK_STEPS` rank-steps (so a read costs the same at any world size), a quarter
    of that in a backlog (`BACKLOG_FACTOR`); older dirty steps are left out until the
    compactor has rolled them up. `extra=False` leaves
    the outlier lists and histograms out (they are most of a rollup row's bytes).
    `metrics=None`: all.
    """
    r = m.step_rollups.c
    # The dirty marks first, the stored rollups after: the compactor writes a step's
    # rollups and clears its mark in one transaction, and each statement here may see a
    # newer commit than the one before. Read the other way round, a step rolled up in
    # between was in neither (a /metrics scrape of a restarted server showed no rank
    # statistics at all); this way it is in one or both (then the live one is used).
    versions = dirty_versions(conn, pk, step_from=step_from, step_to=step_to) if live else {}
    # The primary key is (run, metric, step): naming the metrics lets a read of some steps
    # seek each (metric, step) instead of reading every rollup of the run.
    conds = [
        r.run == pk,
        r.metric.in_(list(metrics) if metrics is not None else metric_names(conn, pk)),
    ]
    if step_from is not None:
        conds.append(r.step >= step_from)
    if step_to is not None:
        conds.append(r.step <= step_to)
    if steps_in is not None:
        conds.append(r.step.in_(list(steps_in)))
    out: dict[str, dict[int, Stats]] = defaultdict(dict)
    for name in metrics or ():
        out[name] = {}
    cols = [r.metric, r.step, r.n, r.min, r.p10, r.p50, r.p90, r.max, r.mean, r.min_rank,
            r.max_rank]  # fmt: skip
    if extra:
        cols.append(r.extra)
    for row in conn.execute(select(*cols).where(*conds).order_by(r.metric, r.step)):
        metric, step, n, lo, p10, p50, p90, hi, mean, lo_rank, hi_rank = row[:11]
        more = (row[11] or {}) if extra else {}
        out[metric][int(step)] = Stats(n, lo, p10, p50, p90, hi, mean, lo_rank, hi_rank, more)
    # A backlog is the run's: a read of a range counts every dirty step of the run.
    dirty = (
        len(versions)
        if (step_from is None and step_to is None) or not versions
        else conn.execute(select(func.count()).where(m.dirty_steps.c.run == pk)).scalar_one()
    )
    if steps_in is not None:
        keep = set(steps_in)
        versions = {st: v for st, v in versions.items() if st in keep}
    computed: dict[int, dict[str, Stats]] = {}
    if versions:
        world = _world_size(conn, pk)
        newest = sorted(versions)[-live_steps(conn, pk, world, dirty=dirty) :]
        computed = _live(conn, pk, {st: versions[st] for st in newest}, world)
    names = list(metrics) if metrics is not None else None
    for step, stats in computed.items():
        for name in names if names is not None else [*out, *stats]:
            if name in stats:
                out[name][step] = stats[name]
            elif name in out:
                out[name].pop(step, None)
    if computed:
        for name in out:
            out[name] = dict(sorted(out[name].items()))
    return dict(out)


def metric_names(conn: Connection, pk: int) -> list[str]:
    """The metrics run `pk` has rollups of, ascending: one index seek per name (a loose
    index scan), not a read of the run's rollups."""
    sql = text(
        "WITH RECURSIVE n(metric) AS ("
        " SELECT MIN(metric) FROM step_rollups WHERE run = :pk"
        " UNION ALL"
        " SELECT (SELECT MIN(metric) FROM step_rollups WHERE run = :pk AND metric > n.metric)"
        " FROM n WHERE n.metric IS NOT NULL)"
        " SELECT metric FROM n WHERE metric IS NOT NULL"
    )
    return [str(x) for x in conn.execute(sql, {"pk": pk}).scalars()]


def newest_steps(conn: Connection, pk: int, metric: str, n: int) -> list[int]:
    """The newest `n` steps holding a rollup (or a dirty mark) of `metric`, ascending."""
    r, d = m.step_rollups.c, m.dirty_steps.c
    stored = conn.execute(
        select(r.step).where(r.run == pk, r.metric == metric).order_by(r.step.desc()).limit(n)
    ).scalars()
    dirty = conn.execute(
        select(d.step).where(d.run == pk).order_by(d.step.desc()).limit(n)
    ).scalars()
    return sorted({int(x) for x in (*stored, *dirty)})[-n:]


def newest_rolled_up(conn: Connection, pk: int, metric: str) -> int | None:
    """The newest step of run `pk` with a stored rollup of `metric` (None: none yet)."""
    r = m.step_rollups.c
    got = conn.execute(select(func.max(r.step)).where(r.run == pk, r.metric == metric)).scalar()
    return int(got) if got is not None else None


def step_bounds(conn: Connection, pk: int) -> tuple[int, int] | None:
    """(first, last) step holding rollups or marks, or None for a run without steps."""
    r, d = m.step_rollups.c, m.dirty_steps.c
    # One aggregate per subquery: SQLite answers a lone min() or max() with one index seek,
    # but both in one select with a scan of every step of the range (18 ms at 32,768 steps).
    ends = [
        select(agg(col)).where(*where).scalar_subquery()
        for col, where in ((r.step, (r.run == pk, r.metric == "step_time_s")),
                           (d.step, (d.run == pk,)))
        for agg in (func.min, func.max)
    ]  # fmt: skip
    lo1, hi1, lo2, hi2 = conn.execute(select(*ends)).one()
    los = [x for x in (lo1, lo2) if x is not None]
    his = [x for x in (hi1, hi2) if x is not None]
    return (int(min(los)), int(max(his))) if los else None


def totals(conn: Connection, pk: int) -> dict[str, tuple[float, list[int]]]:
    """The run's totals {key: (value, buckets)} as the compactor last left them."""
    t = m.run_totals.c
    return {
        row.key: (row.value, list(row.buckets or []))
        for row in conn.execute(select(t.key, t.value, t.buckets).where(t.run == pk))
    }


# -- the compactor ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Retention:
    """Which per-rank rows stay: every step of the newest `full_steps`, every `every`-th
    step before them. `full_steps=0` keeps everything."""

    full_steps: int = 0
    every: int = 10

    def __post_init__(self) -> None:
        if self.full_steps < 0:
            raise ValueError(f"retention_full_steps: must be >= 0, got {self.full_steps}")
        if self.every < 1:
            raise ValueError(f"retention_every: must be >= 1, got {self.every}")

    def thinned(self, step: int, horizon: int) -> bool:
        return step < horizon and step % self.every != 0


#: Totals keys: steps where any rank skipped / was non-finite; per op the latency histogram.
SKIPPED, NONFINITE = "skipped_steps", "nonfinite_steps"


def _hist_key(op: str) -> str:
    return f"hist.{op}"


class Compactor:
    """Rolls dirty steps up in the background (see the module docstring)."""

    def __init__(
        self,
        db: Database,
        *,
        interval_s: float = 0.5,
        settle_s: float = 0.5,
        incomplete_s: float = 30.0,
        max_steps: int = 256,
        retention: Retention | None = None,
        retention_interval_s: float = 30.0,
        gate: ReadGate | None = None,
        claim_idle_s: float = 60.0,
    ) -> None:
        self.db = db
        #: Reads in flight that the compactor steps aside for (read_gate.py); None: never.
        self.gate = gate
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.incomplete_s = max(incomplete_s, settle_s)
        self.max_steps = max_steps
        self.retention = retention or Retention()
        self.retention_interval_s = retention_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one compaction at a time in this process
        self._last_retention = 0.0
        self._last_sweep = 0.0
        #: PostgreSQL: the runs this compactor claimed (run -> when it last had steps to
        #: roll up), held by advisory locks on `_lock_conn` (see `_claim`).
        self._claims: dict[int, float] = {}
        self._lock_conn: Connection | None = None
        self.claim_idle_s = claim_idle_s
        #: Steps rolled up since start (tests, the benchmark).
        self.compacted = 0

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._loop, name="zerowatch-compactor", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._drop_claims()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                while self.run_once() >= self.max_steps and not self._stop.is_set():
                    pass
                now = time.time()
                if now - self._last_sweep >= self.retention_interval_s:
                    self._last_sweep = now
                    self.sweep_shared(now)
                if (
                    self.retention.full_steps
                    and now - self._last_retention >= self.retention_interval_s
                ):
                    self._last_retention = now
                    self.apply_retention()
            except Exception:  # the next tick tries again; ingest is unaffected
                log.exception("rollup compaction")

    def flush(self) -> int:
        """Roll up every dirty step now, settled or not. Returns how many."""
        total = 0
        while (n := self.run_once(settle=False)) > 0:
            total += n
        return total

    def run_once(self, *, settle: bool = True, now: float | None = None) -> int:
        """Roll up at most `max_steps` dirty steps. Returns how many were taken."""
        now = time.time() if now is None else now
        d = m.dirty_steps.c
        cache = fresh.of(self.db.engine)
        with self._lock:
            self._release_idle_claims(time.time())
            with self.db.read() as conn:
                ready = [d.since <= now - self.settle_s] if settle else []
                # Every run with dirty steps is claimed (or found claimed) at once, settled or
                # not: the other processes start to share their part of its steps before the
                # first of them is rolled up.
                runs = [int(pk) for pk in conn.execute(select(d.run).distinct()).scalars()]
                theirs = [pk for pk in runs if not self._claim(pk, time.time())]
                for pk in theirs:  # rolled up elsewhere: hold only what is still dirty
                    cache.retain(
                        pk, conn.execute(select(d.step).where(d.run == pk)).scalars().all()
                    )
                runs = [pk for pk in runs if pk not in theirs]
                published: list[int] = []
                if self.db.dialect == "postgresql" and runs:  # SQLite: one process, no others
                    b = m.fresh_blocks.c
                    sent = set(conn.execute(select(b.run).distinct()).scalars())
                    published = [pk for pk in runs if pk in sent]
            cache.flush_shared()
            if published:
                with self.db.write() as conn:
                    for pk in published:
                        cache.take_shared(conn, pk)
            if not runs:
                return 0
            with self.db.read() as conn:
                q = select(d.run, d.step, d.version, d.since).where(d.run.in_(runs), *ready)
                marks = conn.execute(q.order_by(d.run, d.step).limit(self.max_steps)).all()
                if settle:
                    marks = self._complete_or_old(conn, marks, now)
                if not marks:
                    return 0
                by_run: dict[int, list[tuple[int, int]]] = defaultdict(list)
                for mk in marks:
                    by_run[int(mk.run)].append((int(mk.step), int(mk.version)))
                horizons = {pk: self._horizon(conn, pk) for pk in by_run}
                pause = self.gate.yield_to_reads if self.gate is not None else None
                computed = {
                    pk: compute(
                        conn,
                        pk,
                        [st for st, _ in items if not self.retention.thinned(st, horizons[pk])],
                        pause=pause,
                    )
                    for pk, items in by_run.items()
                }
            for pk, items in by_run.items():
                self._write(pk, items, computed[pk], horizons[pk])
                cache.discard(pk, [st for st, _ in items])
            self.compacted += len(marks)
            return len(marks)

    def _complete_or_old(self, conn: Connection, marks: list[Any], now: float) -> list[Any]:
        """The settled marks worth rolling up now: steps that every rank of the run has
        reached, and steps nobody wrote to for `incomplete_s` (a rank that died, or one
        whose agent is offline). A step whose last ranks are still on their way would be
        rolled up now and again when they arrive: a step's ranks reach a busy server over
        one flush interval of the agents (16 s at 4,096 ranks), and a pause of the server
        longer than `settle_s` in between is no sign that they are all in."""
        s = m.steps.c
        by_run: dict[int, list[Any]] = defaultdict(list)
        for mk in marks:
            by_run[int(mk.run)].append(mk)
        sizes: dict[int, int] = dict(
            conn.execute(
                select(m.runs.c.id, m.runs.c.world_size).where(m.runs.c.id.in_(list(by_run)))
            ).all()
        )
        old = now - self.incomplete_s
        keep = []
        for pk, items in by_run.items():
            young = [int(mk.step) for mk in items if mk.since > old]
            counts: dict[int, int] = {}
            for i in range(0, len(young), _CHUNK):
                counts.update(
                    conn.execute(
                        select(s.step, func.count())
                        .where(s.run == pk, s.step.in_(young[i : i + _CHUNK]))
                        .group_by(s.step)
                    ).all()
                )
            world = int(sizes.get(pk) or 0)
            keep += [mk for mk in items if mk.since <= old or counts.get(int(mk.step), 0) >= world]
        return keep

    def _claim(self, pk: int, now: float) -> bool:
        """Whether this compactor may roll run `pk` up now. SQLite has one process: every
        run is its own. On PostgreSQL, where every server process runs a compactor, a run
        is claimed with a session advisory lock that the others skip
        (`pg_try_advisory_lock`), so two processes never compute the same steps. A claim
        is kept while the run has steps to roll up (released after `claim_idle_s` without,
        or when the process ends: PostgreSQL drops a session's locks with it), so the
        other processes know to publish their part of its steps (fresh.py: `share`)."""
        if self.db.dialect != "postgresql":
            return True
        cache = fresh.of(self.db.engine)
        if pk in self._claims:
            self._claims[pk] = now
            return True
        try:
            if self._lock_conn is None:
                self._lock_conn = self.db.engine.connect()
            got = bool(
                self._lock_conn.execute(
                    text("SELECT pg_try_advisory_lock(7078, :pk)"), {"pk": pk}
                ).scalar()
            )
            self._lock_conn.commit()
        except Exception:
            self._drop_claims()  # a broken session holds no locks
            raise
        if got:
            self._claims[pk] = now
            cache.own(pk)
        else:
            cache.share(pk)
        return got

    def _release_idle_claims(self, now: float) -> None:
        idle = [pk for pk, t in self._claims.items() if now - t > self.claim_idle_s]
        if not idle or self._lock_conn is None:
            return
        try:
            for pk in idle:
                self._lock_conn.execute(text("SELECT pg_advisory_unlock(7078, :pk)"), {"pk": pk})
                del self._claims[pk]
            self._lock_conn.commit()
        except Exception:
            self._drop_claims()
            raise

    def _drop_claims(self) -> None:
        """Give every claim up: the lock session is closed (its locks go with it)."""
        self._claims.clear()
        conn, self._lock_conn = self._lock_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
                conn.close()

    def _horizon(self, conn: Connection, pk: int) -> int:
        t = m.run_totals.c
        h = conn.execute(select(t.value).where(t.run == pk, t.key == "retention.horizon")).scalar()
        return int(h) if h is not None else -1

    def _write(
        self, pk: int, items: list[tuple[int, int]], stats: dict[int, dict[str, Stats]],
        horizon: int,
    ) -> None:  # fmt: skip
        steps = [st for st, _ in items]
        r, d = m.step_rollups, m.dirty_steps
        with self.db.write() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(7077, :pk)"), {"pk": pk})
            delta = _Delta()
            for i in range(0, len(steps), _CHUNK):
                chunk = steps[i : i + _CHUNK]
                old = conn.execute(
                    select(r.c.metric, r.c.max, r.c.extra).where(
                        r.c.run == pk,
                        r.c.step.in_(chunk),
                        r.c.metric.in_(
                            ["skipped", "nonfinite"]
                            + [f"collective.{op}.latency_s" for op in ev.COLLECTIVE_OPS]
                        ),
                    )
                ).all()
                for row in old:
                    delta.add(row.metric, row.max, row.extra or {}, -1)
                conn.execute(delete(r).where(r.c.run == pk, r.c.step.in_(chunk)))
            rows = []
            for step, per_metric in stats.items():
                for name, st in per_metric.items():
                    rows.append(
                        {
                            "run": pk, "metric": name, "step": step, "n": st.n, "min": st.min,
                            "p10": st.p10, "p50": st.p50, "p90": st.p90, "max": st.max,
                            "mean": st.mean, "min_rank": st.min_rank, "max_rank": st.max_rank,
                            "extra": st.extra,
                        }
                    )  # fmt: skip
                    if name in ("skipped", "nonfinite") or name.endswith(".latency_s"):
                        delta.add(name, st.max, st.extra, +1)
            if rows:
                conn.execute(r.insert(), rows)
            delta.apply(conn, pk)
            thinned = [st for st in steps if self.retention.thinned(st, horizon)]
            if thinned:
                _delete_rank_rows(conn, pk, thinned)
            pairs = [(pk, st, ver) for st, ver in items]
            for i in range(0, len(pairs), _CHUNK):
                conn.execute(
                    delete(d).where(
                        tuple_(d.c.run, d.c.step, d.c.version).in_(pairs[i : i + _CHUNK])
                    )
                )

    def sweep_shared(self, now: float) -> int:
        """Delete published fresh blocks older than `fresh.MAX_AGE_S` (no compactor took
        them: the run's claim went away). Returns how many."""
        b = m.fresh_blocks
        with self.db.write() as conn:
            gone = conn.execute(delete(b).where(b.c.created < now - fresh.MAX_AGE_S))
            return int(gone.rowcount or 0)

    def apply_retention(self) -> int:
        """Thin old per-rank rows of every run (see Retention). Returns rank-steps deleted."""
        keep = self.retention
        if not keep.full_steps:
            return 0
        deleted = 0
        rs, t = m.rank_states.c, m.run_totals
        with self.db.read() as conn:
            lasts = conn.execute(select(rs.run, func.max(rs.last_step)).group_by(rs.run)).all()
        for pk, last in lasts:
            if last is None:
                continue
            new_horizon = int(last) - keep.full_steps + 1
            with self.db.write() as conn:
                old = self._horizon(conn, pk)
                if new_horizon <= max(old, 0):
                    continue
                dirty = set(dirty_in(conn, pk, step_to=new_horizon - 1))
                doomed = [
                    st for st in range(max(old, 0), new_horizon)
                    if st % keep.every != 0 and st not in dirty
                ]  # fmt: skip
                deleted += _delete_rank_rows(conn, pk, doomed)
                conn.execute(delete(t).where(t.c.run == pk, t.c.key == "retention.horizon"))
                conn.execute(
                    t.insert().values(run=pk, key="retention.horizon", value=new_horizon,
                                      buckets=[])
                )  # fmt: skip
        return deleted


def _delete_rank_rows(conn: Connection, pk: int, steps: list[int]) -> int:
    n = 0
    for i in range(0, len(steps), _CHUNK):
        chunk = steps[i : i + _CHUNK]
        n += conn.execute(
            delete(m.steps).where(m.steps.c.run == pk, m.steps.c.step.in_(chunk))
        ).rowcount
        for op in ev.COLLECTIVE_OPS:  # the (run, op, step) index, one op at a time
            c = m.collectives.c
            conn.execute(
                delete(m.collectives).where(and_(c.run == pk, c.op == op, c.step.in_(chunk)))
            )
        conn.execute(delete(m.spans).where(m.spans.c.run == pk, m.spans.c.step.in_(chunk)))
    return n


class _Delta:
    """Changes to a run's totals from replacing some steps' rollups."""

    def __init__(self) -> None:
        self.values: dict[str, float] = defaultdict(float)
        self.buckets: dict[str, list[int]] = {}

    def add(self, metric: str, top: float, extra: dict[str, Any], sign: int) -> None:
        if metric in ("skipped", "nonfinite"):
            key = SKIPPED if metric == "skipped" else NONFINITE
            self.values[key] += sign * (1.0 if top > 0 else 0.0)
            return
        hist = extra.get("hist")
        if not hist:
            return
        op = metric.split(".")[1]
        key = _hist_key(op)
        self.values[key] += sign * float(extra.get("sum", 0.0))
        acc = self.buckets.setdefault(key, [0] * N_BUCKETS)
        for i, n in enumerate(hist[:N_BUCKETS]):
            acc[i] += sign * int(n)

    def apply(self, conn: Connection, pk: int) -> None:
        keys = set(self.values) | set(self.buckets)
        if not keys:
            return
        t = m.run_totals
        current = {
            row.key: row
            for row in conn.execute(
                select(t.c.key, t.c.value, t.c.buckets).where(t.c.run == pk, t.c.key.in_(keys))
            )
        }
        for key in sorted(keys):
            dv = self.values.get(key, 0.0)
            db = self.buckets.get(key)
            row = current.get(key)
            if row is None:
                conn.execute(t.insert().values(run=pk, key=key, value=dv, buckets=db or []))
                continue
            buckets = list(row.buckets or [])
            if db is not None:
                buckets = buckets or [0] * N_BUCKETS
                buckets = [a + b for a, b in zip(buckets, db, strict=True)]
            conn.execute(
                t.update()
                .where(t.c.run == pk, t.c.key == key)
                .values(value=row.value + dv, buckets=buckets)
            )


__all__ = [
    "MAX_LIVE_RANK_STEPS",
    "MAX_LIVE_STEPS",
    "OUTLIER_METRICS",
    "STATS",
    "TOP_K",
    "Compactor",
    "Retention",
    "Stats",
    "compute",
    "dirty_in",
    "in_backlog",
    "live_steps",
    "metric_names",
    "newest_rolled_up",
    "newest_steps",
    "quantile",
    "read",
    "step_bounds",
    "totals",
]
