"""Series: one metric over steps, as rank statistics (the default) or for selected ranks.

The rank selection decides what is read:

- `stats` (default): the rollups, one row per step whatever the world size: min, p10, p50,
  p90, max and mean over ranks, and the ranks at the min and the max.
- `rank=N`, `ranks="0-7,12"`, `host=NAME`: those ranks' own rows.
- `top=K`: the K ranks that stand out in the range (highest values, or lowest for
  bandwidths and throughputs), chosen from the rollups' outlier lists, then their rows.

A selection of ranks costs what those ranks stored in the range; "all ranks" of a 4,096-rank
run costs what a 2-rank run does, because it is the stats.
"""

from __future__ import annotations

import itertools
import operator
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.downsample import minmax_downsample
from zerowatch.server.read import metric_table, rollups, vocabulary
from zerowatch.server.read.runs import run_pk
from zerowatch.server.read.vocabulary import UnknownMetric, metric_unit

from zerowatch import events as ev

#: Most ranks one selection may name.
MAX_SELECTED_RANKS = 256


class BadSelection(ValueError):
    """A rank selection that does not parse or names too many ranks."""


@dataclass(frozen=True)
class Selection:
    """Which ranks a read is about: stats (None everywhere), or ranks, a host, or top K."""

    ranks: tuple[int, ...] | None = None
    host: str | None = None
    top: int | None = None

    @property
    def is_stats(self) -> bool:
        return self.ranks is None and self.host is None and self.top is None

    @classmethod
    def parse(
        cls,
        *,
        rank: int | None = None,
        ranks: str | None = None,
        host: str | None = None,
        top: int | None = None,
    ) -> Selection:
        """From the API's query parameters (at most one of them).

        Raises:
            BadSelection: more than one given, a range that does not parse, too many ranks.
        """
        given = [n for n, v in (("rank", rank), ("ranks", ranks), ("host", host), ("top", top))
                 if v is not None]  # fmt: skip
        if len(given) > 1:
            raise BadSelection(f"give one rank selection, not {' and '.join(given)}")
        if rank is not None:
            if rank < 0:
                raise BadSelection(f"rank: must be >= 0, got {rank}")
            return cls(ranks=(rank,))
        if ranks is not None:
            if ranks.strip() in ("", "stats"):
                return cls()
            return cls(ranks=parse_ranks(ranks))
        if top is not None:
            if not 1 <= top <= MAX_SELECTED_RANKS:
                raise BadSelection(f"top: must be 1 to {MAX_SELECTED_RANKS}, got {top}")
            return cls(top=top)
        if host is not None:
            return cls(host=host)
        return cls()


def parse_ranks(text: str) -> tuple[int, ...]:
    """ "0-7,12" -> (0, 1, ..., 7, 12).

    Raises:
        BadSelection: not a list of ranks and ranges, or more than MAX_SELECTED_RANKS.
    """
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise BadSelection(
                f"ranks: expected ranks and ranges like 0-7,12, got {part!r}"
            ) from None
        if a < 0 or b < a:
            raise BadSelection(f"ranks: {part!r} is not a range of ranks >= 0")
        if b - a + 1 + len(out) > MAX_SELECTED_RANKS:
            raise BadSelection(f"ranks: at most {MAX_SELECTED_RANKS} ranks in one selection")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


#: Metrics where a low value is the bad one (the outliers are the lowest).
def low_is_bad(metric: str) -> bool:
    return metric.endswith(("busbw", "algbw", ".bandwidth")) or metric in (
        "samples_per_s",
        "tokens_per_s",
        "mfu",
    )


# -- per-rank rows --------------------------------------------------------------------------


