"""Two clocks for timing phases: the host's perf_counter, or CUDA events read later.

On CPU a phase's duration is known the moment it ends. On a GPU the host runs ahead of the
device, so host timestamps would time the kernel launches, not the work; instead each mark
records a CUDA event on the current stream, and the durations are read a step later, once
the events have completed (`ready`), with `elapsed_time` — never a synchronize per op.
"""

from __future__ import annotations

from typing import Any, Protocol


class Clock(Protocol):
    """Marks points in time and turns pairs of marks into seconds."""

    def mark(self, t: float) -> Any:
        """A mark for host time `t` (perf_counter seconds)."""
        ...

    def ready(self, mark: Any) -> bool:
        """Whether the mark's time is known yet."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two ready marks."""
        ...

    def host_time(self, mark: Any) -> float:
        """The host perf_counter time at which the mark was made."""
        ...


class HostClock:
    """perf_counter marks; always ready."""

    #: The mark is the time itself (`float`: a C call, no Python frame, on the hot path).
    mark = staticmethod(float)

    def ready(self, mark: Any) -> bool:
        return True

    def seconds(self, start: Any, end: Any) -> float:
        return float(end) - float(start)

    def host_time(self, mark: Any) -> float:
        return float(mark)


class CudaClock:
    """CUDA-event marks on the current stream, resolved when they have completed."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self._device = device

    def mark(self, t: float) -> tuple[float, Any]:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(self._device))
        return (t, event)

    def ready(self, mark: Any) -> bool:
        return bool(mark[1].query())

    def seconds(self, start: Any, end: Any) -> float:
        return float(start[1].elapsed_time(end[1])) / 1e3

    def host_time(self, mark: Any) -> float:
        return float(mark[0])


__all__ = ["Clock", "CudaClock", "HostClock"]
