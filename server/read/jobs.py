"""Checkpoints and jobs: each run's checkpoint calls, and the runs of one job across its
restarts with where the job's time went (goodput).

A checkpoint *call* is one `save_checkpoint` / `load_checkpoint` on every rank: the ranks'
rows of one (op, step, tag) in a run, timed by the slowest rank (the job waits for it),
its bytes summed over the ranks, its bandwidth the bytes over that time.

A *job* is the runs that share `runs.job` (the user's name, the SLURM job id, torchrun's
run id), in the order they started. Its wall time, from the first run's start to the last
step of the newest, is cut into parts that add up to it (`PARTS`):

- productive: the steps that count, each step number once, at rank 0's step time: a run's
  steps from the step the next run resumed from on were redone;
- redone: those redone steps' time;
- checkpoint_save / checkpoint_load: the checkpoint calls, as rank 0 spent them (the
  parts follow rank 0's steps; each call's own figures are its slowest rank's);
- hang: from a run's last step to its last sign of life (an event or heartbeat), for a run
  that did not finish (a hang, or a crash's last moments);
- restart: from that last sign of life to the next run's start (the job was down);
- startup: from a run's start to its first step, less its checkpoint loads;
- other: what is left (between steps: data loading, evaluation, logging).

goodput = productive / wall time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.read.runs import run_pk

PARTS = ("productive", "redone", "checkpoint_save", "checkpoint_load", "hang", "restart",
         "startup", "other")  # fmt: skip


def checkpoint_calls(conn: Connection, pk: int, *where: Any) -> list[dict[str, Any]]:
    """The run's checkpoint calls in the order they began (see the module docstring), of
    the rows `where` selects (default: all)."""
    c = m.checkpoints.c
    rows = conn.execute(
        select(c.rank, c.op, c.step, c.tag, c.time, c.seconds, c.bytes)
        .where(c.run == pk, *where)
        .order_by(c.time)
    ).all()
    calls: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in rows:
        call = calls.setdefault((r.op, int(r.step), r.tag), {
            "op": r.op, "step": int(r.step), "tag": r.tag, "time": r.time, "seconds": 0.0,
            "bytes": None, "ranks": 0, "slowest_rank": int(r.rank), "rank0_seconds": None,
        })  # fmt: skip
        if r.rank == 0:
            call["rank0_seconds"] = float(r.seconds)
        call["time"] = min(call["time"], r.time)
        call["ranks"] += 1
        if r.seconds >= call["seconds"]:
            call["seconds"], call["slowest_rank"] = float(r.seconds), int(r.rank)
        if r.bytes is not None:
            call["bytes"] = (call["bytes"] or 0) + int(r.bytes)
    out = sorted(calls.values(), key=lambda x: x["time"])
    for call in out:
        seconds, nbytes = call["seconds"], call["bytes"]
        call["bandwidth_bytes_per_s"] = nbytes / seconds if nbytes and seconds > 0 else None
    return out


def latest_calls(conn: Connection, pk: int) -> dict[str, dict[str, Any]]:
    """The newest save and load of a run, by op (what /metrics exposes): the rows of the
    highest step of each op, by the (run, op, step) index, whatever the run's history."""
    c = m.checkpoints.c
    out = {}
    for op in ("save", "load"):
        step = conn.execute(select(func.max(c.step)).where(c.run == pk, c.op == op)).scalar()
        if step is not None:
            calls = checkpoint_calls(conn, pk, c.op == op, c.step == step)
            out[op] = calls[-1]
    return out


def _rank0_steps(conn: Connection, pk: int) -> list[tuple[int, float, float]]:
    """(step, end time, seconds) of rank 0's steps, in the order it ran them."""
    s = m.steps.c
    rows = conn.execute(
        select(s.step, s.time, s.step_time_s).where(s.run == pk, s.rank == 0).order_by(s.seq)
    ).all()
    return [(int(r.step), float(r.time), float(r.step_time_s)) for r in rows]


def _last_alive(conn: Connection, row: Any) -> float:
    """The run's last sign of life: its newest event, its end, or a rank's heartbeat."""
    beat = conn.execute(
        select(func.max(m.heartbeats.c.received_at)).where(m.heartbeats.c.run == row.id)
    ).scalar()
    times = [t for t in (row.last_event_at, row.ended_at, beat, row.started_at) if t is not None]
    return float(max(times))


