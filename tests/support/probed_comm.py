"""A `Comm` whose collectives go to the agent's collective probe, as in a 2-rank NCCL group
whose launches a test scripts (the GPU timing tests: scripted and on real streams)."""

from __future__ import annotations

from typing import Any

from zerowatch.agent.probes.collectives import CollectiveAggregator

from zerowatch.engine import comm as comm_mod
from zerowatch.engine.hooks import ObserverRegistry


def probed_comm() -> tuple[comm_mod.Comm, CollectiveAggregator]:
    """(comm, probe): every collective `comm` reports is recorded by `probe`; `comm` acts as
    a rank of two, so its `_run` launches whatever the test passes instead of skipping."""
    probe = CollectiveAggregator()
    observers = ObserverRegistry()

    class Observer:
        def on_collective(self, rec: Any) -> None:
            probe.record(rec)

    observers.add(Observer())
    comm = comm_mod.Comm(observers)
    comm.world_size = 2
    return comm, probe
