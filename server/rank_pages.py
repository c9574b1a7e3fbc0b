"""Reads for the rank view and the node view (dashboards.rank), on the one read model.

Both draw the run page's sample steps (page_queries.sample_steps, at most `MAX_POINTS`).
The run's reference at each step is the median over ranks (the rollups' p50; for the
exclusive parts the mean, which adds up to the mean step). The rank's own values, or a
host's ranks', are read from the per-rank rows of those ranks only
(`series.rank_rows(..., ranks=[...], steps_in=steps)`), so a page costs what its steps and
its ranks hold, never the run's world size.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

from sqlalchemy import Connection, select
from zerowatch.dashboards.data import Series
from zerowatch.dashboards.rank import HostRank, HostView, RankView, ratio_to_median
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.page_queries import MAX_POINTS, sample_steps
from zerowatch.server.read import metric_table, rollups, runs, series
from zerowatch.server.read.doctor_evidence import gpu_health
from zerowatch.server.read.rollups import Stats
from zerowatch.server.read.vocabulary import rank_values_of

from zerowatch import events as ev

#: Most ranks the node view lists (a host is usually 8 ranks; a run that reported no host
#: names has every rank on host "").
MAX_HOST_RANKS = series.MAX_SELECTED_RANKS


def _p50(per_step: dict[int, Stats], steps: list[int]) -> Series:
    xs = [s for s in steps if s in per_step]
    return Series(xs, [per_step[s].p50 for s in xs])


def _own(conn: Connection, pk: int, metric: str, ranks: list[int],
         steps: list[int]) -> dict[int, Series]:  # fmt: skip
    """{rank: its series of `metric` at `steps`} from those ranks' own rows."""
    rows = series.rank_rows(conn, pk, metric, ranks=ranks, step_from=None, step_to=None,
                            steps_in=steps)  # fmt: skip
    out: dict[int, Series] = {}
    for rk, group in itertools.groupby(rows, key=operator.itemgetter(0)):
        # A rank with several rows for a step (a restart that replayed it): the newest wins.
        by_step = {int(st): float(v) for _, st, v in group if v is not None}
        xs = sorted(by_step)
        out[int(rk)] = Series(xs, [by_step[s] for s in xs])
    return out


def _gpu(conn: Connection, pk: int, ranks: list[int], steps: list[int]) -> dict[int, dict]:
    """{rank: its GPU health over `steps`} (doctor_evidence.gpu_health) of the ranks that
    sent GPU telemetry, from their rows at those steps."""
    s = m.steps.c
    rows = conn.execute(
        select(*(s[c] for c in metric_table.ROLLUP_COLUMNS))
        .where(s.run == pk, s.rank.in_(ranks), s.step.in_(steps), s.gpu.is_not(None))
        .order_by(s.seq)
    ).all()
    per_rank: dict[int, dict[int, dict[str, float]]] = {}
    for r, values in zip(rows, rank_values_of([r._mapping for r in rows], [() for _ in rows]),
                         strict=True):  # fmt: skip
        per_rank.setdefault(int(r.rank), {})[int(r.step)] = values
    out = {}
    for rank, per_step in per_rank.items():
        health = gpu_health(per_step)
        if health is not None:
            out[rank] = health
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _run_and_steps(
    conn: Connection, run_id: str, max_points: int
) -> tuple[int, list[int], int] | None:
    pk = runs.run_pk(conn, run_id)
    if pk is None:
        return None
    bounds = rollups.step_bounds(conn, pk)
    if bounds is None:
        return pk, [], -1
    return pk, sample_steps(bounds[0], bounds[1], max_points), bounds[1]