@dataclass
class _JobRun:
    """One run of a job, as the job view reads it."""

    row: Any
    steps: list[tuple[int, float, float]]
    calls: list[dict[str, Any]]
    last_alive: float


def job_view(conn: Connection, job: str) -> dict[str, Any] | None:
    """The job's runs and where its time went (module docstring); None for no such job."""
    r = m.runs.c
    rows = conn.execute(
        select(m.runs).where(r.job == job).order_by(r.started_at, r.id)
    ).all()  # fmt: skip
    if not job or not rows:
        return None
    runs = [_JobRun(row, _rank0_steps(conn, row.id), checkpoint_calls(conn, row.id),
                    _last_alive(conn, row)) for row in rows]  # fmt: skip
    parts = dict.fromkeys(PARTS, 0.0)
    out_runs = []
    redone_steps = 0
    for i, run in enumerate(runs):
        row, steps, calls = run.row, run.steps, run.calls
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        resumed = _first_step(nxt.steps) if nxt is not None else None
        redone = [s for s in steps if resumed is not None and s[0] >= resumed]
        kept_s = sum(s[2] for s in steps) - sum(s[2] for s in redone)
        parts["productive"] += kept_s
        parts["redone"] += sum(s[2] for s in redone)
        redone_steps += len(redone)
        saves = sum(_on_rank0(c) for c in calls if c["op"] == "save")
        loads = sum(_on_rank0(c) for c in calls if c["op"] == "load")
        parts["checkpoint_save"] += saves
        parts["checkpoint_load"] += loads
        first_start = steps[0][1] - steps[0][2] if steps else run.last_alive
        last_end = max(s[1] for s in steps) if steps else first_start
        parts["startup"] += max(first_start - row.started_at - loads, 0.0)
        hang = max(run.last_alive - last_end, 0.0) if row.status != "finished" else 0.0
        if nxt is not None:
            parts["hang"] += hang
            parts["restart"] += max(nxt.row.started_at - max(run.last_alive, last_end), 0.0)
        out_runs.append({
            "run_id": row.run_id, "name": row.name, "status": row.status,
            "started_at": row.started_at, "first_step": _first_step(steps),
            "last_step": max((s[0] for s in steps), default=None), "steps": len(steps),
            "redone_steps": len(redone), "redone_s": sum(s[2] for s in redone),
            "hang_s": hang if nxt is not None else 0.0, "checkpoints": calls,
        })  # fmt: skip
    first = runs[0].row.started_at
    last = runs[-1]
    end = max((s[1] for s in last.steps), default=last.last_alive)
    wall = max(end - first, 0.0)
    parts["other"] = max(wall - sum(parts.values()), 0.0)
    return {
        "job": job,
        "runs": out_runs,
        "wall_s": wall,
        "parts": parts,
        "goodput": parts["productive"] / wall if wall > 0 else None,
        "redone_steps": redone_steps,
        "restarts": len(runs) - 1,
    }


def run_checkpoints(*, db: Database, run_id: str) -> dict[str, Any] | None:
    """GET /runs/{run_id}/checkpoints: the run's checkpoint calls; None for no such run."""
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        job = conn.execute(select(m.runs.c.job).where(m.runs.c.id == pk)).scalar()
        return {"run_id": run_id, "job": job or None, "checkpoints": checkpoint_calls(conn, pk)}


def get_job(*, db: Database, job: str) -> dict[str, Any] | None:
    """GET /jobs/{job}: `job_view` in a read transaction."""
    with db.read() as conn:
        return job_view(conn, job)


def _on_rank0(call: dict[str, Any]) -> float:
    """A call's seconds as rank 0 spent them: the job's time is cut along rank 0's steps
    (a rank that saves longer holds its peers in their next step's first collective)."""
    return call["rank0_seconds"] if call["rank0_seconds"] is not None else call["seconds"]


def _first_step(steps: list[tuple[int, float, float]]) -> int | None:
    return steps[0][0] if steps else None


__all__ = ["PARTS", "checkpoint_calls", "get_job", "job_view", "latest_calls", "run_checkpoints"]
