"""A recovery storm, small: the ranks of a job whose server was away all replay their
spools at once into a real server that admits two ingest requests at a time. The server
turns the rest away with 503 + Retry-After, every agent waits at least that long before it
tries again, and in the end every step of every rank is stored exactly once
(bench/faults.py runs the same with thousands of ranks).

The storm must land at once, whatever the machine's speed: with the server's process stopped
(SIGSTOP) every rank's first request waits in the server's socket buffers, and when it goes
on (SIGCONT) it reads them together. Without the pause a fast server answers 24 in-process
agents one by one, and none is shed."""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

from support.live_server import LiveServer
from support.sim_agents import RecordingClient, SimAgents, prefill_spools, stored

from zerowatch import simulate

RANKS, OUTAGE_STEPS, LIVE_STEPS = 24, 40, 3


def test_a_storm_is_shed_with_retry_after_honoured_and_every_step_stored_once(tmp_path):
    spec = simulate.SimSpec(world_size=RANKS, spans_every=10)
    run_id = f"storm-{uuid.uuid4().hex[:12]}"
    spool_root = tmp_path / "spool"
    prefill_spools(spool_root, spec, run_id, ranks=range(RANKS), steps=OUTAGE_STEPS)
    clients: list[RecordingClient] = []

    def client_factory(*args: Any, **kwargs: Any) -> RecordingClient:
        clients.append(RecordingClient(*args, **kwargs))
        return clients[-1]

    with LiveServer(settings={"ingest_max_pending": 2}) as server:
        agents = SimAgents(server.url, spec, run_id, ranks=range(RANKS), spool_root=spool_root,
                           next_step=OUTAGE_STEPS, client_factory=client_factory,
                           batch_max_events=8, flush_interval_s=0.2)  # fmt: skip
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            agents.start()  # the server is back: every rank replays at once
            time.sleep(1.0)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        for _ in range(LIVE_STEPS):  # and training goes on meanwhile
            agents.step()
            time.sleep(0.3)
        drained = agents.wait_drained(90)
        agents.close()
        assert drained, f"{agents.pending()} ranks still hold events"
        seqs, counts = stored(server.db_url, run_id)

    steps = OUTAGE_STEPS + LIVE_STEPS
    assert dict(seqs) == {r: list(range(steps)) for r in range(RANKS)}
    assert counts == {r: steps for r in range(RANKS)}
    stats = agents.stats()
    assert stats.accepted == RANKS * steps and agents.dropped == 0

    shed = [(c, i) for c in clients for i, p in enumerate(c.posts) if p[3] is not None]
    assert shed, "the server admitted every request: nothing was shed"
    assert all(c.posts[i][2] == 503 for c, i in shed)
    assert stats.told_to_wait > 0
    for c, i in shed:
        _, ended, _, retry_after = c.posts[i]
        assert retry_after is not None and retry_after >= 1
        if i + 1 < len(c.posts):
            assert c.posts[i + 1][0] >= ended + retry_after - 0.01, (
                f"tried again {c.posts[i + 1][0] - ended:.2f} s after Retry-After: {retry_after}"
            )
