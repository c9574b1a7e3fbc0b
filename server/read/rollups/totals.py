"""A run's totals (`run_totals`): sums over all its steps that the worker keeps up to date
as it replaces steps' rollups: the steps where any rank skipped (`SKIPPED`) or was
non-finite (`NONFINITE`), and per collective op the latency histogram and sum over every
call (`hist_key(op)`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, select
from zerowatch.server import models as m
from zerowatch.server.read.metric_table import N_BUCKETS

from zerowatch import events as ev

SKIPPED, NONFINITE = "skipped_steps", "nonfinite_steps"
#: The rollups whose change changes the totals.
COUNTED = ("skipped", "nonfinite", *(f"collective.{op}.latency_s" for op in ev.COLLECTIVE_OPS))


def hist_key(op: str) -> str:
    """The totals key of collective `op`'s latency histogram."""
    return f"hist.{op}"


def totals(conn: Connection, pk: int) -> dict[str, tuple[float, list[int]]]:
    """The run's totals {key: (value, buckets)} as the worker last left them."""
    t = m.run_totals.c
    return {
        row.key: (row.value, list(row.buckets or []))
        for row in conn.execute(select(t.key, t.value, t.buckets).where(t.run == pk))
    }


class TotalsDelta:
    """Changes to a run's totals from replacing some steps' rollups: `add` each old rollup
    with sign -1 and each new one with +1, then `apply`."""

    def __init__(self) -> None:
        self.values: dict[str, float] = defaultdict(float)
        self.buckets: dict[str, list[int]] = {}

    def add(self, metric: str, top: float, extra: dict[str, Any], sign: int) -> None:
        if metric in ("skipped", "nonfinite"):
            key = SKIPPED if metric == "skipped" else NONFINITE
            self.values[key] += sign * (1.0 if top > 0 else 0.0)
            return
        hist = extra.get("hist")
        if not hist:
            return
        op = metric.split(".")[1]
        key = hist_key(op)
        self.values[key] += sign * float(extra.get("sum", 0.0))
        acc = self.buckets.setdefault(key, [0] * N_BUCKETS)
        for i, n in enumerate(hist[:N_BUCKETS]):
            acc[i] += sign * int(n)

    def apply(self, conn: Connection, pk: int) -> None:
        keys = set(self.values) | set(self.buckets)
        if not keys:
            return
        t = m.run_totals
        current = {
            row.key: row
            for row in conn.execute(
                select(t.c.key, t.c.value, t.c.buckets).where(t.c.run == pk, t.c.key.in_(keys))
            )
        }
        for key in sorted(keys):
            dv = self.values.get(key, 0.0)
            db = self.buckets.get(key)
            row = current.get(key)
            if row is None:
                conn.execute(t.insert().values(run=pk, key=key, value=dv, buckets=db or []))
                continue
            buckets = list(row.buckets or [])
            if db is not None:
                buckets = buckets or [0] * N_BUCKETS
                buckets = [a + b for a, b in zip(buckets, db, strict=True)]
            conn.execute(
                t.update()
                .where(t.c.run == pk, t.c.key == key)
                .values(value=row.value + dv, buckets=buckets)
            )


__all__ = ["COUNTED", "NONFINITE", "SKIPPED", "TotalsDelta", "hist_key", "totals"]
