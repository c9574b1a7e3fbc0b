"""The bus bandwidth the job's process group reaches with one large message.

The doctor judges a run's small collectives by what the link reaches with larger messages
(docs/doctor.md, latency_bound_collectives). Where none of the run's own ops carries
messages large enough to show it, it takes this probe: a reduce-scatter of
LINK_PROBE_BYTES, timed as the agent times a call (issue to completion), with nccl-tests'
bus bandwidth.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from zerowatch.engine.comm import Comm
from zerowatch.engine.hooks import CollectiveRecord, ObserverRegistry

#: The message of the probe (nccl-tests "size"): large enough that the fixed latency of a
#: call is a small part of its time on gloo over loopback (about 2 ms for 8 MiB between 2
#: ranks, against 0.1-0.3 ms for a call of a few KiB).
LINK_PROBE_BYTES = 8 << 20
#: Timed calls of the probe after a first one (the median counts).
LINK_PROBE_CALLS = 3


class _Latencies:
    """Each call's latency as the agent counts it: issue to completion."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_collective(self, rec: CollectiveRecord) -> None:
        self.seconds.append(rec.end - rec.start)


def link_bandwidth(comm: Comm, *, device: torch.device,
                   dtype: torch.dtype) -> dict[str, Any] | None:  # fmt: skip
    """{"op": "reduce_scatter", "message_bytes", "latency_s", "busbw"}: the median of
    LINK_PROBE_CALLS synchronous reduce-scatters of LINK_PROBE_BYTES on `comm`'s process
    group, after a first one, with nccl-tests' bus bandwidth (bytes / latency x (n-1)/n).
    None on one rank or a GPU (the doctor prices the host's side of CPU runs only). Every
    rank must call it alike: it communicates. Holds at most 1.5 x LINK_PROBE_BYTES."""
    world_size = comm.world_size
    if world_size <= 1 or device.type != "cpu":
        return None
    numel = LINK_PROBE_BYTES // torch.empty((), dtype=dtype).element_size()
    numel -= numel % world_size
    source = torch.zeros(numel, device=device, dtype=dtype)
    out = torch.empty(numel // world_size, device=device, dtype=dtype)
    timed = _Latencies()
    registry = ObserverRegistry()
    registry.add(timed)
    quiet = Comm(registry, group=comm.group)
    for _ in range(LINK_PROBE_CALLS + 1):
        quiet.reduce_scatter(out, source, purpose="other")
    # Synchronous calls report before they return.
    latency = statistics.median(timed.seconds[1:])
    nbytes = numel * source.element_size()
    busbw = nbytes / latency * (world_size - 1) / world_size  # nccl-tests' reduce-scatter
    return {"op": "reduce_scatter", "message_bytes": nbytes, "latency_s": latency,
            "busbw": busbw}  # fmt: skip


__all__ = ["LINK_PROBE_BYTES", "LINK_PROBE_CALLS", "link_bandwidth"]