def rank_view(
    *,
    db: Database,
    run_id: str,
    rank: int,
    max_points: int = MAX_POINTS,
    stalled_after_s: float = 120.0,
    recent_steps: int = 20,
) -> RankView | None:
    """One rank's data next to the run's median (see the module docstring), or None for an
    unknown run or a rank outside its world size."""
    run = runs.get_run(db=db, run_id=run_id, stalled_after_s=stalled_after_s,
                       recent_steps=recent_steps)  # fmt: skip
    if run is None or not 0 <= rank < int(run["world_size"]):
        return None
    view = RankView(run=run, rank=rank)
    with db.read() as conn:
        got = _run_and_steps(conn, run_id, max_points)
        if got is None:
            return None
        pk, steps, view.last_step = got
        rs = m.rank_states.c
        state = conn.execute(
            select(rs.host, rs.local_rank).where(rs.run == pk, rs.rank == rank)
        ).first()
        if state is not None:
            view.host, view.local_rank = state.host, state.local_rank
        if not steps:
            return view
        have = rollups.metric_names(conn, pk)
        ops = [op for op in ev.COLLECTIVE_OPS if not have or f"collective.{op}.latency_s" in have]
        names = ["step_time_s", "busy_s", "grad_norm", "loss", "lr",
                 *(f"part.{p}" for p in ev.STEP_PARTS if not have or f"part.{p}" in have),
                 *(f"collective.{op}.{f}" for op in ops for f in ("latency_s", "busbw"))]  # fmt: skip
        stats = rollups.read(conn, pk, names, steps_in=steps)
        mine = {name: _own(conn, pk, name, [rank], steps).get(rank, Series()) for name in names}
        _memory(conn, pk, rank, view)
        view.gpu = _gpu(conn, pk, [rank], steps).get(rank)
        if view.gpu is not None:
            view.gpu_clock = _own(conn, pk, "gpu.sm_clock_ratio", [rank], steps).get(rank, Series())
            view.gpu_throttled = _own(conn, pk, "gpu.throttled", [rank], steps).get(rank, Series())
            clock = rollups.read(conn, pk, ["gpu.sm_clock_ratio"], steps_in=steps)
            view.gpu_clock_median = _p50(clock.get("gpu.sm_clock_ratio", {}), steps)
    view.steps = list(mine["step_time_s"].steps)
    none: dict[int, Stats] = {}
    for attr, name in (("step_time", "step_time_s"), ("busy", "busy_s"),
                       ("grad_norm", "grad_norm"), ("loss", "loss"), ("lr", "lr")):  # fmt: skip
        setattr(view, attr, mine[name])
        setattr(view, f"{attr}_median", _p50(stats.get(name, none), steps))
    for p in ev.STEP_PARTS:
        own = mine.get(f"part.{p}")
        if not own:
            continue
        per_step = stats.get(f"part.{p}", none)
        at = [s for s in own.steps if s in per_step]
        view.parts[p] = _mean([v for v in own.values if v is not None]) or 0.0
        view.parts_run[p] = _mean([per_step[s].mean for s in at]) or 0.0
    for op in ops:
        view.latency[op] = mine[f"collective.{op}.latency_s"]
        view.busbw[op] = mine[f"collective.{op}.busbw"]
        view.latency_median[op] = _p50(stats.get(f"collective.{op}.latency_s", none), steps)
        view.busbw_median[op] = _p50(stats.get(f"collective.{op}.busbw", none), steps)
    return view


def _memory(conn: Connection, pk: int, rank: int, view: RankView) -> None:
    """The rank's peaks by phase and model state at its newest step holding memory, and the
    median rank's at that step (the rollups of memory.peak.<phase>, memory.state.<kind>)."""
    s = m.steps.c
    row = conn.execute(
        select(s.step, s.memory).where(s.run == pk, s.rank == rank).order_by(s.seq.desc()).limit(1)
    ).first()
    mem: dict[str, Any] = (row.memory or {}) if row is not None else {}
    if row is None or not mem:
        return
    step = int(row.step)
    view.memory_step = step
    view.peaks = {k: float(v) for k, v in (mem.get("peak_by_phase") or {}).items() if v is not None}
    view.model_state = {k: float(v) for k, v in (mem.get("model_state") or {}).items()
                        if v is not None}  # fmt: skip
    names = [*(f"memory.peak.{k}" for k in view.peaks),
             *(f"memory.state.{k}" for k in view.model_state)]  # fmt: skip
    got = rollups.read(conn, pk, names, steps_in=[step]) if names else {}
    for k in view.peaks:
        st = got.get(f"memory.peak.{k}", {}).get(step)
        if st is not None:
            view.peaks_median[k] = st.p50
    for k in view.model_state:
        st = got.get(f"memory.state.{k}", {}).get(step)
        if st is not None:
            view.model_state_median[k] = st.p50


def host_view(
    *,
    db: Database,
    run_id: str,
    host: str,
    max_points: int = MAX_POINTS,
    stalled_after_s: float = 120.0,
    recent_steps: int = 20,
) -> HostView | None:
    """The ranks of one host: busy time per rank at the sampled steps, the run's median, and
    each rank's mean and ratio to the median (furthest above first); None for an unknown run
    or a host with no rank of the run."""
    run = runs.get_run(db=db, run_id=run_id, stalled_after_s=stalled_after_s,
                       recent_steps=recent_steps)  # fmt: skip
    if run is None:
        return None
    with db.read() as conn:
        got = _run_and_steps(conn, run_id, max_points)
        if got is None:
            return None
        pk, steps, _ = got
        rs = m.rank_states.c
        on_host = conn.execute(
            select(rs.rank, rs.local_rank).where(rs.run == pk, rs.host == host)
            .order_by(rs.rank).limit(MAX_HOST_RANKS)
        ).all()  # fmt: skip
        if not on_host:
            return None
        ranks = [int(r.rank) for r in on_host]
        busy = _own(conn, pk, "busy_s", ranks, steps) if steps else {}
        gpus = _gpu(conn, pk, ranks, steps) if steps else {}
        median = (
            _p50(rollups.read(conn, pk, ["busy_s"], steps_in=steps)["busy_s"], steps)
            if steps
            else Series()
        )
    rows = []
    for r in on_host:
        mine = busy.get(int(r.rank), Series())
        rows.append(HostRank(rank=int(r.rank), local_rank=r.local_rank, busy=mine,
                             mean_busy_s=_mean([v for v in mine.values if v is not None]),
                             ratio=ratio_to_median(mine, median),
                             gpu=gpus.get(int(r.rank))))  # fmt: skip
    rows.sort(key=lambda h: (h.ratio is None, -(h.ratio or 0.0), h.rank))
    return HostView(run=run, host=host, steps=list(median.steps), busy_median=median, ranks=rows)


__all__ = ["MAX_HOST_RANKS", "host_view", "rank_view"]
