"""Reads: every question the API, /metrics warm-up and the dashboards ask of the store.

Each function is keyword-only, takes the `Database` as `db`, and returns plain data (dicts,
lists, numbers, strings) ready for JSON; the routes in api.py are thin wrappers, and the
HTML pages call the same functions. Names here are a stable interface:

- `list_runs(db=, project=, status=, tag=, limit=, stalled_after_s=)` -> [run]
- `get_run(db=, run_id=, stalled_after_s=, recent_steps=)` -> run | None
- `metrics_catalog(db=, run_id=)` -> {"run_id", "metrics": [{"name", "unit", "group"}]} | None
- `series(db=, run_id=, metric=, rank=, max_points=, step_from=, step_to=)` -> {...} | None
- `step_breakdown(db=, run_id=, rank=, max_points=)` -> per-step phase medians | None
- `rank_heatmap(db=, run_id=, metric=, max_steps=)` -> {ranks, steps, z} | None
- `compare(db=, run_ids=, metrics=, window=)` -> {"runs": [...]}
- `trace(db=, run_id=, step_from=, step_to=, max_steps=)` -> Chrome-trace dict | None

A *run* dict holds the stored job description (run_id, name, project, tags, zero_stage,
offload_optimizer, offload_param, precision, world_size, engine, engine_info, config,
param_count, hosts, theory, theory_comm, torch_version, zerowatch_version), its lifecycle
(status: running/finished/failed/stalled, created_at, started_at, last_event_at,
ended_at), per-rank progress (`ranks`: [{rank, steps, last_step, end_status, error}]),
`steps` (most steps stored by any rank), and recent performance (`step_time_s`: median step
time over the last `recent_steps` steps of all ranks; `samples_per_s`: the sum over ranks of
each rank's median samples/s over the same steps, i.e. the job's throughput).

Series metric names (see `metric_unit` and docs/metrics.md): step_time_s, exposed_comm_s,
grad_norm, loss, lr, loss_scale, samples_per_s, tokens_per_s, mfu, samples, tokens,
phase.<phase>, collective.<op>.{latency_s, latency_max_s, bytes, count, busbw, algbw},
offload.<d2h|h2d>.{bandwidth, bytes, seconds}, memory.peak.<phase>, memory.state.<kind>,
memory.theory.<kind>, memory.rss_peak, memory.reserved, memory.capacity, scalars.<name>.
"""

from __future__ import annotations

import itertools
import operator
import re
import statistics
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, and_, func, or_, select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.downsample import minmax_downsample

from zerowatch import events as ev

STEP_COLUMNS = {
    "step_time_s": "s",
    "exposed_comm_s": "s",
    "grad_norm": "",
    "loss": "",
    "lr": "",
    "loss_scale": "",
    "samples_per_s": "samples/s",
    "tokens_per_s": "tokens/s",
    "mfu": "",
    "samples": "samples",
    "tokens": "tokens",
}
COLLECTIVE_FIELDS = {
    "latency_s": "s",
    "latency_max_s": "s",
    "bytes": "B",
    "count": "calls",
    "busbw": "B/s",
    "algbw": "B/s",
}
OFFLOAD_FIELDS = {"bandwidth": "B/s", "bytes": "B", "seconds": "s"}
MEMORY_SCALARS = {
    "rss_peak": "rss_peak_bytes",
    "reserved": "reserved_bytes",
    "capacity": "capacity_bytes",
}


class UnknownMetric(ValueError):
    """The metric name is not one the series query knows."""


# -- runs ---------------------------------------------------------------------------------


def _status(row: Any, *, now: float, stalled_after_s: float) -> str:
    if row.status != "running":
        return str(row.status)
    last = row.last_event_at if row.last_event_at is not None else row.created_at
    return "stalled" if now - last > stalled_after_s else "running"


def _run_dict(row: Any, *, now: float, stalled_after_s: float) -> dict[str, Any]:
    return {
        "run_id": row.run_id,
        "name": row.name,
        "project": row.project,
        "tags": list(row.tags or []),
        "status": _status(row, now=now, stalled_after_s=stalled_after_s),
        "stored_status": row.status,
        "zero_stage": row.zero_stage,
        "offload_optimizer": row.offload_optimizer,
        "offload_param": row.offload_param,
        "precision": row.precision,
        "world_size": row.world_size,
        "engine": row.engine,
        "engine_info": row.engine_info or {},
        "config": row.config or {},
        "param_count": row.param_count,
        "hosts": list(row.hosts or []),
        "torch_version": row.torch_version,
        "zerowatch_version": row.zerowatch_version,
        "theory": row.theory or {},
        "theory_comm": row.theory_comm or {},
        "started_at": row.started_at,
        "created_at": row.created_at,
        "last_event_at": row.last_event_at,
        "ended_at": row.ended_at,
    }


