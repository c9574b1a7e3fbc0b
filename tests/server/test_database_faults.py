"""The server's database fails under ingest: a real PostgreSQL stopped and started again,
and a SQLite file on a small tmpfs whose disk fills. Requests answer a clear 503 or 507
naming the cause (never a 500), the agents (the real shipper and spool) keep their events
and send them again, the server recovers on its own, and every step of every rank is
stored exactly once."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.live_server import LiveServer
from support.postgres import postgres, postgres_available
from support.sim_agents import RecordingClient, SimAgents, run_create_json, stored
from zerowatch.agent import codec

from zerowatch import simulate

RANKS = 4
FAST = {"flush_interval_s": 0.1, "batch_max_events": 4, "retry_max_wait_s": 0.5,
        "http_timeout_s": 5.0}  # fmt: skip


def train(agents: SimAgents, n: int, every_s: float = 0.05) -> None:
    for _ in range(n):
        agents.step()
        time.sleep(every_s)


def start_agents(server: LiveServer, spec: simulate.SimSpec, run_id: str, spool: Path):
    clients: list[RecordingClient] = []

    def factory(*args: Any, **kwargs: Any) -> RecordingClient:
        clients.append(RecordingClient(*args, **kwargs))
        return clients[-1]

    agents = SimAgents(server.url, spec, run_id, ranks=range(RANKS), spool_root=spool,
                       client_factory=factory, **FAST)  # fmt: skip
    agents.start()
    return agents, clients


def post_probe(server: LiveServer, run_id: str, spec: simulate.SimSpec, seq: int) -> httpx.Response:
    """One rank-0 step of a second run, posted straight (what an agent's request meets)."""
    line = codec.encode(simulate.step_event(spec, 0, seq))
    return httpx.post(
        f"{server.api}/runs/{run_id}/events",
        content=codec.batch_body(run_id, [line]),
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        timeout=30,
    )


def create_run(server: LiveServer, spec: simulate.SimSpec, run_id: str) -> None:
    r = httpx.post(f"{server.api}/runs", content=run_create_json(spec, run_id),
                   headers={"Content-Type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 201, r.text


def assert_every_step_once(db_url: str, run_id: str, agents: SimAgents) -> None:
    seqs, counts = stored(db_url, run_id)
    n = agents.next_step
    assert dict(seqs) == {r: list(range(n)) for r in range(RANKS)}
    assert counts == dict.fromkeys(range(RANKS), n)
    assert agents.stats().accepted == RANKS * n and agents.dropped == 0


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL binaries not found")
def test_postgres_restarting_under_ingest_answers_503_and_nothing_is_lost_or_doubled(tmp_path):
    spec = simulate.SimSpec(world_size=RANKS, spans_every=5)
    run_id, probe = f"pg-{uuid.uuid4().hex[:12]}", f"probe-{uuid.uuid4().hex[:12]}"
    with postgres() as pg, LiveServer(db_url=pg.create_database("faults")) as server:
        create_run(server, spec, probe)
        agents, clients = start_agents(server, spec, run_id, tmp_path / "spool")
        train(agents, 20)

        pg.stop()  # requests in flight lose their connection; later ones find no database
        train(agents, 10)
        down = post_probe(server, probe, spec, 0)
        assert down.status_code == 503, down.text
        assert "database is unavailable" in down.json()["detail"]
        assert int(down.headers["Retry-After"]) >= 1
        read = httpx.get(f"{server.api}/runs/{run_id}", timeout=30)
        assert read.status_code == 503 and "database" in read.json()["detail"]
        assert httpx.get(server.url + "/healthz", timeout=30).status_code == 503

        pg.start()  # the server reconnects on its own (pool pre-ping)
        train(agents, 20)
        assert agents.wait_drained(60), f"{agents.pending()} ranks still hold events"
        assert post_probe(server, probe, spec, 0).json() == {"accepted": 1, "duplicates": 0}
        agents.close()
        assert_every_step_once(server.db_url, run_id, agents)
        seqs, _ = stored(server.db_url, probe)
        assert dict(seqs) == {0: [0]}

    seen = set().union(*(c.statuses() for c in clients))
    assert 500 not in seen and seen <= {0, 200, 503}, seen
    assert agents.stats().told_to_wait > 0 or agents.stats().spooled > 0


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path`; skips the test where mounting is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a disk that fills) needs root")
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Fill the volume of `path` with one file until the disk refuses a write."""
    filler = path / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    with contextlib.suppress(OSError), open(filler, "ab", buffering=0) as f:
        while f.write(b"\0"):  # the last bytes too
            pass
    return filler


def test_a_full_disk_answers_507_the_agents_spool_and_the_server_recovers(tmp_path):
    spec = simulate.SimSpec(world_size=RANKS, spans_every=5)
    run_id, probe = f"disk-{uuid.uuid4().hex[:12]}", f"probe-{uuid.uuid4().hex[:12]}"
    with (
        small_tmpfs(tmp_path / "disk", "16m") as disk,
        LiveServer(db_url=f"sqlite:///{disk / 'zerowatch.db'}") as server,
    ):
        create_run(server, spec, probe)
        agents, clients = start_agents(server, spec, run_id, tmp_path / "spool")
        train(agents, 20)

        filler = fill(disk)
        full = post_probe(server, probe, spec, 0)
        assert full.status_code == 507, full.text
        assert "disk is full" in full.json()["detail"]
        assert int(full.headers["Retry-After"]) >= 1
        spooled_before = agents.stats().spooled
        train(agents, 20)
        assert agents.stats().spooled > spooled_before  # the agents keep the steps

        filler.unlink()  # space returns
        train(agents, 10)
        assert agents.wait_drained(60), f"{agents.pending()} ranks still hold events"
        assert post_probe(server, probe, spec, 0).json() == {"accepted": 1, "duplicates": 0}
        agents.close()
        assert_every_step_once(server.db_url, run_id, agents)

    seen = set().union(*(c.statuses() for c in clients))
    assert 500 not in seen and 507 in seen, seen


def test_database_failures_are_named_with_their_answer() -> None:
    """The classification itself, for the causes the tests above cannot stage."""
    import sqlite3

    from sqlalchemy.exc import IntegrityError, OperationalError
    from zerowatch.server.db_errors import classify

    full = sqlite3.OperationalError("database or disk is full")
    answer = classify(OperationalError("INSERT", {}, full))
    assert answer is not None and answer.status == 507 and "disk is full" in answer.detail
    gone = classify(OperationalError("SELECT", {}, Exception("connection refused")))
    assert gone is not None and gone.status == 503 and "connection refused" in gone.detail
    assert classify(IntegrityError("INSERT", {}, Exception("duplicate key"))) is None
    assert classify(ValueError("not a database error")) is None