def rank_rows(
    conn: Connection,
    pk: int,
    metric: str,
    *,
    ranks: Sequence[int] | None,
    step_from: int | None,
    step_to: int | None,
    steps_in: Sequence[int] | None = None,
) -> list[tuple[int, int, Any]]:
    """Tuples (rank, step, value) of one metric, in step order within each rank."""
    expr = vocabulary.step_expr(metric) if not metric.startswith("collective.") else None
    if expr is not None:
        t = m.steps.c
        q = select(t.rank, t.step, expr.label("v")).where(t.run == pk, expr.is_not(None))
    else:
        op, agg = vocabulary.collective_expr(metric)
        t = m.collectives.c
        q = (
            select(t.rank, func.max(t.step).label("step"), agg.label("v"))
            .where(t.run == pk, t.op == op)
            .group_by(t.rank, t.seq)
        )
    conds = []
    if ranks is not None:
        conds.append(t.rank.in_(list(ranks)))
    if step_from is not None:
        conds.append(t.step >= step_from)
    if step_to is not None:
        conds.append(t.step <= step_to)
    if steps_in is not None:
        conds.append(t.step.in_(list(steps_in)))
    # (rank, seq) is the primary key: the index serves the rank filter and the order.
    return list(conn.execute(q.where(*conds).order_by(t.rank, t.seq)).cursor.fetchall())


def _ranks_on_host(conn: Connection, pk: int, host: str) -> tuple[int, ...]:
    rs = m.rank_states.c
    return tuple(
        int(r)
        for r in conn.execute(
            select(rs.rank).where(rs.run == pk, rs.host == host).order_by(rs.rank)
        ).scalars()
    )


def outliers(
    conn: Connection,
    pk: int,
    metric: str,
    *,
    k: int,
    step_from: int | None = None,
    step_to: int | None = None,
    low: bool | None = None,
    live: bool = True,
) -> list[dict[str, Any]]:
    """The `k` ranks that stand out in the range, from the rollups' outlier lists
    (`live=False`: the stored rollups alone, see rollups.read).

    A rank's score is how many steps it sits among a step's outliers (the `ReadTuning.top_k` highest,
    or lowest where `low`), then its mean value there: a rank slow in every step comes
    first. Metrics without outlier lists fall back to the rank at each step's max (min).

    Returns:
        [{"rank", "steps": how many steps it stood out, "mean": its mean value there,
        "median": the run's median of the per-step medians}] worst first.
    """
    low = low_is_bad(metric) if low is None else low
    got = rollups.read(
        conn, pk, [metric], step_from=step_from, step_to=step_to, extra=True, live=live
    )
    per_step = got[metric]
    seen: Counter[int] = Counter()
    sums: dict[int, float] = defaultdict(float)
    for st in per_step.values():
        ends = st.extra.get("lo" if low else "hi")
        pairs = ends if ends else [[st.min_rank if low else st.max_rank, st.min if low else st.max]]
        for rank, v in pairs:
            seen[int(rank)] += 1
            sums[int(rank)] += float(v)
    order = sorted(seen, key=lambda r: (-seen[r], (1 if low else -1) * sums[r] / seen[r], r))[:k]
    median = statistics.median(st.p50 for st in per_step.values()) if per_step else None
    return [
        {"rank": r, "steps": seen[r], "mean": sums[r] / seen[r], "median": median} for r in order
    ]


def outliers_of(
    *,
    db: Database,
    run_id: str,
    metric: str = "busy_s",
    k: int = 8,
    step_from: int | None = None,
    step_to: int | None = None,
) -> dict[str, Any] | None:
    """`outliers` of a run by id, each with its host: {"run_id", "metric", "unit", "low",
    "ranks": [...]} or None for an unknown run."""
    vocabulary.check(metric)
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        found = outliers(conn, pk, metric, k=k, step_from=step_from, step_to=step_to)
        hosts = host_map(conn, pk, [o["rank"] for o in found])
    return {
        "run_id": run_id,
        "metric": metric,
        "unit": metric_unit(metric),
        "low": low_is_bad(metric),
        "ranks": [{**o, "host": hosts.get(o["rank"])} for o in found],
    }


# -- the series read --------------------------------------------------------------------------


