"""The probe of the link (zerowatch/rehearse/link.py): the bus bandwidth the job's process
group reaches with one large message, what the doctor judges small collectives by when a
run has no larger ones of its own."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.engine_harness import run_ranks

from zerowatch.engine.comm import Comm
from zerowatch.engine.hooks import ObserverRegistry
from zerowatch.rehearse.link import LINK_PROBE_BYTES, link_bandwidth


def _link(rank: int, world: int) -> dict[str, Any]:
    comm = Comm(ObserverRegistry())
    got = link_bandwidth(comm, device=torch.device("cpu"), dtype=torch.float32)
    # A reduce-scatter of 600 elements, as a run with 600-element buckets makes, timed alike.
    small, out = torch.zeros(600), torch.empty(600 // world)
    t0 = time.perf_counter()
    for _ in range(5):
        comm.reduce_scatter(out, small)
    small_busbw = 5 * small.numel() * 4 / (time.perf_counter() - t0) * (world - 1) / world
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    on_gpu = link_bandwidth(comm, device=torch.device("cuda"), dtype=torch.float32)
    return {"got": got, "small_busbw": small_busbw, "sum": float(probe.item()), "gpu": on_gpu}


def test_the_link_is_probed_with_one_large_message_on_every_rank_alike() -> None:
    """A reduce-scatter of LINK_PROBE_BYTES whose bus bandwidth is far above what a call of
    600 elements reaches (each pays the fixed latency); the ranks' calls pair up; nothing
    on one rank or a GPU."""
    for r in run_ranks(_link, 2):
        got = r["got"]
        assert got["op"] == "reduce_scatter" and got["message_bytes"] == LINK_PROBE_BYTES
        assert got["busbw"] == pytest.approx(got["message_bytes"] / got["latency_s"] / 2)
        assert got["busbw"] > 4 * r["small_busbw"]
        assert r["sum"] == 3.0
        assert r["gpu"] is None
    one = link_bandwidth(Comm(ObserverRegistry()), device=torch.device("cpu"),
                         dtype=torch.float32)  # fmt: skip
    assert one is None
