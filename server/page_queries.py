"""Reads for the HTML pages: one run's charts, and runs side by side, as dashboards.data.

A run page draws a dozen charts. Asking the store a dozen times for a dozen downsampled
series would read a big run a dozen times; instead the page picks *sample steps* once (at
most `max_points`, evenly spaced over the run, all of them for a short run) and reads those
rank-steps with index lookups on (run, step) and (run, op, step): the cost follows the
number of points drawn, not the number stored, so a run of a million rank-steps draws as
fast as one of a thousand. Every chart on the page reads the same sampled steps, so the
charts line up on one x axis.

Very wide runs read fewer sample steps (at most `row_budget` rank-steps in all), so a
1,000-rank job still answers at once.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, func, select
from zerowatch.dashboards.data import RankGrid, RunSummary, RunView, Series, SizePoints
from zerowatch.server import models as m
from zerowatch.server import queries
from zerowatch.server.db import Database

from zerowatch import events as ev

#: Most sample steps a chart draws.
MAX_POINTS = 400
#: Most rank-steps one page reads.
ROW_BUDGET = 60_000
#: Steps whose memory records (the widest column) the memory chart reads.
MEMORY_POINTS = 16


def sample_steps(first: int, last: int, n: int) -> list[int]:
    """At most `n` steps evenly spaced from `first` to `last`, both included."""
    if last < first:
        return []
    span = last - first + 1
    if span <= n:
        return list(range(first, last + 1))
    if n <= 1:
        return [last]
    return sorted({first + round(i * (span - 1) / (n - 1)) for i in range(n)})


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _step_range(conn: Connection, pk: int, run: dict[str, Any]) -> tuple[int, int] | None:
    last = max((r["last_step"] for r in run["ranks"] if r["last_step"] is not None), default=None)
    if last is None:
        return None
    first = conn.execute(select(func.min(m.steps.c.step)).where(m.steps.c.run == pk)).scalar()
    return (int(first), int(last)) if first is not None else None


def _pk(conn: Connection, run_id: str) -> int | None:
    return conn.execute(select(m.runs.c.id).where(m.runs.c.run_id == run_id)).scalar()


def _read_steps(conn: Connection, pk: int, steps: Sequence[int]) -> list[Any]:
    s = m.steps
    cols = (s.c.rank, s.c.step, s.c.step_time_s, s.c.exposed_comm_s, s.c.grad_norm, s.c.clipped,
            s.c.loss, s.c.lr, s.c.loss_scale, s.c.skipped, s.c.samples_per_s, s.c.phases,
            s.c.offload, s.c.seq)  # fmt: skip
    return _rows_at(conn, pk, steps, cols)


def _read_memory(conn: Connection, pk: int, steps: Sequence[int]) -> list[Any]:
    """The memory records of a few of the sampled steps (newest last): peaks change slowly,
    and decoding a memory record per sampled rank-step would cost more than the chart."""
    if len(steps) > MEMORY_POINTS:
        stride = len(steps) / MEMORY_POINTS
        steps = sorted({steps[int(i * stride)] for i in range(MEMORY_POINTS)} | {steps[-1]})
    s = m.steps
    return _rows_at(conn, pk, steps, (s.c.rank, s.c.step, s.c.memory))


def _rows_at(conn: Connection, pk: int, steps: Sequence[int], cols: Sequence[Any]) -> list[Any]:
    s = m.steps
    q = select(*cols).where(s.c.run == pk)
    if steps and steps[-1] - steps[0] + 1 == len(steps):
        q = q.where(s.c.step.between(steps[0], steps[-1]))
    else:
        q = q.where(s.c.step.in_(list(steps)))
    return list(conn.execute(q.order_by(s.c.step, s.c.rank)).all())


def _read_collectives(
    conn: Connection, pk: int, steps: Sequence[int], step_rows: Sequence[Any]
) -> list[Any]:
    """The collective aggregates of the sampled steps (`step_rows`: their (rank, seq))."""
    c = m.collectives
    cols = (c.c.rank, c.c.step, c.c.op, c.c.count, c.c.bytes, c.c.latency_sum_s, c.c.busbw)
    rows: list[Any] = []
    if conn.dialect.name == "sqlite":
        # Without ANALYZE statistics SQLite prefers the clustered primary key's (run) prefix,
        # which reads every row of the run, to the (run, op, step) index (it needs columns
        # the index lacks): measured 1.6 s against 0.03 s for 400 of 128,000 steps of 8 ranks.
        # The sampled steps' (rank, seq) keys are the primary key's own prefix instead.
        seqs: dict[int, list[int]] = defaultdict(list)
        for r in step_rows:
            seqs[r.rank].append(r.seq)
        for rank, rank_seqs in sorted(seqs.items()):
            q = select(*cols).where(c.c.run == pk, c.c.rank == rank, c.c.seq.in_(rank_seqs),
                                    c.c.op.in_(ev.COLLECTIVE_OPS))  # fmt: skip
            rows.extend(conn.execute(q).all())
        return rows
    for op in ev.COLLECTIVE_OPS:  # one index range per op: (run, op, step)
        q = select(*cols).where(c.c.run == pk, c.c.op == op)
        if steps and steps[-1] - steps[0] + 1 == len(steps):
            q = q.where(c.c.step.between(steps[0], steps[-1]))
        else:
            q = q.where(c.c.step.in_(list(steps)))
        rows.extend(conn.execute(q).all())
    return rows


def _series(by_step: dict[int, list[float | None]], steps: Sequence[int]) -> Series:
    xs = [s for s in steps if s in by_step]
    return Series(xs, [_mean(by_step[s]) for s in xs])


def run_view(
    *,
    db: Database,
    run_id: str,
    max_points: int = MAX_POINTS,
    row_budget: int = ROW_BUDGET,
    stalled_after_s: float = 120.0,
    recent_steps: int = 20,
) -> RunView | None:
    """The run page's data (see the module docstring), or None for an unknown run."""
    run = queries.get_run(db=db, run_id=run_id, stalled_after_s=stalled_after_s,
                          recent_steps=recent_steps)  # fmt: skip
    if run is None:
        return None
    view = RunView(run=run, theory={k: float(v) for k, v in (run.get("theory") or {}).items()})
    with db.read() as conn:
        pk = _pk(conn, run_id)
        rng = _step_range(conn, pk, run) if pk is not None else None
        if pk is None or rng is None:
            return view
        n = max(2, min(max_points, row_budget // max(int(run["world_size"]), 1)))
        steps = sample_steps(rng[0], rng[1], n)
        step_rows = _read_steps(conn, pk, steps)
        memory_rows = _read_memory(conn, pk, steps)
        coll_rows = _read_collectives(conn, pk, steps, step_rows)
    view.last_step = rng[1]
    _fill_steps(view, step_rows)
    _fill_memory(view, memory_rows)
    _fill_collectives(view, coll_rows)
    return view


def _fill_steps(view: RunView, rows: list[Any]) -> None:
    step_time: dict[int, list[float | None]] = defaultdict(list)
    exposed: dict[int, list[float | None]] = defaultdict(list)
    phases: dict[str, dict[int, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    offload: dict[str, dict[int, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    grad_norm: dict[int, list[float | None]] = defaultdict(list)
    loss: dict[int, list[float | None]] = defaultdict(list)
    lr: dict[int, list[float | None]] = defaultdict(list)
    loss_scale: dict[int, list[float | None]] = defaultdict(list)
    heat: dict[int, dict[int, float]] = defaultdict(dict)
    clipped: set[int] = set()
    skipped: set[int] = set()
    for r in rows:
        step_time[r.step].append(r.step_time_s)
        exposed[r.step].append(r.exposed_comm_s)
        heat[r.rank][r.step] = r.step_time_s
        for name, seconds in (r.phases or {}).items():
            phases[name][r.step].append(seconds)
        for direction, o in (r.offload or {}).items():
            offload[direction][r.step].append(o.get("bandwidth"))
        grad_norm[r.step].append(r.grad_norm)
        loss[r.step].append(r.loss)
        lr[r.step].append(r.lr)
        loss_scale[r.step].append(r.loss_scale)
        if r.clipped:
            clipped.add(r.step)
        if r.skipped:
            skipped.add(r.step)
    steps = sorted(step_time)
    view.steps = steps
    view.step_time = _series(step_time, steps)
    view.exposed_comm = _series(exposed, steps)
    view.phases = {p: _series(v, steps) for p, v in phases.items()}
    view.offload = {d: _series(v, steps) for d, v in offload.items()}
    view.grad_norm = _series(grad_norm, steps)
    view.loss = _series(loss, steps)
    view.lr = _series(lr, steps)
    view.loss_scale = _series(loss_scale, steps)
    view.clipped_steps = sorted(clipped)
    view.skipped_steps = sorted(skipped)
    ranks = sorted(heat)
    view.heat = RankGrid(ranks, steps, [[heat[r].get(s) for s in steps] for r in ranks])


def _fill_memory(view: RunView, rows: list[Any]) -> None:
    capacity = 0.0
    for r in rows:  # in step order: the newest model state wins
        mem = r.memory or {}
        if not mem:
            continue
        peaks = view.peaks.setdefault(r.rank, {})
        for phase, b in (mem.get("peak_by_phase") or {}).items():
            peaks[phase] = max(peaks.get(phase, 0.0), float(b))
        if mem.get("model_state"):
            view.model_state[r.rank] = {k: float(v) for k, v in mem["model_state"].items()}
        if mem.get("model_state_theory") and not view.theory:
            view.theory = {k: float(v) for k, v in mem["model_state_theory"].items()}
        capacity = max(capacity, float(mem.get("capacity_bytes") or 0))
    view.capacity_bytes = capacity or None


def _fill_collectives(view: RunView, rows: list[Any]) -> None:
    # Per op and step, over ranks: latency per call = total latency / total calls; bus
    # bandwidth = mean of the ranks' bytes-weighted figures; size per call = bytes / calls.
    acc: dict[str, dict[int, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        acc[r.op][r.step].append(r)
    for op, by_step in acc.items():
        steps = sorted(by_step)
        lat, bw, sizes, size_bw, size_steps = [], [], [], [], []
        for s in steps:
            rs = by_step[s]
            calls = sum(r.count for r in rs)
            lat.append(sum(r.latency_sum_s for r in rs) / calls if calls else None)
            bw.append(_mean(r.busbw for r in rs))
            if calls:
                sizes.append(sum(r.bytes for r in rs) / calls)
                size_bw.append(_mean(r.busbw for r in rs) or 0.0)
                size_steps.append(s)
        view.latency[op] = Series(steps, lat)
        view.busbw[op] = Series(steps, bw)
        view.sizes[op] = SizePoints(sizes, size_bw, size_steps)


def projects(*, db: Database) -> list[str]:
    """Every project that has a run, sorted (for the runs page's filter)."""
    with db.read() as conn:
        rows = conn.execute(select(m.runs.c.project).distinct().order_by(m.runs.c.project))
        return [r.project for r in rows]


# -- compare --------------------------------------------------------------------------------


def run_summary(
    *, db: Database, run_id: str, window: int = 50, stalled_after_s: float = 120.0
) -> tuple[dict[str, Any], RunSummary] | None:
    """A run's means over its newest `window` steps (all ranks), for the compare page."""
    run = queries.get_run(db=db, run_id=run_id, stalled_after_s=stalled_after_s)
    if run is None:
        return None
    with db.read() as conn:
        pk = _pk(conn, run_id)
        rng = _step_range(conn, pk, run) if pk is not None else None
        window = max(1, min(window, ROW_BUDGET // max(int(run["world_size"]), 1)))
        steps = sample_steps(max(rng[0], rng[1] - window + 1), rng[1], window) if rng else []
        step_rows = _read_steps(conn, pk, steps) if steps and pk is not None else []
        memory_rows = _read_memory(conn, pk, steps[-1:]) if steps and pk is not None else []
        coll_rows = (
            _read_collectives(conn, pk, steps, step_rows) if steps and pk is not None else []
        )
    phases: dict[str, list[float]] = defaultdict(list)
    per_rank_sps: dict[int, list[float]] = defaultdict(list)
    model_state: dict[int, dict[str, float]] = {}
    for r in step_rows:
        for name, seconds in (r.phases or {}).items():
            phases[name].append(seconds)
        if r.samples_per_s is not None:
            per_rank_sps[r.rank].append(r.samples_per_s)
    for r in memory_rows:
        if (r.memory or {}).get("model_state"):
            model_state[r.rank] = {k: float(v) for k, v in r.memory["model_state"].items()}
    # Bytes per step per rank by op: total over the (rank, step)s read, divided by their number.
    rank_steps = {(r.rank, r.step) for r in step_rows} or {(r.rank, r.step) for r in coll_rows}
    comm: dict[str, float] = defaultdict(float)
    for c in coll_rows:
        comm[c.op] += c.bytes
    kinds = {k for ms in model_state.values() for k in ms}
    summary = RunSummary(
        run_id=run["run_id"],
        name=run["name"],
        zero_stage=int(run["zero_stage"]),
        world_size=int(run["world_size"]),
        model_state={k: _mean(ms.get(k) for ms in model_state.values()) or 0.0 for k in kinds},
        model_state_theory={k: float(v) for k, v in (run.get("theory") or {}).items()},
        comm_bytes={op: b / len(rank_steps) for op, b in comm.items()} if rank_steps else {},
        comm_bytes_theory={k: float(v) for k, v in (run.get("theory_comm") or {}).items()},
        phases={p: statistics.fmean(v) for p, v in phases.items()},
        step_time_s=_mean(r.step_time_s for r in step_rows),
        samples_per_s=sum(statistics.median(v) for v in per_rank_sps.values())
        if per_rank_sps
        else None,
    )
    return run, summary


__all__ = ["MAX_POINTS", "ROW_BUDGET", "projects", "run_summary", "run_view", "sample_steps"]
