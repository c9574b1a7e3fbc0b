"""The engine's observer interface: how anyone (the agent) learns what the engine does.

The engine knows nothing of the agent. It reports two things, each from exactly one place:

* every collective, from `engine/comm.py`, as a `CollectiveRecord` given to each registered
  `CommObserver`;
* every phase boundary (forward, backward, grad_reduce, param_gather, optimizer_step,
  offload_d2h, offload_h2d, and `step` for the whole optimizer step), from
  `engine/phases.py`, given to each registered `PhaseObserver`; offload copies also report
  their bytes through `on_offload` (with CUDA events on the copy's stream on a GPU).

Observers are called synchronously on the training thread (or, for async collectives, on
the thread that completes the work), so they must be cheap and must not raise; the
registry swallows and counts what they raise, so an observer bug never breaks training.

Timestamps are `time.perf_counter()` seconds. On CUDA, a record's `start`/`end` may be
filled in late: the record carries the CUDA events (`cuda_events`) and the observer reads
`elapsed_time` a step later instead of synchronizing per op.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger("zerowatch.engine")


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective call, as the comm module saw it.

    Attributes:
        op: "all_gather", "reduce_scatter", "all_reduce" or "broadcast".
        purpose: "param_fetch", "grad_reduce", "optimizer_gather" or "other".
        nbytes: nccl-tests "size": the full tensor (all-gather output, reduce-scatter input,
            all-reduce buffer), in bytes.
        world_size: size of the process group it ran on.
        start: perf_counter when it was issued.
        end: perf_counter when it completed (for async work: when its future completed).
        async_op: issued asynchronously, to overlap with compute.
        exposed_s: time the training thread was blocked on it (the whole latency for a
            synchronous call, the time spent in `wait()` for an async one).
        cuda_events: on CUDA, (start, end) torch.cuda.Events bounding the collective: start
            on the stream where it was launched (the collective can begin once the stream
            reaches it), end on the stream that waited for it, just after the caller's
            `wait()` (exact when that stream stalled, an upper bound when compute hid the
            collective; nothing else ever waits for it: docs/gpu.md).
        cuda_exposed: on CUDA, (before, after) events on the compute stream around its
            wait for the collective: how long the compute stream stalled (the whole
            latency for a synchronous call). The host time in `exposed_s` measures only
            launches there (NCCL's wait returns at once).
    """

    op: str
    purpose: str
    nbytes: int
    world_size: int
    start: float
    end: float
    async_op: bool
    exposed_s: float
    cuda_events: Any = None
    cuda_exposed: Any = None
    group: str = ""
    seq: int = 0


@runtime_checkable
class CommObserver(Protocol):
    def on_collective(self, record: CollectiveRecord) -> None: ...


@runtime_checkable
class LaunchObserver(Protocol):
    """Hears each collective as it is issued, before it may block (optional: the agent's
    flight recorder, agent/probes/flight.py). The matching `CollectiveRecord` carries the
    same (group, seq) when the collective completes; one that never completes is the
    hang the flight recorder names."""

    def on_collective_launch(self, group: str, seq: int, op: str, numel: int, dtype: Any,
                             t: float) -> None: ...  # fmt: skip


@runtime_checkable
class PhaseObserver(Protocol):
    def on_phase_start(self, phase: str, t: float) -> None: ...

    def on_phase_end(self, phase: str, t: float) -> None: ...

    def on_offload(self, direction: str, nbytes: int, start: float, end: float,
                   cuda_events: Any = None) -> None:  # fmt: skip
        """A host-device copy of `nbytes` between host times `start` and `end`; on a GPU
        `cuda_events` is (start, end) on the copy's stream, the copy's own time."""
        ...


class ObserverRegistry:
    """Thread-safe list of observers; calling them never raises into the engine.

    The engine calls it about a hundred times per step at stage 3, so each observer's
    methods are looked up once, when it is added: `call` walks a ready tuple of
    (observer, bound method) per method name.
    """

    _METHODS = ("on_collective", "on_collective_launch", "on_phase_start", "on_phase_end",
                "on_offload")  # fmt: skip

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observers: tuple[Any, ...] = ()
        self._bound: dict[str, tuple[tuple[Any, Any], ...]] = {}
        self.errors = 0

    def add(self, observer: Any) -> None:
        with self._lock:
            self._set((*self._observers, observer))

    def remove(self, observer: Any) -> None:
        with self._lock:
            self._set(tuple(o for o in self._observers if o is not observer))

    def _set(self, observers: tuple[Any, ...]) -> None:
        self._observers = observers
        # A new dict, not an update: a `call` in flight keeps its snapshot.
        self._bound = {name: self._bind(name) for name in self._METHODS}

    def _bind(self, method: str) -> tuple[tuple[Any, Any], ...]:
        bound = ((obs, getattr(obs, method, None)) for obs in self._observers)
        return tuple((obs, fn) for obs, fn in bound if fn is not None)

    def __bool__(self) -> bool:
        return bool(self._observers)

    def call(self, method: str, *args: Any) -> None:
        bound = self._bound.get(method)
        if bound is None:  # a method outside the interface: look it up now
            bound = self._bind(method)
        for obs, fn in bound:
            try:
                fn(*args)
            except Exception:  # an observer must never break training
                self.errors += 1
                if self.errors == 1:
                    log.exception("zerowatch observer %r failed in %s", obs, method)


__all__ = ["CollectiveRecord", "CommObserver", "LaunchObserver", "ObserverRegistry",
           "PhaseObserver"]  # fmt: skip
