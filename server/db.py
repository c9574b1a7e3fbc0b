"""The database handle: a SQLAlchemy engine set up per dialect, and migrations at start.

SQLite is the zero-setup default: WAL journal (readers never wait for the writer),
`synchronous=NORMAL` (durable at checkpoints, fast commits), a busy timeout, and one
in-process write lock so that this server's own writers queue in Python instead of
spinning on SQLITE_BUSY. PostgreSQL (`postgresql+psycopg://`) gets a connection pool and
needs no lock: its row locks serialize what must be serialized.

Migrations are Alembic revisions under migrations/versions/, applied programmatically
(no alembic.ini, no env.py): `Database.open()` upgrades the schema to head.

SQLite plans queries without statistics unless someone runs ANALYZE, and then prefers a
primary key's (run) prefix to the (run, step) indexes whenever a query reads a column the
index does not hold: it reads every row of a run to find one step (1.3 s for the 32 rows
of one step of a run of a million rank-steps, growing with the run). `Database.open()`
therefore writes the shape of a big database into `sqlite_stat1` (SQLite's documented way
to steer its planner) where no statistics exist yet: a run holds many steps, a step few
rows. PostgreSQL plans from the statistics its autovacuum keeps.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool
from zerowatch.server.models import Base

if TYPE_CHECKING:
    from zerowatch.server.read.rollups import ReadCaches, ReadTuning

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def _json_loads(text: str | bytes) -> Any:
    """JSON columns back to Python: orjson (the roll-up worker decodes several per rank-step), the
    standard library for what orjson refuses (a NaN written by an older server)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def make_engine(url: str) -> Engine:
    """A SQLAlchemy engine for `url`, tuned for its dialect (see the module docstring)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        kwargs: dict[str, Any] = {
            "connect_args": {"check_same_thread": False, "timeout": 30},
            "json_deserializer": _json_loads,
        }
        if parsed.database in (None, "", ":memory:"):
            kwargs["poolclass"] = StaticPool
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            # A checkpoint copies each page of the WAL once, however often it was written
            # since the last: at 10,000 pages (40 MiB) instead of 1,000 the hot pages (the
            # rank states, dirty marks, index interiors) are copied a tenth as often
            # (the ingest writer's commit 7.7-8.0 -> 6.9-7.3 us a rank-step, in-process).
            cur.execute("PRAGMA wal_autocheckpoint=10000")
            cur.execute("PRAGMA busy_timeout=30000")
            # Reads of a big run touch many pages: a 64 MiB page cache and memory-mapped I/O.
            cur.execute("PRAGMA cache_size=-65536")
            cur.execute("PRAGMA mmap_size=268435456")
            cur.close()

        return engine
    return create_engine(
        url, pool_size=10, max_overflow=20, pool_pre_ping=True, json_deserializer=_json_loads
    )


#: sqlite_stat1 rows (table, index, "rows rows-per-prefix...") for the big tables: a run
#: of 100,000 rows per million, 100 rows a step, one row per full key.
PLANNER_STATS = (
    ("steps", "steps", "1000000000 100000 1000 1"),
    ("steps", "ix_steps_run_step", "1000000000 100000 100"),
    ("collectives", "collectives", "1000000000 100000 1000 1 1 1"),
    ("collectives", "ix_collectives_run_op_step", "1000000000 100000 50000 100"),
    ("spans", "ix_spans_run_step", "1000000 10000 100"),
    ("step_rollups", "step_rollups", "100000000 1000000 20000 1"),
)


def _planner_stats(conn: Connection) -> bool:
    """Write PLANNER_STATS where sqlite_stat1 holds nothing for a table yet (a database
    someone ANALYZEd keeps its measured statistics). Returns whether anything was written."""
    conn.exec_driver_sql("ANALYZE sqlite_schema")  # creates sqlite_stat1, reads no table
    have = {r[0] for r in conn.exec_driver_sql("SELECT DISTINCT tbl FROM sqlite_stat1")}
    rows = [r for r in PLANNER_STATS if r[0] not in have]
    for row in rows:
        conn.exec_driver_sql("INSERT INTO sqlite_stat1 (tbl, idx, stat) VALUES (?, ?, ?)", row)
    if rows:
        conn.exec_driver_sql("ANALYZE sqlite_schema")  # this connection reloads them
    return bool(rows)


def migrate(engine: Engine) -> None:
    """Upgrade the schema to the newest Alembic revision (no-op when already there)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    script = ScriptDirectory.from_config(cfg)

    def upgrade(rev: Any, _context: Any) -> Any:
        return script._upgrade_revs("head", rev)

    with (
        EnvironmentContext(cfg, script, fn=upgrade, destination_rev="head") as env,
        engine.begin() as conn,
    ):
        env.configure(connection=conn, target_metadata=Base.metadata)
        with env.begin_transaction():
            env.run_migrations()


class Database:
    """The engine plus what the server keeps about it: the dialect, the write lock and the
    read model's caches (`caches`: server/read/rollups/caches.py), which every connection of
    the engine carries."""

    def __init__(self, engine: Engine, *, tuning: ReadTuning | None = None) -> None:
        # Imported here: the read package imports this module.
        from zerowatch.server.read.rollups import ReadCaches, ReadTuning

        self.engine = engine
        self.dialect = engine.dialect.name
        self._write_lock: threading.Lock | None = (
            threading.Lock() if self.dialect == "sqlite" else None
        )
        self.caches: ReadCaches = ReadCaches.attach(engine, tuning or ReadTuning())

    @classmethod
    def open(
        cls, url: str, *, migrate_schema: bool = True, tuning: ReadTuning | None = None
    ) -> Database:
        """Connect to `url` and bring its schema up to date; `tuning`: the read path's
        (default `ReadTuning()`)."""
        engine = make_engine(url)
        if migrate_schema:
            migrate(engine)
        if engine.dialect.name == "sqlite":
            with engine.begin() as conn:
                wrote = _planner_stats(conn)
            if wrote and not isinstance(engine.pool, StaticPool):
                engine.dispose()  # pooled connections loaded the schema without them
        return cls(engine, tuning=tuning)

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction (committed on exit, rolled back on an exception)."""
        lock = self._write_lock or contextlib.nullcontext()
        with lock, self.engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection for reads."""
        with self.engine.connect() as conn:
            yield conn

    def close(self) -> None:
        self.engine.dispose()


__all__ = ["Database", "make_engine", "migrate"]
