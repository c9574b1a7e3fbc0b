"""Runs: the run resource, the runs list, a run's ranks and hosts, and its recent figures.

A *run* dict holds the stored job description (run_id, name, project, tags, zero_stage,
offload_optimizer, offload_param, precision, world_size, engine, engine_info, config,
param_count, hosts, theory, theory_comm, torch_version, zerowatch_version, job), its lifecycle
(status: running/finished/failed/stalled, created_at, started_at, last_event_at, ended_at),
`steps` (most steps stored by any rank), `rank_summary` (how many ranks reported, ended,
failed, lag behind; how many hosts), `ranks` (every rank up to `RANKS_INLINE` ranks; above
that only the ranks that failed or lag behind, at most `RANKS_INLINE`: the full list is
`ranks_of`), and the recent figures (`recent`): the same definitions the pages, compare
and /metrics use.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from sqlalchemy import Connection, and_, case, func, or_, select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.read import rollups

#: Ranks listed inside the run resource; wider runs list the ones that stand out.
RANKS_INLINE = 64


def status_of(row: Any, *, now: float, stalled_after_s: float) -> str:
    """A stored run's status, with "stalled" for a running run that went quiet."""
    if row.status != "running":
        return str(row.status)
    last = row.last_event_at if row.last_event_at is not None else row.created_at
    return "stalled" if now - last > stalled_after_s else "running"


def run_dict(row: Any, *, now: float, stalled_after_s: float) -> dict[str, Any]:
    """The stored fields of one runs-table row."""
    return {
        "run_id": row.run_id,
        "name": row.name,
        "project": row.project,
        "tags": list(row.tags or []),
        "status": status_of(row, now=now, stalled_after_s=stalled_after_s),
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
        "job": row.job,
        "created_at": row.created_at,
        "last_event_at": row.last_event_at,
        "ended_at": row.ended_at,
    }


def _rank_dict(r: Any) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "host": r.host,
        "local_rank": r.local_rank,
        "steps": r.steps,
        "last_step": r.last_step,
        "end_status": r.end_status,
        "error": r.error,
        "dropped_events": r.dropped_events,
        "agent_errors": r.agent_errors,
    }


def _rank_cols() -> list[Any]:
    rs = m.rank_states.c
    return [rs.rank, rs.host, rs.local_rank, rs.steps, rs.last_step, rs.end_status, rs.error,
            rs.dropped_events, rs.agent_errors]  # fmt: skip


def rank_summary(conn: Connection, pk: int) -> dict[str, Any]:
    """Counts over a run's ranks, one aggregate query."""
    rs = m.rank_states.c
    row = conn.execute(
        select(
            func.count(),
            func.max(rs.steps),
            func.max(rs.last_step),
            func.min(rs.last_step),
            func.sum(case((rs.end_status == "finished", 1), else_=0)),
            func.sum(case((rs.end_status == "failed", 1), else_=0)),
            func.count(func.distinct(rs.host)),
            func.sum(rs.dropped_events),
        ).where(rs.run == pk)
    ).one()
    n, steps, last, first_last, finished, failed, hosts, dropped = row
    return {
        "reported": int(n or 0),
        "steps": int(steps or 0),
        "last_step": None if last is None else int(last),
        "min_last_step": None if first_last is None else int(first_last),
        "finished": int(finished or 0),
        "failed": int(failed or 0),
        "hosts": int(hosts or 0),
        "dropped_events": int(dropped or 0),
    }


def _inline_ranks(conn: Connection, pk: int, world: int, last: int | None) -> list[dict[str, Any]]:
    rs = m.rank_states.c
    q = select(*_rank_cols()).where(rs.run == pk)
    if world > RANKS_INLINE:
        behind = rs.last_step < (last if last is not None else 0)
        q = q.where(or_(rs.end_status == "failed", rs.error.is_not(None), behind))
    return [_rank_dict(r) for r in conn.execute(q.order_by(rs.rank).limit(RANKS_INLINE))]


