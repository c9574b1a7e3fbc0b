"""Retention of per-rank rows: every step of the newest `full_steps`, every `every`-th step
before them; rollups are kept whole.

The boundary (the run's `retention.horizon` total) only moves forward. A step that is
still dirty when the horizon passes it keeps its rows until the worker rolled it up (the
worker then deletes them with the step's marks); a late rank of a thinned step is dropped
with its mark (its step's rollup was exact when the step was complete).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, and_, delete, func, select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.read.rollups.reader import dirty_in

from zerowatch import events as ev

_HORIZON = "retention.horizon"


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
        """Whether `step`'s per-rank rows go, with the run's horizon at `horizon`."""
        return step < horizon and step % self.every != 0

    def apply(self, db: Database, *, chunk: int) -> int:
        """Thin old per-rank rows of every run. Returns rank-steps deleted."""
        if not self.full_steps:
            return 0
        deleted = 0
        rs, t = m.rank_states.c, m.run_totals
        with db.read() as conn:
            lasts = conn.execute(select(rs.run, func.max(rs.last_step)).group_by(rs.run)).all()
        for pk, last in lasts:
            if last is None:
                continue
            new_horizon = int(last) - self.full_steps + 1
            with db.write() as conn:
                old = horizon(conn, pk)
                if new_horizon <= max(old, 0):
                    continue
                dirty = set(dirty_in(conn, pk, step_to=new_horizon - 1))
                doomed = [
                    st for st in range(max(old, 0), new_horizon)
                    if st % self.every != 0 and st not in dirty
                ]  # fmt: skip
                deleted += delete_rank_rows(conn, pk, doomed, chunk=chunk)
                conn.execute(delete(t).where(t.c.run == pk, t.c.key == _HORIZON))
                conn.execute(t.insert().values(run=pk, key=_HORIZON, value=new_horizon, buckets=[]))
        return deleted


def horizon(conn: Connection, pk: int) -> int:
    """Run `pk`'s retention horizon: steps before it are thinned (-1: none yet)."""
    t = m.run_totals.c
    h = conn.execute(select(t.value).where(t.run == pk, t.key == _HORIZON)).scalar()
    return int(h) if h is not None else -1


def delete_rank_rows(conn: Connection, pk: int, steps: list[int], *, chunk: int) -> int:
    """Delete the per-rank rows (steps, collectives, spans) of `steps` of run `pk`.
    Returns the rank-steps deleted."""
    n = 0
    for i in range(0, len(steps), chunk):
        part = steps[i : i + chunk]
        n += conn.execute(
            delete(m.steps).where(m.steps.c.run == pk, m.steps.c.step.in_(part))
        ).rowcount
        for op in ev.COLLECTIVE_OPS:  # the (run, op, step) index, one op at a time
            c = m.collectives.c
            conn.execute(
                delete(m.collectives).where(and_(c.run == pk, c.op == op, c.step.in_(part)))
            )
        conn.execute(delete(m.spans).where(m.spans.c.run == pk, m.spans.c.step.in_(part)))
    return n


__all__ = ["Retention", "delete_rank_rows", "horizon"]
