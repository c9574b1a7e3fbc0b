"""Database failures as answers a client can act on: 503 or 507 naming the cause, never 500.

    the database's disk (or its volume) is full        507 Insufficient Storage
    the database cannot be reached, restarts, or drops
    the connection, is locked, or fails an I/O          503 Service Unavailable

Both carry `Retry-After`: the request may succeed later unchanged (the agent keeps its
events in its spool meanwhile and sends them again; ingest is idempotent on
(run, rank, seq), so a batch whose answer was lost is stored once). A transaction that
fails is rolled back whole: what was stored before stays, nothing of the failed batch is
half-written. After PostgreSQL restarts, the pool's pre-ping replaces the dead
connections on their next checkout (db.make_engine), so the server recovers on its own.

Anything else from the database (an integrity or programming error) is a bug and stays a
logged 500.
"""

from __future__ import annotations

import errno
import sqlite3
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

#: SQLite's primary result code of a full disk (SQLITE_FULL).
_SQLITE_FULL = 13
#: PostgreSQL SQLSTATE of "disk full" and class 53 (insufficient resources).
_PG_DISK_FULL = "53100"


@dataclass(frozen=True)
class Unavailable:
    """How to answer a database failure."""

    status: int
    detail: str
    retry_after_s: int


def _sqlite_code(orig: BaseException | None) -> int | None:
    code = getattr(orig, "sqlite_errorcode", None)
    return int(code) & 0xFF if isinstance(code, int) else None


def _pg_sqlstate(orig: BaseException | None) -> str | None:
    state = getattr(orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _disk_full(exc: DBAPIError) -> bool:
    orig = exc.orig
    if _sqlite_code(orig) == _SQLITE_FULL or _pg_sqlstate(orig) == _PG_DISK_FULL:
        return True
    text = str(orig).lower()
    return (
        "disk is full" in text
        or "no space left on device" in text
        or getattr(orig, "errno", None) == errno.ENOSPC
    )


def _first_line(orig: BaseException | None) -> str:
    text = str(orig).strip().splitlines()
    return text[0][:300] if text else type(orig).__name__


def classify(exc: BaseException) -> Unavailable | None:
    """The answer to a database failure that a retry may cure; None for anything else."""
    if not isinstance(exc, DBAPIError):
        return None
    if _disk_full(exc):
        return Unavailable(
            507,
            f"the database's disk is full ({_first_line(exc.orig)}); nothing of this request "
            "was stored: free space on the server's database volume, then retry",
            5,
        )
    if isinstance(exc, (OperationalError, InterfaceError)) or exc.connection_invalidated:
        cause = _first_line(exc.orig)
        if isinstance(exc.orig, sqlite3.OperationalError) and "locked" in cause:
            return Unavailable(503, f"the database is busy ({cause}); retry", 1)
        return Unavailable(
            503,
            f"the database is unavailable ({cause}); nothing of this request was stored: "
            "retry (the server reconnects on its own)",
            2,
        )
    return None


__all__ = ["Unavailable", "classify"]