def ranks_of(
    *,
    db: Database,
    run_id: str,
    host: str | None = None,
    rank_from: int | None = None,
    rank_to: int | None = None,
    limit: int = 1000,
) -> dict[str, Any] | None:
    """A run's ranks (host, progress, how each ended), filtered by host or a rank range."""
    rs = m.rank_states.c
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        conds = [rs.run == pk]
        if host is not None:
            conds.append(rs.host == host)
        if rank_from is not None:
            conds.append(rs.rank >= rank_from)
        if rank_to is not None:
            conds.append(rs.rank <= rank_to)
        rows = conn.execute(
            select(*_rank_cols()).where(*conds).order_by(rs.rank).limit(limit)
        ).all()
    return {"run_id": run_id, "ranks": [_rank_dict(r) for r in rows]}


def hosts_of(*, db: Database, run_id: str) -> dict[str, Any] | None:
    """A run's hosts and the ranks on each: [{"host", "ranks": [...]}], by host name."""
    rs = m.rank_states.c
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        rows = conn.execute(
            select(rs.host, rs.rank).where(rs.run == pk).order_by(rs.host, rs.rank)
        ).all()
    hosts: dict[str, list[int]] = {}
    for r in rows:
        hosts.setdefault(r.host or "", []).append(int(r.rank))
    return {"run_id": run_id, "hosts": [{"host": h, "ranks": rk} for h, rk in hosts.items()]}


def recent(conn: Connection, pk: int, *, recent_steps: int) -> dict[str, Any]:
    """The run's recent figures, over its newest `recent_steps` steps (rollups only).

    step_time_s: median over those steps of the per-step median over ranks;
    samples_per_s / tokens_per_s: median over those steps of the job's throughput (the sum
    over ranks, mean x n); mfu: median over those steps of the mean over ranks (the job's
    model FLOP/s over its devices' peak: each rank reports its own share); exposed_comm_s,
    busy_s: medians of the per-step medians.
    """
    steps = rollups.newest_steps(conn, pk, "step_time_s", recent_steps)
    out: dict[str, Any] = {"step_time_s": None, "samples_per_s": None, "tokens_per_s": None,
                           "mfu": None, "exposed_comm_s": None, "busy_s": None,
                           "steps": steps}  # fmt: skip
    if not steps:
        return out
    names = ["step_time_s", "exposed_comm_s", "busy_s", "samples_per_s", "tokens_per_s", "mfu"]
    got = rollups.read(conn, pk, names, steps_in=steps)
    for name in ("step_time_s", "exposed_comm_s", "busy_s"):
        vals = [st.p50 for st in got[name].values()]
        out[name] = statistics.median(vals) if vals else None
    for name in ("samples_per_s", "tokens_per_s"):
        vals = [st.mean * st.n for st in got[name].values()]
        out[name] = statistics.median(vals) if vals else None
    mfu = [st.mean for st in got["mfu"].values()]
    out["mfu"] = statistics.median(mfu) if mfu else None
    return out


def run_pk(conn: Connection, run_id: str) -> int | None:
    """The integer key of a run, or None."""
    pk = conn.execute(select(m.runs.c.id).where(m.runs.c.run_id == run_id)).scalar()
    return None if pk is None else int(pk)


def full_run(
    conn: Connection,
    row: Any,
    *,
    now: float,
    stalled_after_s: float,
    recent_steps: int,
    ranks: bool = True,
) -> dict[str, Any]:
    """The run resource of one runs-table row (see the module docstring).

    `ranks=False` leaves out `rank_summary` and `ranks`, which read every rank's state (a
    4,096-rank run's 4,096 rows), for the pages that show neither; `steps` is then the
    newest step + 1, from the rollups' index."""
    run = run_dict(row, now=now, stalled_after_s=stalled_after_s)
    if ranks:
        summary = rank_summary(conn, row.id)
        run["rank_summary"] = summary
        run["ranks"] = _inline_ranks(conn, row.id, row.world_size, summary["last_step"])
        run["steps"] = summary["steps"]
    else:
        bounds = rollups.step_bounds(conn, row.id)
        run["steps"] = bounds[1] + 1 if bounds is not None else 0
    rec = recent(conn, row.id, recent_steps=recent_steps)
    run["recent"] = rec
    run["step_time_s"] = rec["step_time_s"]
    run["samples_per_s"] = rec["samples_per_s"]
    run["tokens_per_s"] = rec["tokens_per_s"]
    run["mfu"] = rec["mfu"]
    return run