def _ranks(conn: Connection, pk: int) -> list[dict[str, Any]]:
    rs = m.rank_states
    rows = conn.execute(
        select(
            rs.c.rank,
            rs.c.steps,
            rs.c.last_step,
            rs.c.end_status,
            rs.c.error,
            rs.c.dropped_events,
            rs.c.agent_errors,
        )
        .where(rs.c.run == pk)
        .order_by(rs.c.rank)
    ).all()
    return [
        {
            "rank": r.rank,
            "steps": r.steps,
            "last_step": r.last_step,
            "end_status": r.end_status,
            "error": r.error,
            "dropped_events": r.dropped_events,
            "agent_errors": r.agent_errors,
        }
        for r in rows
    ]


def _recent(
    conn: Connection, pk: int, *, ranks: list[dict[str, Any]], world_size: int, recent_steps: int
) -> dict[str, Any]:
    """Median step time and summed per-rank median samples/s over the newest steps."""
    last = max((r["last_step"] for r in ranks if r["last_step"] is not None), default=None)
    if last is None:
        return {"step_time_s": None, "samples_per_s": None}
    # Bound the rows read for very wide runs: at least 1 step, about 4,000 rank-steps.
    window = max(1, min(recent_steps, 4000 // max(world_size, 1)))
    s = m.steps
    rows = conn.execute(
        select(s.c.rank, s.c.step_time_s, s.c.samples_per_s).where(
            s.c.run == pk, s.c.step > last - window
        )
    ).all()
    if not rows:
        return {"step_time_s": None, "samples_per_s": None}
    per_rank: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r.samples_per_s is not None:
            per_rank[r.rank].append(r.samples_per_s)
    return {
        "step_time_s": statistics.median(r.step_time_s for r in rows),
        "samples_per_s": sum(statistics.median(v) for v in per_rank.values()) if per_rank else None,
    }


def _run_select() -> Any:
    return select(m.runs)


def list_runs(
    *,
    db: Database,
    project: str | None = None,
    status: str | None = None,
    tag: str | None = None,
    limit: int = 100,
    stalled_after_s: float = 120.0,
    recent_steps: int = 20,
    now: float | None = None,
) -> list[dict[str, Any]]:
    """Runs, newest first, filtered by project, status (incl. "stalled") and tag.

    Each item is a run dict (see the module docstring) including `ranks` and recent
    performance.
    """
    now = time.time() if now is None else now
    r = m.runs
    q = _run_select().order_by(r.c.created_at.desc(), r.c.id.desc()).limit(limit)
    if project is not None:
        q = q.where(r.c.project == project)
    if tag is not None:
        q = q.where(r.c.id.in_(select(m.run_tags.c.run).where(m.run_tags.c.tag == tag)))
    if status is not None:
        cutoff = now - stalled_after_s
        last = func.coalesce(r.c.last_event_at, r.c.created_at)
        if status == "stalled":
            q = q.where(and_(r.c.status == "running", last < cutoff))
        elif status == "running":
            q = q.where(and_(r.c.status == "running", last >= cutoff))
        else:
            q = q.where(r.c.status == status)
    out = []
    with db.read() as conn:
        for row in conn.execute(q).all():
            out.append(
                _full_run(conn, row, now=now, stalled_after_s=stalled_after_s,
                          recent_steps=recent_steps)
            )  # fmt: skip
    return out


def _full_run(
    conn: Any, row: Any, *, now: float, stalled_after_s: float, recent_steps: int
) -> dict[str, Any]:
    """The run resource of one runs-table row: its fields, ranks and recent summary."""
    run = _run_dict(row, now=now, stalled_after_s=stalled_after_s)
    run["ranks"] = _ranks(conn, row.id)
    run["steps"] = max((x["steps"] for x in run["ranks"]), default=0)
    run.update(
        _recent(
            conn, row.id, ranks=run["ranks"], world_size=row.world_size, recent_steps=recent_steps
        )
    )
    return run


def get_run(
    *,
    db: Database,
    run_id: str,
    stalled_after_s: float = 120.0,
    recent_steps: int = 20,
    now: float | None = None,
) -> dict[str, Any] | None:
    """One run dict (see the module docstring), or None if unknown."""
    now = time.time() if now is None else now
    with db.read() as conn:
        row = conn.execute(_run_select().where(m.runs.c.run_id == run_id)).first()
        if row is None:
            return None
        return _full_run(conn, row, now=now, stalled_after_s=stalled_after_s,
                         recent_steps=recent_steps)  # fmt: skip


def live_runs(*, db: Database, since: float) -> list[dict[str, Any]]:
    """Runs still running, or ended after `since` (to warm the /metrics cache at start)."""
    r = m.runs
    with db.read() as conn:
        rows = conn.execute(
            _run_select().where(or_(r.c.status == "running", r.c.ended_at >= since))
        ).all()
        return [_run_dict(row, now=time.time(), stalled_after_s=float("inf")) for row in rows]


def _pk(conn: Connection, run_id: str) -> tuple[int, int] | None:
    row = conn.execute(
        select(m.runs.c.id, m.runs.c.world_size).where(m.runs.c.run_id == run_id)
    ).first()
    return None if row is None else (row.id, row.world_size)


# -- series -------------------------------------------------------------------------------

_KEY = r"[A-Za-z0-9_./:\-]{1,100}"
_KEY_RE = re.compile(_KEY)


def _key(name: str, metric: str) -> str:
    if not _KEY_RE.fullmatch(name):
        raise UnknownMetric(f"metric {metric!r}: key {name!r} must match {_KEY}")
    return name


def metric_unit(metric: str) -> str:
    """The unit of a series metric ("s", "B", "B/s", ... or "" for plain numbers)."""
    if metric in STEP_COLUMNS:
        return STEP_COLUMNS[metric]
    head, _, rest = metric.partition(".")
    if head == "phase":
        return "s"
    if head == "collective":
        return COLLECTIVE_FIELDS.get(rest.rpartition(".")[2], "")
    if head == "offload":
        return OFFLOAD_FIELDS.get(rest.rpartition(".")[2], "")
    if head == "memory":
        return "B"
    return ""


def _step_expr(metric: str) -> Any:
    """The SQL expression of a steps-table metric, or None for a collective metric."""
    s = m.steps.c
    if metric in STEP_COLUMNS:
        return s[metric]
    head, _, rest = metric.partition(".")
    if head == "phase" and rest:
        return s.phases[_key(rest, metric)].as_float()
    if head == "scalars" and rest:
        return s.scalars[_key(rest, metric)].as_float()
    if head == "offload":
        direction, _, fld = rest.partition(".")
        if direction in ("d2h", "h2d") and fld in OFFLOAD_FIELDS:
            return s.offload[(direction, fld)].as_float()
    if head == "memory":
        sub, _, name = rest.partition(".")
        if sub in MEMORY_SCALARS and not name:
            return s.memory[MEMORY_SCALARS[sub]].as_float()
        nested = {"peak": "peak_by_phase", "state": "model_state", "theory": "model_state_theory"}
        if sub in nested and name:
            return s.memory[(nested[sub], _key(name, metric))].as_float()
    if head == "collective":
        return None
    raise UnknownMetric(
        f"unknown metric {metric!r}; see GET /api/v1/runs/{{run_id}}/metrics-catalog"
    )


def _collective_expr(metric: str) -> tuple[str, Any]:
    """(op, SQL aggregate over one rank-step's rows) of a collective metric."""
    c = m.collectives.c
    _, op, fld = [*metric.split("."), "", ""][:3]
    if op not in ev.COLLECTIVE_OPS or fld not in COLLECTIVE_FIELDS or metric.count(".") != 2:
        raise UnknownMetric(
            f"unknown metric {metric!r}: expected collective.<op>.<field> with op in "
            f"{', '.join(ev.COLLECTIVE_OPS)} and field in {', '.join(COLLECTIVE_FIELDS)}"
        )
    lat = func.sum(c.latency_sum_s)
    agg = {
        "latency_s": lat / func.nullif(func.sum(c["count"]), 0),
        "latency_max_s": func.max(c.latency_max_s),
        "bytes": func.sum(c.bytes),
        "count": func.sum(c["count"]),
        "algbw": func.sum(c.bytes) * 1.0 / func.nullif(lat, 0),
        "busbw": func.sum(c.busbw * c.latency_sum_s) / func.nullif(lat, 0),
    }[fld]
    return op, agg


def _series_query(
    pk: int,
    metric: str,
    *,
    rank: int | None,
    step_from: int | None,
    step_to: int | None,
    steps_in: list[int] | None = None,
) -> tuple[Any, Any, Any]:
    """(select of rows (rank, step, v) of one metric, the table's columns, the step expr)."""
    expr = _step_expr(metric)
    if expr is not None:
        t = m.steps.c
        step = t.step
        q = select(t.rank, t.step, expr.label("v")).where(t.run == pk)
        conds = [expr.is_not(None)]
    else:
        op, agg = _collective_expr(metric)
        t = m.collectives.c
        step = func.max(t.step)
        q = (
            select(t.rank, step.label("step"), agg.label("v"))
            .where(t.run == pk, t.op == op)
            .group_by(t.rank, t.seq)
        )
        conds = []
    if rank is not None:
        conds.append(t.rank == rank)
    if step_from is not None:
        conds.append(t.step >= step_from)
    if step_to is not None:
        conds.append(t.step <= step_to)
    if steps_in is not None:
        conds.append(t.step.in_(steps_in))
    return q.where(*conds), t, step


def _series_rows(
    conn: Connection,
    pk: int,
    metric: str,
    *,
    rank: int | None,
    step_from: int | None,
    step_to: int | None,
    steps_in: list[int] | None = None,
) -> list[Any]:
    """Tuples (rank, step, value) of one metric, in step order within each rank."""
    q, t, step = _series_query(
        pk, metric, rank=rank, step_from=step_from, step_to=step_to, steps_in=steps_in
    )
    # Order by (rank, seq), the primary key, so the index serves both the rank filter and the
    # order (ordering by step would tempt SQLite into scanning every rank's rows through the
    # (run, step) index); a rank's seq grows with its steps. On SQLite the tables are
    # clustered by that key (migration 0002), so this also reads each rank's rows together.
    # PostgreSQL's heap is in arrival order (step-major): there, all ranks read faster in
    # step order through the (run, step) index. Callers group the rows by rank.
    sqlite = conn.dialect.name == "sqlite"
    order = (t.rank, t.seq) if rank is not None or sqlite else (step, t.rank)
    # Plain tuples from the driver: the values are numbers the driver already converted, and
    # building a Row per stored point was a third of an all-rank series' time.
    return list(conn.execute(q.order_by(*order)).cursor.fetchall())


def series(
    *,
    db: Database,
    run_id: str,
    metric: str,
    rank: int | None = None,
    max_points: int = 500,
    step_from: int | None = None,
    step_to: int | None = None,
) -> dict[str, Any] | None:
    """One metric over steps, one series per rank, each downsampled to <= max_points.

    Downsampling keeps each bucket's minimum and maximum at their own steps
    (downsample.minmax_downsample), so spikes survive. The cost follows the points stored
    in the range: one rank of a 15,000-step run reads 15,000 rows; all ranks of a big run
    read all of them (narrow the range with step_from/step_to). A rank-step holding no
    value for the metric (a grad norm that was not finite, a phase that did not run) is
    left out.

    Returns:
        {"run_id", "metric", "unit", "downsampled": bool, "method", "series": [{"rank",
        "steps", "values", "points"}]} (`points`: how many stored points the series had),
        or None if the run is unknown.

    Raises:
        UnknownMetric: the metric name is not one listed in the module docstring.
    """
    _step_expr(metric) if not metric.startswith("collective.") else _collective_expr(metric)
    with db.read() as conn:
        ref = _pk(conn, run_id)
        if ref is None:
            return None
        rows = _series_rows(conn, ref[0], metric, rank=rank, step_from=step_from, step_to=step_to)
    by_rank: dict[int, tuple[list[int], list[float]]] = {}
    for rk, group in itertools.groupby(rows, key=operator.itemgetter(0)):
        xs, ys = by_rank.setdefault(rk, ([], []))
        for _, step, v in group:
            if v is not None:
                xs.append(int(step))
                ys.append(float(v))
    out, downsampled = [], False
    for rk, (xs, ys) in sorted(by_rank.items()):
        if not xs:
            continue
        dx, dy = minmax_downsample(xs, ys, max_points)
        downsampled |= len(dx) < len(xs)
        out.append({"rank": rk, "steps": dx, "values": dy, "points": len(xs)})
    return {
        "run_id": run_id,
        "metric": metric,
        "unit": metric_unit(metric),
        "downsampled": downsampled,
        "method": "minmax",
        "series": out,
    }


def metrics_catalog(*, db: Database, run_id: str) -> dict[str, Any] | None:
    """The series metric names that hold data for this run (from its newest steps)."""
    with db.read() as conn:
        ref = _pk(conn, run_id)
        if ref is None:
            return None
        pk = ref[0]
        s = m.steps
        last = conn.execute(select(func.max(s.c.step)).where(s.c.run == pk)).scalar()
        names: list[tuple[str, str]] = []
        if last is not None:
            rows = conn.execute(
                select(s).where(s.c.run == pk, s.c.step >= last - 2).limit(300)
            ).all()
            for col in STEP_COLUMNS:
                if any(getattr(r, col) is not None for r in rows):
                    names.append((col, "step"))
            keys: dict[str, set[str]] = defaultdict(set)
            for r in rows:
                keys["phase"].update(r.phases or {})
                keys["scalars"].update(r.scalars or {})
                for d, vals in (r.offload or {}).items():
                    keys["offload"].update(f"{d}.{f}" for f in vals)
                mem = r.memory or {}
                keys["memory.peak"].update(mem.get("peak_by_phase") or {})
                keys["memory.state"].update(mem.get("model_state") or {})
                keys["memory.theory"].update(mem.get("model_state_theory") or {})
                for short, long in MEMORY_SCALARS.items():
                    if mem.get(long):
                        keys["memory"].add(short)
            for group, found in keys.items():
                names.extend(
                    (f"{group}.{k}", group.split(".")[0])
                    for k in sorted(found)
                    if _KEY_RE.fullmatch(k)
                )
            c = m.collectives
            ops = [  # one indexed probe of (run, op, step) per op
                op
                for op in ev.COLLECTIVE_OPS
                if conn.execute(
                    select(c.c.step)
                    .where(c.c.run == pk, c.c.op == op, c.c.step >= last - 2)
                    .limit(1)
                ).first()
            ]
            for op in sorted(ops):
                names.extend((f"collective.{op}.{f}", "collective") for f in COLLECTIVE_FIELDS)
    return {
        "run_id": run_id,
        "metrics": [{"name": n, "unit": metric_unit(n), "group": g} for n, g in names],
    }


def step_breakdown(
    *, db: Database, run_id: str, rank: int | None = None, max_points: int = 500
) -> dict[str, Any] | None:
    """Per step: step time, exposed communication and each phase, as medians over ranks.

    Steps are thinned evenly to at most `max_points`; a run wider than 64 ranks is
    summarised over every k-th rank (at most 64), so the cost is bounded.

    Returns:
        {"run_id", "rank", "steps": [...], "step_time_s": [...], "exposed_comm_s": [...],
        "phases": {phase: [...]}} (None where a step lacks that phase), or None.
    """
    with db.read() as conn:
        ref = _pk(conn, run_id)
        if ref is None:
            return None
        pk, world = ref
        s = m.steps.c
        lo, hi = conn.execute(select(func.min(s.step), func.max(s.step)).where(s.run == pk)).one()
        if lo is None:
            return {
                "run_id": run_id,
                "rank": rank,
                "steps": [],
                "step_time_s": [],
                "exposed_comm_s": [],
                "phases": {},
            }
        stride = max(1, -(-(hi - lo + 1) // max_points))
        conds = [s.run == pk]
        if stride > 1:  # index lookups of the sampled steps, not a scan of the run
            conds.append(s.step.in_(list(range(lo, hi + 1, stride))))
        if rank is not None:
            conds.append(s.rank == rank)
        elif world > 64:
            conds.append(s.rank % (-(-world // 64)) == 0)
        rows = conn.execute(
            select(s.step, s.step_time_s, s.exposed_comm_s, s.phases).where(*conds)
        ).all()
    per_step: dict[int, list[Any]] = defaultdict(list)
    for r in rows:
        per_step[int(r.step)].append(r)
    steps_sorted = sorted(per_step)
    phase_names = sorted(
        {p for r in rows for p in (r.phases or {})},
        key=lambda p: (ev.PHASES.index(p) if p in ev.PHASES else 99, p),
    )
    phases: dict[str, list[float | None]] = {p: [] for p in phase_names}
    st, ex = [], []
    for step in steps_sorted:
        rs = per_step[step]
        st.append(statistics.median(r.step_time_s for r in rs))
        ex.append(statistics.median(r.exposed_comm_s for r in rs))
        for p in phase_names:
            vals = [r.phases[p] for r in rs if p in (r.phases or {})]
            phases[p].append(statistics.median(vals) if vals else None)
    return {
        "run_id": run_id,
        "rank": rank,
        "steps": steps_sorted,
        "step_time_s": st,
        "exposed_comm_s": ex,
        "phases": phases,
    }


def rank_heatmap(
    *, db: Database, run_id: str, metric: str = "step_time_s", max_steps: int = 200
) -> dict[str, Any] | None:
    """A metric per rank over the newest `max_steps` steps, and the slowest rank.

    Returns:
        {"run_id", "metric", "unit", "ranks": [...], "steps": [...], "z": [[value or None
        per step] per rank], "straggler": {"rank", "median", "ratio_to_median"} | None}.
    """
    with db.read() as conn:
        ref = _pk(conn, run_id)
        if ref is None:
            return None
        pk = ref[0]
        last = conn.execute(select(func.max(m.steps.c.step)).where(m.steps.c.run == pk)).scalar()
        rows = (
            []
            if last is None
            else _series_rows(
                conn, pk, metric, rank=None, step_from=int(last) - max_steps + 1, step_to=None
            )
        )
    steps_sorted = sorted({int(step) for _, step, _ in rows})
    index = {st: i for i, st in enumerate(steps_sorted)}
    grid: dict[int, list[float | None]] = {}
    for rk, step, v in rows:
        row = grid.setdefault(int(rk), [None] * len(steps_sorted))
        row[index[int(step)]] = None if v is None else float(v)
    ranks = sorted(grid)
    medians = {
        rk: statistics.median(v for v in grid[rk] if v is not None)
        for rk in ranks
        if any(v is not None for v in grid[rk])
    }
    straggler = None
    if len(medians) >= 2:
        worst = max(medians, key=lambda k: medians[k])
        overall = statistics.median(medians.values())
        straggler = {
            "rank": worst,
            "median": medians[worst],
            "ratio_to_median": medians[worst] / overall if overall else None,
        }
    return {
        "run_id": run_id,
        "metric": metric,
        "unit": metric_unit(metric),
        "ranks": ranks,
        "steps": steps_sorted,
        "z": [grid[r] for r in ranks],
        "straggler": straggler,
    }


# -- compare ------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _newest_memory(conn: Connection, pk: int, *, last: int, lo: int) -> dict[int, Any]:
    """Each rank's newest memory record in [lo, last]: the newest 10 steps first (memory
    records are the widest column), the whole window only if those hold none."""
    s = m.steps.c
    newest: dict[int, Any] = {}
    for start in (max(lo, last - 9), lo):
        for r in conn.execute(
            select(s.rank, s.step, s.memory).where(s.run == pk, s.step >= start, s.step <= last)
        ):
            if r.memory and (r.rank not in newest or r.step > newest[r.rank].step):
                newest[r.rank] = r
        if newest or start == lo:
            break
    return newest


def _compare_one(conn: Connection, row: Any, *, metrics: list[str], window: int) -> dict[str, Any]:
    pk, world = row.id, max(row.world_size, 1)
    s = m.steps.c
    last = conn.execute(select(func.max(s.step)).where(s.run == pk)).scalar()
    run = {
        k: getattr(row, k)
        for k in (
            "run_id",
            "name",
            "project",
            "zero_stage",
            "offload_optimizer",
            "offload_param",
            "precision",
            "world_size",
            "param_count",
            "engine",
            "status",
        )
    }
    theory = dict(row.theory or {})
    out: dict[str, Any] = {
        "run": run,
        "steps_compared": 0,
        "model_state_bytes": {
            "measured": {},
            "theory": theory,
            "measured_total": None,
            "theory_total": sum(theory.values()) if theory else None,
        },
        "memory_peak_bytes": None,
        "comm_bytes_per_step": {"measured": {}, "theory": dict(row.theory_comm or {})},
        "step_time_s": None,
        "exposed_comm_s": None,
        "phases_s": {},
        "samples_per_s": None,
        "metrics": {},
    }
    if last is None:
        return out
    w = max(1, min(window, 20000 // world))
    lo = int(last) - w + 1
    rows = conn.execute(
        select(s.rank, s.step, s.step_time_s, s.exposed_comm_s, s.phases, s.samples_per_s).where(
            s.run == pk, s.step >= lo
        )
    ).all()
    out["steps_compared"] = len({r.step for r in rows})
    out["step_time_s"] = _median([r.step_time_s for r in rows])
    out["exposed_comm_s"] = _median([r.exposed_comm_s for r in rows])
    phase_vals: dict[str, list[float]] = defaultdict(list)
    sps: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        for p, v in (r.phases or {}).items():
            phase_vals[p].append(v)
        if r.samples_per_s is not None:
            sps[r.rank].append(r.samples_per_s)
    newest = _newest_memory(conn, pk, last=int(last), lo=lo)
    out["phases_s"] = {
        p: _median(v)
        for p, v in sorted(
            phase_vals.items(),
            key=lambda kv: (ev.PHASES.index(kv[0]) if kv[0] in ev.PHASES else 99, kv[0]),
        )
    }
    out["samples_per_s"] = sum(_median(v) or 0.0 for v in sps.values()) if sps else None
    state: dict[str, list[float]] = defaultdict(list)
    peaks: list[int] = []
    for r in newest.values():
        for k, v in (r.memory.get("model_state") or {}).items():
            state[k].append(v)
        peaks.extend((r.memory.get("peak_by_phase") or {}).values())
    measured = {k: _median(v) for k, v in state.items()}
    out["model_state_bytes"]["measured"] = measured
    out["model_state_bytes"]["measured_total"] = (
        sum(v or 0 for v in measured.values()) if measured else None
    )
    out["memory_peak_bytes"] = max(peaks) if peaks else None
    c = m.collectives.c
    by_op: dict[str, list[float]] = defaultdict(list)
    for op in ev.COLLECTIVE_OPS:  # one indexed range read of (run, op, step) per op
        per = conn.execute(
            select(func.sum(c.bytes))
            .where(c.run == pk, c.op == op, c.step >= lo)
            .group_by(c.rank, c.step)
        ).scalars()
        by_op[op].extend(float(b) for b in per)
    out["comm_bytes_per_step"]["measured"] = {
        op: _median(v) for op, v in sorted(by_op.items()) if v
    }
    for metric in metrics:
        mrows = _series_rows(conn, pk, metric, rank=None, step_from=lo, step_to=None)
        out["metrics"][metric] = _median([float(v) for _, _, v in mrows if v is not None])
    return out


def compare(
    *, db: Database, run_ids: list[str], metrics: list[str] | None = None, window: int = 100
) -> dict[str, Any]:
    """The same summary quantities for several runs, side by side.

    Per run, over its newest `window` steps (fewer for very wide runs, about 20,000
    rank-steps at most): model-state bytes per rank measured (median over ranks, newest
    step) next to the theory, the peak memory of any rank, bytes per step of each collective
    op measured (median over rank-steps, nccl-tests size) next to the theory, the median
    step time, exposed communication and each phase, the job's samples/s, and the median of
    each extra series metric in `metrics`.

    Returns:
        {"runs": [...] in the order asked, "missing": [run ids not found]}.

    Raises:
        UnknownMetric: a name in `metrics` is not a series metric.
    """
    metrics = metrics or []
    for metric in metrics:
        _step_expr(metric) if not metric.startswith("collective.") else _collective_expr(metric)
    out, missing = [], []
    with db.read() as conn:
        for run_id in run_ids:
            row = conn.execute(_run_select().where(m.runs.c.run_id == run_id)).first()
            if row is None:
                missing.append(run_id)
                continue
            out.append(_compare_one(conn, row, metrics=metrics, window=window))
    return {"runs": out, "missing": missing}


# -- trace --------------------------------------------------------------------------------

_TIDS = {"step": 0, "phase": 1, "collective": 2, "offload": 3}


def trace(
    *,
    db: Database,
    run_id: str,
    step_from: int | None = None,
    step_to: int | None = None,
    max_steps: int = 200,
) -> dict[str, Any] | None:
    """Chrome-trace / Perfetto JSON of a run's steps.

    One process (pid) per rank, named "rank N", with threads "steps" (one slice per step,
    from the stored step times), "phases", "collectives" and "offload" (the raw spans of
    the steps the agent sampled). Slices are complete events ("ph": "X"), times in
    microseconds since the earliest slice. Without a range: the newest `max_steps` steps;
    a range is cut to `max_steps` steps from its start.

    Returns:
        {"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}}, or None.
    """
    with db.read() as conn:
        ref = _pk(conn, run_id)
        if ref is None:
            return None
        pk = ref[0]
        s = m.steps.c
        if step_from is None and step_to is None:
            last = conn.execute(select(func.max(s.step)).where(s.run == pk)).scalar()
            hi = int(last) if last is not None else 0
            lo = max(0, hi - max_steps + 1)
        else:
            lo = step_from if step_from is not None else 0
            hi = step_to if step_to is not None else lo + max_steps - 1
        hi = min(hi, lo + max_steps - 1)
        step_rows = conn.execute(
            select(s.rank, s.step, s.time, s.step_time_s)
            .where(s.run == pk, s.step >= lo, s.step <= hi)
            .order_by(s.rank, s.step)
        ).all()
        sp = m.spans.c
        span_rows = conn.execute(
            select(sp.rank, sp.step, sp.spans)
            .where(sp.run == pk, sp.step >= lo, sp.step <= hi)
            .order_by(sp.rank, sp.step)
        ).all()
    slices: list[tuple[int, int, str, str, float, float, dict[str, Any]]] = []
    for r in step_rows:
        slices.append(
            (
                r.rank,
                0,
                f"step {r.step}",
                "step",
                r.time - r.step_time_s,
                r.time,
                {"step": r.step, "step_time_s": r.step_time_s},
            )
        )
    for r in span_rows:
        for span in r.spans or []:
            cat = str(span.get("cat", "phase"))
            args = dict(span.get("args") or {})
            args["step"] = r.step
            slices.append(
                (
                    r.rank,
                    _TIDS.get(cat, 1),
                    str(span.get("name", "?")),
                    cat,
                    float(span["start"]),
                    float(span["end"]),
                    args,
                )
            )
    t0 = min((x[4] for x in slices), default=0.0)
    events: list[dict[str, Any]] = []
    for rank in sorted({x[0] for x in slices}):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
        for tname, tid in _TIDS.items():
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": tname + "s" if tname != "offload" else tname},
                }
            )
    for rank, tid, name, cat, start, end, args in slices:
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat,
                "pid": rank,
                "tid": tid,
                "ts": round((start - t0) * 1e6, 3),
                "dur": round(max(end - start, 0.0) * 1e6, 3),
                "args": args,
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {
            "run_id": run_id,
            "steps": [lo, hi],
            "t0_unix_s": t0,
            "sampled_steps": sorted({int(r.step) for r in span_rows}),
        },
    }


# -- warm start ---------------------------------------------------------------------------


def latest_steps(*, db: Database, run_id: str) -> list[ev.StepEvent]:
    """Each rank's newest stored step, rebuilt as a StepEvent (to warm the live cache)."""
    with db.read() as conn:
        ref = _pk(conn, run_id)
        if ref is None:
            return []
        pk = ref[0]
        s, rs, c = m.steps, m.rank_states, m.collectives
        last = {
            r.rank: r.last_step
            for r in conn.execute(
                select(rs.c.rank, rs.c.last_step).where(rs.c.run == pk, rs.c.last_step.is_not(None))
            )
        }
        # Read by step through the (run, step) indexes: the ranks' last steps are few values.
        wanted = sorted(set(last.values()))
        rows = [
            r
            for r in conn.execute(select(s).where(s.c.run == pk, s.c.step.in_(wanted))).all()
            if last.get(r.rank) == r.step
        ]
        # The collectives by each of those steps' primary key (run, rank, seq): read by step,
        # SQLite without statistics scans every collective row of the run instead.
        coll_rows: list[Any] = []
        for r in rows:
            key = (c.c.run == pk, c.c.rank == r.rank, c.c.seq == r.seq)
            coll_rows.extend(conn.execute(select(c).where(*key, c.c.op.in_(ev.COLLECTIVE_OPS))))
        colls: dict[tuple[int, int], list[ev.CollectiveStats]] = defaultdict(list)
        for r in coll_rows:
            colls[(r.rank, r.seq)].append(
                ev.CollectiveStats(
                    op=r.op,
                    purpose=r.purpose,
                    count=r.count,
                    bytes=r.bytes,
                    latency_sum_s=r.latency_sum_s,
                    latency_max_s=r.latency_max_s,
                    buckets=list(r.buckets),
                    world_size=r.world_size,
                    algbw_bytes_per_s=r.algbw,
                    busbw_bytes_per_s=r.busbw,
                    async_count=r.async_count,
                )
            )
    out = []
    for r in rows:
        mem = r.memory or {}
        out.append(
            ev.StepEvent(
                rank=r.rank,
                seq=r.seq,
                step=r.step,
                time=r.time,
                step_time_s=r.step_time_s,
                phases=dict(r.phases or {}),
                collectives=colls[(r.rank, r.seq)],
                exposed_comm_s=r.exposed_comm_s,
                offload=[
                    ev.OffloadStats(
                        direction=d,
                        bytes=int(v.get("bytes", 0)),
                        seconds=float(v.get("seconds", 0.0)),
                        bandwidth_bytes_per_s=float(v.get("bandwidth", 0.0)),
                    )
                    for d, v in (r.offload or {}).items()
                ],
                memory=ev.MemoryStats(**mem) if mem else None,
                grad_norm=r.grad_norm,
                clipped=r.clipped,
                loss=r.loss,
                loss_scale=r.loss_scale,
                skipped=r.skipped,
                nonfinite=r.nonfinite,
                lr=r.lr,
                samples=r.samples,
                tokens=r.tokens,
                samples_per_s=r.samples_per_s,
                tokens_per_s=r.tokens_per_s,
                mfu=r.mfu,
                scalars=dict(r.scalars or {}),
            )
        )
    return out


__all__ = [
    "UnknownMetric",
    "compare",
    "get_run",
    "latest_steps",
    "list_runs",
    "live_runs",
    "metric_unit",
    "metrics_catalog",
    "rank_heatmap",
    "series",
    "step_breakdown",
    "trace",
]
