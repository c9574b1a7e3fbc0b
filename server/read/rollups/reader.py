"""Reading rollups: stored rows of `step_rollups`, with the run's dirty steps computed on the
fly, so that an answer is exact and current (see the package docstring for why).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from sqlalchemy import Connection, func, select, text
from zerowatch.server import models as m
from zerowatch.server.read.rollups.caches import caches_of
from zerowatch.server.read.rollups.compute import compute, world_size
from zerowatch.server.read.rollups.stats import Stats
from zerowatch.server.read_gate import request_view


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
    version and sets `since`, and a mark the worker cleared that a late rank sets again
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
    rows once per version (live_memo.py), and once per read request whatever their version
    does meanwhile (read_gate.request_view: one page, one picture)."""
    memo = caches_of(conn).live
    view = request_view()
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


def in_backlog(conn: Connection, pk: int, world: int | None = None) -> bool:
    """Whether run `pk`'s dirty steps are a backlog (`backlog_factor`): the worker is
    behind, as in a recovery storm."""
    dirty = conn.execute(select(func.count()).where(m.dirty_steps.c.run == pk)).scalar_one()
    return live_steps(conn, pk, world, dirty=dirty) < live_steps(conn, pk, world)


def live_steps(conn: Connection, pk: int, world: int | None = None, *, dirty: int = 0) -> int:
    """How many dirty steps of run `pk` (of `world` ranks, else looked up) a reader computes
    itself (see `read`), when `dirty` steps are dirty (a backlog: `backlog_factor`)."""
    tuning = caches_of(conn).tuning
    world = world if world is not None else world_size(conn, pk)
    n = max(1, min(tuning.max_live_steps, tuning.max_live_rank_steps // world))
    factor = tuning.backlog_factor
    return max(1, n // factor) if dirty > factor * n else n


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
    (`live=False`: the stored rollups alone, as the worker last left them).

    Stored rollups, with the newest dirty steps of the range computed from the per-rank
    rows: at most `max_live_steps`, and at most `max_live_rank_steps` rank-steps (so a read
    costs the same at any world size), a quarter of that in a backlog (`backlog_factor`);
    older dirty steps are left out until the worker has rolled them up. `extra=False`
    leaves the outlier lists and histograms out (they are most of a rollup row's bytes).
    `metrics=None`: all.
    """
    r = m.step_rollups.c
    # The dirty marks first, the stored rollups after (invariant 3 of the package
    # docstring): a step rolled up in between is then in one or both, never in neither.
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
        world = world_size(conn, pk)
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


__all__ = [
    "dirty_in", "dirty_versions", "in_backlog", "live_steps", "metric_names", "newest_rolled_up",
    "newest_steps", "read", "step_bounds",
]  # fmt: skip
