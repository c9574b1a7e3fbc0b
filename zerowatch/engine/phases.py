"""The one place that announces phase boundaries.

Top-level phases of a micro-batch do not overlap: `forward`, `backward`, `optimizer_step`.
Nested inside them: `grad_reduce` (in backward, and at the end of it), `param_gather` (in
forward and backward for stage 3, in optimizer_step for stages 1-2), `offload_d2h` and
`offload_h2d` (copies to and from host memory). `step` spans one whole optimizer step: it
starts at the first forward of a gradient-accumulation cycle and ends at the end of the
`engine.step()` that crossed the boundary.

While a torch profiler records, each phase is also a
`torch.profiler.record_function("zerowatch::<phase>")` range, so its trace shows the same
names the dashboards do.

An offload copy also reports its bytes and its time (`on_offload`). On a GPU that time is
a pair of CUDA events on the copy's stream around it, read a step later: a `non_blocking`
copy from pinned memory returns to the host at once, so host time around it is its launch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import record_function

from zerowatch import events as ev
from zerowatch.engine.hooks import ObserverRegistry

#: Whether a torch profiler is recording (a C function: 0.07 us, no op dispatched).
_profiling = torch._C._autograd._profiler_enabled


#: What this module announces: the wire vocabulary's phases, and `step` around them all.
PHASES: tuple[str, ...] = (*ev.PHASES, "step")


class Phases:
    """Announces phases to the observers and labels them for the profiler."""

    def __init__(self, observers: ObserverRegistry) -> None:
        self.observers = observers
        #: Whether the engine trains on a GPU (its copies are timed with CUDA events).
        self.cuda = False

    def start(self, name: str) -> None:
        self.observers.call("on_phase_start", name, time.perf_counter())

    def end(self, name: str) -> None:
        self.observers.call("on_phase_end", name, time.perf_counter())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Announce `name` around the body; while a torch profiler records, also label it.

        Outside a profiler there is no range at all: entering and leaving one are torch ops,
        each of which gives up the GIL and may wait up to a switch interval to take it back
        from another Python thread (the gloo ring's, running the previous collective), two
        hand-overs per phase for nothing. Inside one, the phase starts just after the range
        is entered and ends just after it is left, so the profiler's interval and the
        phase's agree (bench/timing.py): a GIL wait that falls inside the range is in both.
        Announced inside the range at both ends, stage 3's overlapped gradient reduce read
        25% below the profiler's intervals per step, the waits at each range's exit lying
        outside the phase.
        """
        if not _profiling():
            self.start(name)
            try:
                yield
            finally:
                self.end(name)
            return
        try:
            with record_function(f"zerowatch::{name}"):
                self.start(name)
                yield
        finally:
            self.end(name)

    @contextmanager
    def offload(self, direction: str, nbytes: int) -> Iterator[None]:
        """A host copy ("d2h" or "h2d") of `nbytes` issued in the body: its phase, and its
        bytes and host times; on a GPU also (start, end) CUDA events recorded on the
        current stream before and after the body, the stream the copy is queued on."""
        if not self.cuda:
            with self.phase(f"offload_{direction}"):
                t0 = time.perf_counter()
                yield
                t1 = time.perf_counter()
            self.observers.call("on_offload", direction, nbytes, t0, t1)
            return
        with self.phase(f"offload_{direction}"):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            yield
            t1 = time.perf_counter()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.observers.call("on_offload", direction, nbytes, t0, t1, (start, end))


__all__ = ["PHASES", "Phases"]
