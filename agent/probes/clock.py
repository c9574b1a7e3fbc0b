"""Two clocks for timing phases: the host's perf_counter, or CUDA events read later.

A clock marks a boundary when it happens (`mark`) and later turns marks into durations
(`ready`, then `seconds`), then takes the marks back (`release`). Everything that pairs
boundaries into phases works on marks through this interface alone, so the host and the
GPU differ here and nowhere else.

On CPU a phase's duration is known the moment it ends: the mark is the time itself. On a
GPU the host runs ahead of the device, so host timestamps would time the kernel launches,
not the work; instead each mark records a CUDA event on the current stream, and the
durations are read a step later, once the events have completed (`ready`), with
`elapsed_time` — never a synchronize per op. Events come from a pool: a new event costs
its creation at its first record, so the marks of a step whose durations were read go
back to the pool (`release`) and the next steps record those again. The pool holds what
the steps in flight use (about two steps' boundaries); an event is created only when it
is empty.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class Clock(Protocol):
    """Marks points in time and, once they are known, turns pairs of marks into seconds."""

    def mark(self, t: float) -> Any:
        """A mark for now, host time `t` (perf_counter seconds)."""
        ...

    def ready(self, marks: Iterable[Any]) -> bool:
        """Whether every mark's time is known yet (on the host: at once)."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two ready marks."""
        ...

    def host_time(self, mark: Any) -> float:
        """The host perf_counter time at which the mark was made."""
        ...

    def release(self, marks: Iterable[Any]) -> None:
        """Marks that will not be read again: what they hold may be reused."""
        ...


class HostClock:
    """perf_counter marks: the mark is the time; always ready, nothing to release."""

    #: The mark is the time itself (`float`: a C call, no Python frame, on the hot path).
    mark = staticmethod(float)

    def ready(self, marks: Iterable[Any]) -> bool:
        return True

    def seconds(self, start: Any, end: Any) -> float:
        return float(end) - float(start)

    def host_time(self, mark: Any) -> float:
        return float(mark)

    def release(self, marks: Iterable[Any]) -> None:
        pass


class CudaClock:
    """CUDA-event marks `(host time, event, stream key)` on the current stream, resolved
    when their events have completed; the events are pooled (see the module docstring).

    The events of one stream complete in the order they were recorded, so marks are ready
    when the last one of each stream is: `ready` queries one event per stream, not one per
    mark (a query is ~0.7 us, and a 48-layer stage-3 step has ~400 marks).

    `torch.cuda.current_stream(device)` builds a Python Stream object each call (3.6 us on
    an H100 host), so the stream object is kept and rebuilt only when the device's current
    stream (one C call's id) has changed, e.g. under `torch.cuda.stream`.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        index = torch.device(device).index
        self._index = torch.cuda.current_device() if index is None else index
        self._current = torch._C._cuda_getCurrentStream
        self._key: Any = None
        self._stream: Any = None
        #: Events whose last times were read. `pop` (the training thread) and `extend`
        #: (whoever read them) are each atomic: no lock.
        self._free: list[Any] = []
        #: Events created so far (the pool's size).
        self.created = 0

    def mark(self, t: float) -> tuple[float, Any, Any]:
        key = self._current(self._index)
        if key != self._key:
            self._stream = self._torch.cuda.current_stream(self._index)
            self._key = key
        free = self._free
        if free:
            event = free.pop()
        else:
            event = self._torch.cuda.Event(enable_timing=True)
            self.created += 1
        event.record(self._stream)
        return (t, event, key)

    def ready(self, marks: Iterable[Any]) -> bool:
        last = {mark[2]: mark[1] for mark in marks}  # stream -> its last event
        return all(event.query() for event in last.values())

    def seconds(self, start: Any, end: Any) -> float:
        return float(start[1].elapsed_time(end[1])) / 1e3

    def host_time(self, mark: Any) -> float:
        return float(mark[0])

    def release(self, marks: Iterable[Any]) -> None:
        self._free.extend([mark[1] for mark in marks])


__all__ = ["Clock", "CudaClock", "HostClock"]
