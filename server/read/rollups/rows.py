"""A step's metric columns read back from its stored per-rank rows.

The rows stay the driver's tuples (no per-value result processing): sorted by (step, rank,
seq), a rank's newest row of a step is the last (a restart that replayed step numbers
counts once, with its newest), the JSON columns are decoded a column at a time, and the
metrics of a whole chunk of steps come from one `vocabulary.rank_table_of_columns` (cut by
step afterwards), with the collectives' histograms and latency sums added up per step and
op in numpy.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

import numpy as np
import orjson
from sqlalchemy import Connection, select
from zerowatch.server import models as m
from zerowatch.server.read.metric_table import (
    COLLECTIVE_READS,
    FAMILIES,
    N_BUCKETS,
    ROLLUP_COLUMNS,
)
from zerowatch.server.read.rollups.columns import StepColumns
from zerowatch.server.read.vocabulary import rank_table_of_columns

from zerowatch import events as ev

_COLL_COLS = ("rank", "seq", "op", *COLLECTIVE_READS, "buckets")
_STEP_AT = {name: i for i, name in enumerate(ROLLUP_COLUMNS)}
_COLL_AT = {name: i for i, name in enumerate(_COLL_COLS)}
_STEP, _RANK, _SEQ = _STEP_AT["step"], _STEP_AT["rank"], _STEP_AT["seq"]
_STEP_RANK_SEQ = operator.itemgetter(_STEP, _RANK, _SEQ)
_JSON_AT = [_STEP_AT[name] for name in FAMILIES.values()]
_BUCKETS = _COLL_AT["buckets"]


def raw_rows(conn: Connection, query: Any) -> list[tuple[Any, ...]]:
    """The rows of a Core select as the DBAPI returns them (JSON columns as text on SQLite),
    without SQLAlchemy's per-value result processing."""
    compiled = query.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    if compiled.positiontup is not None:  # qmark (SQLite)
        params: Any = tuple(compiled.params[k] for k in compiled.positiontup)
    else:
        params = compiled.params
    return list(conn.exec_driver_sql(str(compiled), params).fetchall())


def newest_keys(
    conn: Connection, pk: int, steps: list[int]
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(step, ranks, seqs) for each of `steps` of run `pk` that has rows, steps ascending:
    its ranks ascending, each with its newest seq (an index-only read, no JSON)."""
    s = m.steps.c
    rows = raw_rows(conn, select(s.step, s.rank, s.seq).where(s.run == pk, s.step.in_(steps)))
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


def columns_from_rows(
    conn: Connection, pk: int, chunk: list[int], *, ranks: list[int] | None = None
) -> dict[int, StepColumns]:
    """The StepColumns of a chunk of steps (of some `ranks` only, when given) from their rows;
    a step without rows is absent (see the module docstring)."""
    if not chunk:
        return {}
    s, c = m.steps.c, m.collectives.c
    query = select(*(s[n] for n in ROLLUP_COLUMNS)).where(s.run == pk, s.step.in_(chunk))
    coll_query = select(*(c[n] for n in _COLL_COLS)).where(
        c.run == pk, c.op.in_(ev.COLLECTIVE_OPS), c.step.in_(chunk)
    )
    if ranks is not None:
        query = query.where(s.rank.in_(ranks))
        coll_query = coll_query.where(c.rank.in_(ranks))
    rows = raw_rows(conn, query)
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
        (i, cr) for cr in raw_rows(conn, coll_query)
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
    out: dict[int, StepColumns] = {}
    for a, b in zip(starts, ends, strict=True):
        step = int(steps[a])
        cut = {name: col[a:b] for name, col in table.items()}
        counts, sums = hists.get(step, ({}, {}))
        out[step] = StepColumns(
            rank_of[a:b],
            {name: col for name, col in cut.items() if not np.isnan(col).all()},
            counts,
            sums,
        )
    return out


def _json(value: Any) -> Any:
    """A JSON column as the driver gave it: text (SQLite) or already decoded (psycopg)."""
    if isinstance(value, (str, bytes)):  # a tuple: no union type built per call
        return orjson.loads(value)
    return value


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


__all__ = ["columns_from_rows", "newest_keys", "raw_rows"]
