"""Computing steps' rollups: each step from the fresh-steps cache where it holds the step's
rank-steps, from the stored rows otherwise, summarised with numpy (stats.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from sqlalchemy import Connection, select
from zerowatch.server import models as m
from zerowatch.server.read.metric_table import OUTLIER_METRICS
from zerowatch.server.read.rollups.caches import caches_of
from zerowatch.server.read.rollups.columns import StepColumns
from zerowatch.server.read.rollups.rows import columns_from_rows, newest_keys
from zerowatch.server.read.rollups.stats import Stats, stats_of


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

    A step whose newest rows the fresh-steps cache holds is computed from its columns (the
    database is asked only which (rank, seq) it holds); the ranks it lacks, and any other
    step, from the rows (rows.py). Steps go `chunk_steps` at a time, at most
    `chunk_rank_steps` rank-steps, calling `pause` before each chunk (the worker steps
    aside for reads there, read_gate.py)."""
    wanted = sorted(set(steps))
    out: dict[int, dict[str, Stats]] = {}
    if not wanted:
        return out
    caches = caches_of(conn)
    cache, tuning = caches.fresh, caches.tuning
    world = world if world is not None else world_size(conn, pk)
    per_chunk = max(1, min(tuning.chunk_steps, tuning.chunk_rank_steps // world))
    for i in range(0, len(wanted), per_chunk):
        if pause is not None:
            pause()
        chunk = wanted[i : i + per_chunk]
        if not len(cache):
            for step, cols in columns_from_rows(conn, pk, chunk).items():
                out[step] = summarize(cols, top_k=tuning.top_k)
            continue
        from_rows = []
        for step, ranks, seqs in newest_keys(conn, pk, chunk):
            found, missing = cache.lookup(pk, step, ranks, seqs)
            if not len(found.ranks):
                from_rows.append(step)
                continue
            cols = found.columns()
            if missing.any():  # stored by another process and not published: their rows
                rest = columns_from_rows(conn, pk, [step], ranks=ranks[missing].tolist())
                if step in rest:
                    cols = cols.merged(rest[step])
            out[step] = summarize(cols, top_k=tuning.top_k)
        for step, cols in columns_from_rows(conn, pk, from_rows).items():
            out[step] = summarize(cols, top_k=tuning.top_k)
    return dict(sorted(out.items()))


def summarize(cols: StepColumns, *, top_k: int) -> dict[str, Stats]:
    """A step's Stats from its metric columns over its ranks and, per collective op, its
    latency histogram and latency sum over ranks."""
    stats: dict[str, Stats] = {}
    for name, column in cols.table.items():
        st = stats_of(column, cols.ranks, ends=name in OUTLIER_METRICS, k=top_k)
        if st is not None:
            stats[name] = st
    for op, counts in cols.counts.items():
        lat = stats.get(f"collective.{op}.latency_s")
        if lat is not None:
            lat.extra["hist"] = counts.tolist()
            lat.extra["sum"] = math.fsum(cols.latency_sums[op])
    return stats


def world_size(conn: Connection, pk: int) -> int:
    """Run `pk`'s world size (at least 1)."""
    world = conn.execute(select(m.runs.c.world_size).where(m.runs.c.id == pk)).scalar()
    return max(int(world or 1), 1)


__all__ = ["compute", "summarize", "world_size"]
