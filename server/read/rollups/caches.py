"""The read model's caches of one database, owned by its `Database` and reached from the
connections it hands out.

`ReadCaches` bundles the tuning (tuning.py) with the fresh-steps cache (fresh.py, which
publishes through shared_blocks.py), the readers' memo of dirty steps (live_memo.py) and
the run page's memo of doctor findings (read/findings_memo.py).
`Database` makes one when it opens (`Database.open(url, tuning=...)`: the app passes
`Settings.read`) and keeps it as `db.caches`; the ingest writer, the store and the
roll-up worker take it from there. The readers take a `Connection`: every connection of
the database's engine carries the caches in its `info` (set at checkout, `attach`), and
`caches_of(conn)` gives them back, so the caches are the database's and live exactly as
long as it does, in this process only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, event
from zerowatch.server.read.findings_memo import FindingsMemo
from zerowatch.server.read.rollups.fresh import FreshSteps
from zerowatch.server.read.rollups.live_memo import LiveMemo
from zerowatch.server.read.rollups.shared_blocks import SharedBlocks
from zerowatch.server.read.rollups.tuning import ReadTuning

_KEY = "zerowatch.read_caches"


@dataclass(frozen=True, slots=True)
class ReadCaches:
    """What the read model keeps of one database in this process."""

    tuning: ReadTuning
    #: The metric columns of rank-steps the ingest writer just stored (fresh.py).
    fresh: FreshSteps
    #: Readers' rollups of dirty steps, by the version of their marks (live_memo.py).
    live: LiveMemo
    #: The run page's doctor findings, by the run's version (read/findings_memo.py).
    findings: FindingsMemo

    @classmethod
    def attach(cls, engine: Engine, tuning: ReadTuning) -> ReadCaches:
        """New caches for the database behind `engine`, carried by its connections."""
        caches = cls(
            tuning=tuning,
            fresh=FreshSteps(tuning, SharedBlocks(engine, tuning)),
            live=LiveMemo(tuning.live_memo_steps),
            findings=FindingsMemo(max_runs=tuning.findings_runs, ttl_s=tuning.findings_ttl_s),
        )

        @event.listens_for(engine, "checkout")
        def _carry(_dbapi_conn: Any, record: Any, _proxy: Any) -> None:
            record.info[_KEY] = caches

        return caches


def caches_of(conn: Connection) -> ReadCaches:
    """The caches of the database `conn` belongs to.

    Raises:
        LookupError: `conn` is not from a `Database`'s engine.
    """
    try:
        return conn.info[_KEY]  # type: ignore[no-any-return]
    except KeyError:
        raise LookupError("a connection without read caches: open it through a Database") from None


__all__ = ["ReadCaches", "caches_of"]
