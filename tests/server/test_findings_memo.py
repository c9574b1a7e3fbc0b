"""The run page's doctor findings are reused while the run is unchanged, per database: two
databases holding a run of the same id, newest step and newest event time each get their
own findings (read/findings_memo.py, owned by the database's read caches)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from zerowatch.server import page_queries, pages, store
from zerowatch.server.db import Database
from zerowatch.server.read.rollups import RollupWorker

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(name="memo", world_size=8, stage=3, ranks_per_host=4)


def _store(db: Database, spec: simulate.SimSpec) -> str:
    rc = simulate.run_create(spec, run_id="same")
    store.create_run(db, run=rc)
    for events in simulate.steps(spec, 30):
        # The same event times in both databases: the same newest event.
        events = [dataclasses.replace(e, time=1000.0 + e.step) for e in events]
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    RollupWorker(db).flush()
    return rc.run_id


def _kinds(db: Database, run_id: str) -> set[str]:
    view = page_queries.run_view(db=db, run_id=run_id)
    assert view is not None
    found = pages._findings(db, run_id, view, 20)
    return {f["kind"] for f in found["findings"]}


def test_two_databases_with_the_same_run_version_get_their_own_findings(tmp_path: Path) -> None:
    slow = Database.open(f"sqlite:///{tmp_path / 'slow.db'}")
    even = Database.open(f"sqlite:///{tmp_path / 'even.db'}")
    try:
        run_id = _store(slow, dataclasses.replace(SPEC, straggler_rank=5, straggler_factor=1.5))
        assert _store(even, SPEC) == run_id
        assert "straggler" in _kinds(slow, run_id)
        assert "straggler" not in _kinds(even, run_id)
        assert "straggler" in _kinds(slow, run_id)  # reused: the memo is the database's
    finally:
        slow.close()
        even.close()
