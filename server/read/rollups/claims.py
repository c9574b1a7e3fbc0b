"""Claims between server processes on one PostgreSQL database: which process's worker
rolls a run up, and the lock that serialises one run's writes.

Every server process runs a roll-up worker. A run is claimed with a session advisory lock
(`run_claim_lock_id`, the run's key) that the other processes skip
(`pg_try_advisory_lock`), so two processes never compute the same steps. A claim is kept
while the run has steps to roll up (released after `claim_idle_s` without, or when the
process ends: PostgreSQL drops a session's locks with it), so the other processes know to
share their fresh rank-steps of it (fresh.py). The worker's writes of a run and retention
take a transaction advisory lock (`run_write_lock_id`) first. SQLite serves one process:
every run is its own, and its write lock serialises the writes.
"""

from __future__ import annotations

import contextlib

from sqlalchemy import Connection, text
from zerowatch.server.db import Database
from zerowatch.server.read.rollups.tuning import ReadTuning


def lock_run_writes(conn: Connection, pk: int, tuning: ReadTuning) -> None:
    """Hold run `pk`'s write lock until `conn`'s transaction ends (PostgreSQL)."""
    if conn.dialect.name == "postgresql":
        conn.execute(
            text("SELECT pg_advisory_xact_lock(:lock, :pk)"),
            {"lock": tuning.run_write_lock_id, "pk": pk},
        )


class RunClaims:
    """The runs this process's worker claimed (see the module docstring). Not
    thread-safe: the worker's lock guards it."""

    def __init__(self, db: Database, tuning: ReadTuning, *, idle_s: float) -> None:
        self.db = db
        self.lock_id = tuning.run_claim_lock_id
        self.idle_s = idle_s
        #: run -> when it last had steps to roll up.
        self._held: dict[int, float] = {}
        #: The session that holds the locks.
        self._conn: Connection | None = None

    @property
    def held(self) -> frozenset[int]:
        """The runs claimed now."""
        return frozenset(self._held)

    def claim(self, pk: int, now: float) -> bool:
        """Whether this process may roll run `pk` up now (claiming it if nobody has)."""
        if self.db.dialect != "postgresql":
            return True
        if pk in self._held:
            self._held[pk] = now
            return True
        try:
            if self._conn is None:
                self._conn = self.db.engine.connect()
            got = bool(
                self._conn.execute(
                    text("SELECT pg_try_advisory_lock(:lock, :pk)"),
                    {"lock": self.lock_id, "pk": pk},
                ).scalar()
            )
            self._conn.commit()
        except Exception:
            self.drop()  # a broken session holds no locks
            raise
        if got:
            self._held[pk] = now
        return got

    def release_idle(self, now: float) -> None:
        """Give up the claims on runs without steps to roll up for `idle_s`."""
        idle = [pk for pk, t in self._held.items() if now - t > self.idle_s]
        if not idle or self._conn is None:
            return
        try:
            for pk in idle:
                self._conn.execute(
                    text("SELECT pg_advisory_unlock(:lock, :pk)"), {"lock": self.lock_id, "pk": pk}
                )
                del self._held[pk]
            self._conn.commit()
        except Exception:
            self.drop()
            raise

    def close(self) -> None:
        """Give every claim up now: the locks are released in the session before it is
        closed (a closed session's locks go only when its backend process exits, a moment
        later, and another process's claim in that moment would be refused)."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.execute(text("SELECT pg_advisory_unlock_all()"))
                self._conn.commit()
        self.drop()

    def drop(self) -> None:
        """Give every claim up: the lock session is closed (its locks go with it)."""
        self._held.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
                conn.close()


__all__ = ["RunClaims", "lock_run_writes"]
