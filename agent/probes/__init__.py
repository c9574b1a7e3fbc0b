"""Measure: what happens in a step, from the engine's hooks (no shipping, no HTTP)."""

from zerowatch.agent.probes.clock import Clock, CudaClock, HostClock
from zerowatch.agent.probes.collectives import CollectiveAggregator, CollectiveWindow
from zerowatch.agent.probes.memory import CudaMemoryProbe, MemoryProbe
from zerowatch.agent.probes.offload import OffloadProbe, OffloadWindow
from zerowatch.agent.probes.phases import TOP_LEVEL, PhaseTimer, PhaseWindow

__all__ = [
    "TOP_LEVEL",
    "Clock",
    "CollectiveAggregator",
    "CollectiveWindow",
    "CudaClock",
    "CudaMemoryProbe",
    "HostClock",
    "MemoryProbe",
    "OffloadProbe",
    "OffloadWindow",
    "PhaseTimer",
    "PhaseWindow",
]
