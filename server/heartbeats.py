"""Heartbeats: each rank's newest, kept as it comes (events.Heartbeat, agent/heartbeat.py).

A heartbeat is not an event: it has no seq, nothing is summed from it, and only the newest
of a rank matters. So a POST replaces the rank's row (one upsert per rank) with the body as
sent and the server's time of arrival; a rank whose heartbeats stop is silent from that
time. The collective forensics (read/forensics.py) read the rows of a run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from zerowatch.server import models as m
from zerowatch.server import store
from zerowatch.server.db import Database

from zerowatch import events as ev


def store_heartbeats(
    db: Database, *, run_id: str, batch: ev.HeartbeatBatch, now: float | None = None
) -> int | None:
    """Keep each heartbeat of `batch` as its rank's newest. Returns how many were stored,
    None for an unknown run.

    Raises:
        store.BatchError: a rank outside the run's world (nothing stored).
    """
    now = time.time() if now is None else now
    with db.write() as conn:
        ref = store.run_ref(conn, run_id=run_id)
        if ref is None:
            return None
        rows = []
        for i, hb in enumerate(batch.heartbeats):
            if not 0 <= hb.rank < ref.world_size:
                raise store.BatchError(
                    ("body", "heartbeats", i, "rank"),
                    f"rank {hb.rank} outside the run's world of {ref.world_size}",
                )
            rows.append({"run": ref.pk, "rank": hb.rank, "received_at": now,
                         "body": dataclasses.asdict(hb)})  # fmt: skip
        if rows:
            ins = (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(m.heartbeats)
            conn.execute(
                ins.on_conflict_do_update(
                    index_elements=["run", "rank"],
                    set_={"received_at": ins.excluded.received_at, "body": ins.excluded.body},
                ),
                rows,
            )
    return len(rows)


def read_heartbeats(conn: Connection, run_pk: int) -> list[tuple[float, dict[str, Any]]]:
    """(received at, heartbeat as sent) of each rank of a run that sent one."""
    rows = conn.execute(
        select(m.heartbeats.c.received_at, m.heartbeats.c.body).where(m.heartbeats.c.run == run_pk)
    )
    return [(float(r.received_at), r.body) for r in rows]


__all__ = ["read_heartbeats", "store_heartbeats"]