def _stats_series(
    conn: Connection, pk: int, metric: str, *, max_points: int, step_from: int | None,
    step_to: int | None,
) -> dict[str, Any]:  # fmt: skip
    per_step = rollups.read(conn, pk, [metric], step_from=step_from, step_to=step_to)[metric]
    steps = list(per_step)
    values = list(per_step.values())
    stride = max(1, -(-len(steps) // max(max_points, 1)))
    xs: list[int] = []
    cols: dict[str, list[float]] = {s: [] for s in metric_table.STATS}
    n: list[int] = []
    min_rank: list[int] = []
    max_rank: list[int] = []
    for i in range(0, len(steps), stride):
        group = values[i : i + stride]
        xs.append(steps[min(i + stride, len(steps)) - 1])
        lo = min(group, key=lambda st: st.min)
        hi = max(group, key=lambda st: st.max)
        cols["min"].append(lo.min)
        cols["max"].append(hi.max)
        for s in ("p10", "p50", "p90", "mean"):
            cols[s].append(sum(st.get(s) for st in group) / len(group))
        n.append(max(st.n for st in group))
        min_rank.append(lo.min_rank)
        max_rank.append(hi.max_rank)
    return {
        "selection": "stats",
        "downsampled": stride > 1,
        "method": "bucket: min of min, max of max, mean of p10/p50/p90/mean" if stride > 1
        else "none",
        "steps": xs,
        "stats": cols,
        "n": n,
        "min_rank": min_rank,
        "max_rank": max_rank,
        "series": [{"stat": s, "steps": xs, "values": cols[s], "points": len(steps)}
                   for s in metric_table.STATS],
    }  # fmt: skip


def series(
    *,
    db: Database,
    run_id: str,
    metric: str,
    selection: Selection | None = None,
    rank: int | None = None,
    max_points: int = 500,
    step_from: int | None = None,
    step_to: int | None = None,
) -> dict[str, Any] | None:
    """One metric over steps: rank statistics, or one series per selected rank.

    Per-rank series are downsampled keeping each bucket's min and max at their own steps
    (downsample.minmax_downsample), so spikes survive.

    Returns:
        {"run_id", "metric", "unit", "selection", "downsampled", "method", "series": [...]}
        where each series is {"stat", "steps", "values", "points"} for the stats (also
        given as "steps", "stats": {stat: [...]}, "n", "min_rank", "max_rank") or
        {"rank", "host", "steps", "values", "points"} per rank; None if the run is unknown.

    Raises:
        UnknownMetric: the metric name is not in the vocabulary.
    """
    vocabulary.check(metric)
    sel = selection or (Selection(ranks=(rank,)) if rank is not None else Selection())
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        head = {"run_id": run_id, "metric": metric, "unit": metric_unit(metric)}
        if sel.is_stats:
            return {**head, **_stats_series(conn, pk, metric, max_points=max_points,
                                            step_from=step_from, step_to=step_to)}  # fmt: skip
        if sel.top is not None:
            found = outliers(conn, pk, metric, k=sel.top, step_from=step_from, step_to=step_to)
            chosen = tuple(o["rank"] for o in found)
            label = f"top={sel.top}"
        elif sel.host is not None:
            chosen = _ranks_on_host(conn, pk, sel.host)
            label = f"host={sel.host}"
        else:
            chosen = sel.ranks or ()
            label = "ranks"
        rows = rank_rows(conn, pk, metric, ranks=chosen, step_from=step_from, step_to=step_to)
        hosts = host_map(conn, pk, chosen)
    by_rank: dict[int, tuple[list[int], list[float]]] = {}
    for rk, group in itertools.groupby(rows, key=operator.itemgetter(0)):
        xs, ys = by_rank.setdefault(rk, ([], []))
        for _, step, v in group:
            if v is not None:
                xs.append(int(step))
                ys.append(float(v))
    out, downsampled = [], False
    for rk in chosen:
        if rk not in by_rank or not by_rank[rk][0]:
            continue
        xs, ys = by_rank[rk]
        dx, dy = minmax_downsample(xs, ys, max_points)
        downsampled |= len(dx) < len(xs)
        out.append({"rank": rk, "host": hosts.get(rk), "steps": dx, "values": dy,
                    "points": len(xs)})  # fmt: skip
    return {**head, "selection": label, "ranks": list(chosen), "downsampled": downsampled,
            "method": "minmax", "series": out}  # fmt: skip


def host_map(conn: Connection, pk: int, ranks: Sequence[int]) -> dict[int, str | None]:
    """{rank: host} for some ranks of a run."""
    if not ranks:
        return {}
    rs = m.rank_states.c
    return {
        int(r.rank): r.host
        for r in conn.execute(
            select(rs.rank, rs.host).where(rs.run == pk, rs.rank.in_(list(ranks)))
        )
    }


def metrics_catalog(*, db: Database, run_id: str) -> dict[str, Any] | None:
    """The metric names that hold data for this run (from its newest rolled-up step)."""
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        bounds = rollups.step_bounds(conn, pk)
        names: set[str] = set()
        if bounds is not None:
            last = bounds[1]
            names.update(rollups.metric_names(conn, pk))
            if not names:
                names.update(rollups.compute(conn, pk, [last]).get(last, {}))

    def group(name: str) -> str:
        if name in metric_table.STEP_METRIC:
            return "step"
        return name.split(".")[0]

    ordered = sorted(names, key=lambda n: (group(n) != "step", group(n), n))
    return {
        "run_id": run_id,
        "metrics": [{"name": n, "unit": metric_unit(n), "group": group(n)} for n in ordered],
    }


def _phase_order(name: str) -> tuple[int, str]:
    return (ev.PHASES.index(name) if name in ev.PHASES else 99, name)


def step_breakdown(
    *, db: Database, run_id: str, rank: int | None = None, max_points: int = 500
) -> dict[str, Any] | None:
    """Per step: step time, exposed and hidden communication, each phase and each exclusive
    part, as the median over ranks (the rollups' p50), or one rank's own values.

    Steps are thinned evenly to at most `max_points`. `parts` add up to `step_time_s` at
    every step of a rank (the agent's decomposition); their medians over ranks add up
    approximately. `phases` nest (see docs/timing.md) and are not to be stacked.

    Returns:
        {"run_id", "rank", "steps", "step_time_s", "exposed_comm_s", "hidden_comm_s",
        "phases": {phase: [...]}, "parts": {part: [...]}} (None where a step lacks one),
        or None for an unknown run.
    """
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        bounds = rollups.step_bounds(conn, pk)
        empty: dict[str, Any] = {"run_id": run_id, "rank": rank, "steps": [], "step_time_s": [],
                 "exposed_comm_s": [], "hidden_comm_s": [], "phases": {}, "parts": {}}  # fmt: skip
        if bounds is None:
            return empty
        lo, hi = bounds
        stride = max(1, -(-(hi - lo + 1) // max_points))
        wanted = list(range(lo, hi + 1, stride))
        names = ["step_time_s", "exposed_comm_s", "hidden_comm_s",
                 *(f"phase.{p}" for p in ev.PHASES), *(f"part.{p}" for p in ev.STEP_PARTS)]  # fmt: skip
        if rank is None:
            got = rollups.read(conn, pk, names, steps_in=wanted)
            table = {name: {st: v.p50 for st, v in per.items()} for name, per in got.items()}
        else:
            table = {}
            for name in names:
                rows = rank_rows(conn, pk, name, ranks=[rank], step_from=None, step_to=None,
                                 steps_in=wanted)  # fmt: skip
                table[name] = {int(step): float(v) for _, step, v in rows if v is not None}
    steps = sorted(set(table["step_time_s"]))

    def col(name: str) -> list[float | None]:
        return [table[name].get(st) for st in steps]

    return {
        "run_id": run_id,
        "rank": rank,
        "steps": steps,
        "step_time_s": col("step_time_s"),
        "exposed_comm_s": col("exposed_comm_s"),
        "hidden_comm_s": col("hidden_comm_s"),
        "phases": {
            p: col(f"phase.{p}") for p in sorted(ev.PHASES, key=_phase_order)
            if table[f"phase.{p}"]
        },
        "parts": {p: col(f"part.{p}") for p in ev.STEP_PARTS if table[f"part.{p}"]},
    }  # fmt: skip


#: A rank is the straggler when its mean where it stood out is this much above the median.
STRAGGLER_THRESHOLD = 0.05
#: Most rows a heatmap draws; wider runs are drawn in blocks of ranks.
HEATMAP_ROWS = 256
#: Most rank-steps one heatmap reads.
HEATMAP_BUDGET = 120_000


def rank_heatmap(
    *,
    db: Database,
    run_id: str,
    metric: str = "step_time_s",
    max_steps: int = 200,
    agg: str = "max",
) -> dict[str, Any] | None:
    """A metric per rank (or per block of ranks) over the newest steps, and the straggler.

    Up to HEATMAP_ROWS ranks get a row each; a wider run is drawn in blocks of consecutive
    ranks (torchrun numbers a node's ranks consecutively, so a block of the node size is a
    node), each cell the block's `agg` ("max" or "median"). Steps are the newest
    `max_steps`, fewer for a wide run (at most HEATMAP_BUDGET rank-steps read).

    Returns:
        {"run_id", "metric", "unit", "agg", "block": ranks per row, "rows": [{"label",
        "first", "last"}], "ranks": [first rank of each row], "top_ranks": [the rank of
        each row with the highest total of the metric over the steps read], "steps", "z":
        [[...] per row], "straggler": {"rank", "host", "steps", "mean", "median", "ratio_to_median"}
        | None} (a straggler stands STRAGGLER_THRESHOLD above the median).
    """
    vocabulary.check(metric)
    if agg not in ("max", "median"):
        raise UnknownMetric(f"agg: expected max or median, got {agg!r}")
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        world = int(
            conn.execute(select(m.runs.c.world_size).where(m.runs.c.id == pk)).scalar() or 1
        )
        bounds = rollups.step_bounds(conn, pk)
        n_steps = max(1, min(max_steps, HEATMAP_BUDGET // max(world, 1)))
        rows = (
            []
            if bounds is None
            else rank_rows(
                conn,
                pk,
                metric,
                ranks=None,
                step_from=bounds[1] - n_steps + 1,
                step_to=bounds[1],
            )
        )
        outl = outliers(conn, pk, metric, k=1,
                        step_from=None if bounds is None else bounds[1] - n_steps + 1)  # fmt: skip
        hosts = host_map(conn, pk, [outl[0]["rank"]]) if outl else {}
    block = max(1, -(-world // HEATMAP_ROWS))
    steps = sorted({int(step) for _, step, _ in rows})
    index = {st: i for i, st in enumerate(steps)}
    cells: dict[int, list[list[float]]] = {}
    totals: dict[int, float] = {}
    for rk, step, v in rows:
        if v is None:
            continue
        row = cells.get(int(rk) // block)
        if row is None:
            row = cells[int(rk) // block] = [[] for _ in steps]
        row[index[int(step)]].append(float(v))
        totals[int(rk)] = totals.get(int(rk), 0.0) + float(v)
    reduce = max if agg == "max" else statistics.median
    keys = sorted(cells)
    z = [[reduce(c) if c else None for c in cells[b]] for b in keys]
    # Each row's rank with the most of the metric over the steps read: where a click on a
    # block's row leads (the rank that makes the block stand out, not its first).
    top: dict[int, int] = {}
    for rk, total in totals.items():
        b = rk // block
        if b not in top or total > totals[top[b]]:
            top[b] = rk
    labels = [
        {"label": f"rank {b}" if block == 1 else f"ranks {b * block}-{min(world, (b + 1) * block) - 1}",
         "first": b * block, "last": min(world, (b + 1) * block) - 1}
        for b in keys
    ]  # fmt: skip
    straggler = None
    if outl and world >= 2 and outl[0]["median"]:
        o = outl[0]
        ratio = o["mean"] / o["median"]
        if ratio > 1 + STRAGGLER_THRESHOLD:
            straggler = {**o, "host": hosts.get(o["rank"]), "ratio_to_median": ratio}
    return {
        "run_id": run_id,
        "metric": metric,
        "unit": metric_unit(metric),
        "agg": agg if block > 1 else "value",
        "block": block,
        "rows": labels,
        "ranks": [b * block for b in keys],
        "top_ranks": [top[b] for b in keys],
        "steps": steps,
        "z": z,
        "straggler": straggler,
    }


__all__ = [
    "HEATMAP_ROWS",
    "MAX_SELECTED_RANKS",
    "BadSelection",
    "Selection",
    "host_map",
    "low_is_bad",
    "metrics_catalog",
    "outliers",
    "outliers_of",
    "parse_ranks",
    "rank_heatmap",
    "rank_rows",
    "series",
    "step_breakdown",
]
