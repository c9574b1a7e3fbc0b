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
    """CUDA-event marks on the current stream, resolved when they have completed.

    A mark is on the hot path (every phase boundary). `torch.cuda.current_stream(device)`
    builds a Python Stream object each call (3.6 us on an H100 host, more between the
    kernels' cache misses), so the stream object is kept and rebuilt only when the
    device's current stream (one C call's id) has changed, e.g. under `torch.cuda.stream`.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        index = torch.device(device).index
        self._index = torch.cuda.current_device() if index is None else index
        self._current = torch._C._cuda_getCurrentStream
        self._key: Any = None
        self._stream: Any = None

    def mark(self, t: float) -> tuple[float, Any]:
        key = self._current(self._index)
        if key != self._key:
            self._stream = self._torch.cuda.current_stream(self._index)
            self._key = key
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return (t, event)

    def ready(self, mark: Any) -> bool:
        return bool(mark[1].query())

    def seconds(self, start: Any, end: Any) -> float:
        return float(start[1].elapsed_time(end[1])) / 1e3

    def host_time(self, mark: Any) -> float:
        return float(mark[0])


__all__ = ["Clock", "CudaClock", "HostClock"]
