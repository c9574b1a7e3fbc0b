"""Rank 0 alone creates the run; another rank joins it by id: its events wait in the spool
while the run is not there yet and go once it is, and it creates the run itself only after
the run stayed missing for its join timeout (rank 0 gone)."""

from __future__ import annotations

import time

from zerowatch.agent import codec
from zerowatch.agent.client import IngestClient

import zerowatch

#: (A fake engine has no process group: no clock offset to estimate.)
FAST = {
    "flush_interval_s": 0.05,
    "retry_max_wait_s": 0.2,
    "http_timeout_s": 1.0,
    "clock_sync_rounds": 0,
}


def _wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _train(engine, run, n: int) -> None:
    for _ in range(n):
        engine.train_step()
        run.log(loss=1.0)


def test_a_rank_other_than_0_waits_for_rank_0s_run_and_never_creates_it(
    fake_engine, fake_server, spool_root
):
    server = fake_server("ok")
    fake_engine.rank = 1
    with zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root,
                              **FAST) as run:  # fmt: skip
        _train(fake_engine, run, 3)
        time.sleep(0.3)
        assert server.runs == [] and server.steps() == []  # told 404: kept in the spool
        # Rank 0 creates the run (the same id: broadcast over the job's group).
        create = codec.dumps({"run_id": run.id, "name": "r", "world_size": 2})
        IngestClient(server.url).create_run(create)
        # (A step's event goes when the next step starts: 2 of the 3 so far.)
        assert _wait_for(lambda: len(server.steps()) == 2)
        _train(fake_engine, run, 2)
    assert [e["step"] for e in server.steps()] == list(range(5))
    assert [r["run_id"] for r in server.runs] == [run.id]  # only rank 0's creation
    assert run.stats["dropped_events"] == 0


def test_a_rank_whose_run_stays_missing_creates_it_after_its_join_timeout(
    fake_engine, fake_server, spool_root
):
    server = fake_server("ok")
    fake_engine.rank = 1
    with zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root,
                              **FAST) as run:  # fmt: skip
        run._transport._join_timeout = 0.3
        _train(fake_engine, run, 3)
        assert _wait_for(lambda: len(server.steps()) == 2)
    assert [r["run_id"] for r in server.runs] == [run.id]
    assert server.runs[0]["world_size"] == 2


def test_rank_0_creates_its_run_gzipped_before_its_first_flush(
    fake_engine, fake_server, spool_root
):
    server = fake_server("ok")
    with zerowatch.instrument(fake_engine, server=server.url, spool_dir=spool_root,
                              flush_interval_s=30.0) as run:  # fmt: skip
        assert _wait_for(lambda: len(server.runs) == 1, 5.0)  # not 30 s later
        assert server.runs[0]["run_id"] == run.id and server.runs[0]["hosts"] == []
        assert server.headers[0]["Content-Encoding"] == "gzip"
        run.close()
