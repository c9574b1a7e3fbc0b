"""Heartbeats: each rank's newest, kept as it comes (events.Heartbeat, agent/heartbeat.py).

A heartbeat is not an event: it has no seq, nothing is summed from it, and only the newest
of a rank matters. So a POST replaces the rank's row (one upsert per rank) with the body as
sent and the server's time of arrival; a rank whose heartbeats stop is silent from that
time. The app's `HeartbeatWriter` writes them in groups, once a second. The collective
forensics (read/forensics.py) read the rows of a run.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
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

log = logging.getLogger(__name__)


def _rows(ref: store.RunRef, batch: ev.HeartbeatBatch, now: float) -> list[dict[str, Any]]:
    """The batch's rows; store.BatchError for a rank outside the run's world."""
    rows = []
    for i, hb in enumerate(batch.heartbeats):
        if not 0 <= hb.rank < ref.world_size:
            raise store.BatchError(
                ("body", "heartbeats", i, "rank"),
                f"rank {hb.rank} outside the run's world of {ref.world_size}",
            )
        rows.append({"run": ref.pk, "rank": hb.rank, "received_at": now,
                     "body": dataclasses.asdict(hb)})  # fmt: skip
    return rows


def _upsert(conn: Connection, rows: list[dict[str, Any]]) -> None:
    ins = (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(m.heartbeats)
    conn.execute(
        ins.on_conflict_do_update(
            index_elements=["run", "rank"],
            set_={"received_at": ins.excluded.received_at, "body": ins.excluded.body},
        ),
        rows,
    )


def store_heartbeats(
    db: Database, *, run_id: str, batch: ev.HeartbeatBatch, now: float | None = None
) -> int | None:
    """Keep each heartbeat of `batch` as its rank's newest, now (one transaction). Returns
    how many were stored, None for an unknown run.

    Raises:
        store.BatchError: a rank outside the run's world (nothing stored).
    """
    now = time.time() if now is None else now
    with db.write() as conn:
        ref = store.run_ref(conn, run_id=run_id)
        if ref is None:
            return None
        rows = _rows(ref, batch, now)
        if rows:
            _upsert(conn, rows)
    return len(rows)


class HeartbeatWriter:
    """Writes heartbeats in groups: a POST is checked and kept in memory (each rank's newest
    replaces the one before), and a thread writes what is kept in one transaction every
    `interval_s`. A 4,096-rank job sends a few hundred heartbeats a second; one write
    transaction each would queue them behind the events' writer (and on SQLite behind its
    one write lock). A heartbeat is at most `interval_s` late to the readers; one that a
    crash of the server loses is replaced by the rank's next.

    Args:
        db: the database.
        interval_s: seconds between two writes.
    """

    def __init__(self, db: Database, *, interval_s: float = 1.0) -> None:
        self.db = db
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._kept: dict[tuple[int, int], dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Transactions written (for tests and the benchmark).
        self.writes = 0

    def submit(self, *, run_id: str, batch: ev.HeartbeatBatch) -> int | None:
        """Keep the batch's heartbeats for the next write. Returns how many, None for an
        unknown run.

        Raises:
            store.BatchError: a rank outside the run's world (nothing kept).
        """
        with self.db.read() as conn:
            ref = store.run_ref(conn, run_id=run_id)
        if ref is None:
            return None
        rows = _rows(ref, batch, time.time())
        with self._lock:
            for row in rows:
                self._kept[(row["run"], row["rank"])] = row
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._loop, name="zerowatch-heartbeats",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        return len(rows)

    def flush(self) -> None:
        """Write what is kept now."""
        with self._lock:
            rows, self._kept = list(self._kept.values()), {}
        if rows:
            with self.db.write() as conn:
                _upsert(conn, rows)
            self.writes += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # a database away: the ranks' next heartbeats come anyway
                log.exception("writing heartbeats")

    def close(self) -> None:
        """Write what is kept and stop the thread."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None
        self.flush()
        self._stop.clear()


def read_heartbeats(conn: Connection, run_pk: int) -> list[tuple[float, dict[str, Any]]]:
    """(received at, heartbeat as sent) of each rank of a run that sent one."""
    rows = conn.execute(
        select(m.heartbeats.c.received_at, m.heartbeats.c.body).where(m.heartbeats.c.run == run_pk)
    )
    return [(float(r.received_at), r.body) for r in rows]


__all__ = ["HeartbeatWriter", "read_heartbeats", "store_heartbeats"]
