"""A job's start-up at 4,096 ranks: rank 0 alone creates the run (one gzip'd POST naming no
hosts), the other ranks post their steps to its id, and every rank's steps land in that run
under its node (the launcher's node index beside the host name)."""

from __future__ import annotations

import gzip
import json
import uuid
from typing import Any

import httpx
from support.live_server import LiveServer
from support.sim_agents import RecordingClient, SimAgents, stored

from zerowatch import simulate

RANKS, PER_NODE = 4096, 8


def test_4096_ranks_start_with_one_run_creation_and_land_in_it_by_node(tmp_path):
    spec = simulate.SimSpec(world_size=RANKS, ranks_per_host=PER_NODE, spans_every=0,
                            node_ids=True)  # fmt: skip
    run_id = f"start-{uuid.uuid4().hex[:12]}"
    clients: list[RecordingClient] = []

    def client_factory(*args: Any, **kwargs: Any) -> RecordingClient:
        clients.append(RecordingClient(*args, **kwargs))
        return clients[-1]

    with LiveServer() as server:
        agents = SimAgents(server.url, spec, run_id, ranks=range(RANKS),
                           spool_root=tmp_path / "spool", client_factory=client_factory,
                           run_creator=0)  # fmt: skip
        agents.start()
        agents.step()
        drained = agents.wait_drained(240)
        agents.close()
        assert drained, f"{agents.pending()} ranks still hold events"
        seqs, counts = stored(server.db_url, run_id)
        hosts = httpx.get(f"{server.api}/runs/{run_id}/hosts", timeout=30).json()["hosts"]

    creations = [body for c in clients for body in c.creations]
    assert len(creations) == 1, f"{len(creations)} run creations"
    created = json.loads(gzip.decompress(creations[0]))
    assert created["run_id"] == run_id and created["world_size"] == RANKS
    assert created["hosts"] == [] and len(creations[0]) < 2048
    assert dict(seqs) == {r: [0] for r in range(RANKS)}
    assert counts == {r: 1 for r in range(RANKS)}
    assert agents.dropped == 0
    assert len(hosts) == RANKS // PER_NODE
    for h in hosts:
        node = h["ranks"][0] // PER_NODE
        assert h["host"] == f"{simulate.host_of(spec, h['ranks'][0])}#{node}"
        assert h["ranks"] == list(range(node * PER_NODE, (node + 1) * PER_NODE))