def list_runs(
    *,
    db: Database,
    project: str | None = None,
    status: str | None = None,
    tag: str | None = None,
    limit: int = 100,
    offset: int = 0,
    stalled_after_s: float = 120.0,
    recent_steps: int = 20,
    now: float | None = None,
    ranks: bool = True,
) -> list[dict[str, Any]]:
    """Runs, newest first, filtered by project, status (incl. "stalled") and tag, `limit`
    of them after the first `offset` (`ranks=False`: without the rank summaries, see
    `full_run`)."""
    now = time.time() if now is None else now
    r = m.runs
    q = select(r).order_by(r.c.created_at.desc(), r.c.id.desc()).limit(limit).offset(offset)
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
    with db.read() as conn:
        return [
            full_run(conn, row, now=now, stalled_after_s=stalled_after_s,
                     recent_steps=recent_steps, ranks=ranks)
            for row in conn.execute(q).all()
        ]  # fmt: skip


def get_run(
    *,
    db: Database,
    run_id: str,
    stalled_after_s: float = 120.0,
    recent_steps: int = 20,
    now: float | None = None,
    ranks: bool = True,
) -> dict[str, Any] | None:
    """One run dict (see the module docstring), or None if unknown (`ranks=False`: without
    its rank summary, see `full_run`)."""
    now = time.time() if now is None else now
    with db.read() as conn:
        row = conn.execute(select(m.runs).where(m.runs.c.run_id == run_id)).first()
        if row is None:
            return None
        return full_run(conn, row, now=now, stalled_after_s=stalled_after_s,
                        recent_steps=recent_steps, ranks=ranks)  # fmt: skip


def run_record(
    *, db: Database, run_id: str, stalled_after_s: float = 120.0, now: float | None = None
) -> dict[str, Any] | None:
    """The run's own record (what was created, and its status), without the rank summary
    and recent performance of `get_run`: what POST /runs answers. It costs the same at any
    world size, which matters when every rank of a large job creates its run at once."""
    now = time.time() if now is None else now
    with db.read() as conn:
        row = conn.execute(select(m.runs).where(m.runs.c.run_id == run_id)).first()
        return None if row is None else run_dict(row, now=now, stalled_after_s=stalled_after_s)


def live_rows(
    conn: Connection, *, now: float, grace_s: float, forget_after_s: float, limit: int
) -> tuple[list[Any], int]:
    """Runs /metrics exposes: running and heard from within `forget_after_s`, or ended less
    than `grace_s` ago; the `limit` most recently active of them, in the order they were
    created. Returns (those rows, how many live runs were left out)."""
    r = m.runs.c
    last = func.coalesce(r.last_event_at, r.created_at)
    live = or_(
        and_(r.status == "running", last >= now - forget_after_s),
        and_(r.status != "running", func.coalesce(r.ended_at, last) >= now - grace_s),
    )
    rows = conn.execute(
        select(m.runs).where(live).order_by(last.desc(), r.id.desc()).limit(limit)
    ).all()
    left_out = 0
    if len(rows) == limit:
        total = conn.execute(select(func.count()).select_from(m.runs).where(live)).scalar()
        left_out = int(total or 0) - limit
    return sorted(rows, key=lambda row: row.id), left_out


__all__ = [
    "RANKS_INLINE",
    "full_run",
    "get_run",
    "hosts_of",
    "list_runs",
    "live_rows",
    "rank_summary",
    "ranks_of",
    "recent",
    "run_dict",
    "run_pk",
    "status_of",
]
