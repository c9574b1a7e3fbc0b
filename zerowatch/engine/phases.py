"""The one place that announces phase boundaries.

Top-level phases of a micro-batch do not overlap: `forward`, `backward`, `optimizer_step`.
Nested inside them: `grad_reduce` (in backward, and at the end of it), `param_gather` (in
forward and backward for stage 3, in optimizer_step for stages 1-2), `offload_d2h` and
`offload_h2d` (copies to and from host memory). `step` spans one whole optimizer step: it
starts at the first forward of a gradient-accumulation cycle and ends at the end of the
`engine.step()` that crossed the boundary.

Each phase is also a `torch.profiler.record_function("zerowatch::<phase>")` range, so a
torch profiler trace shows the same names the dashboards do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch.profiler import record_function

from zerowatch import events as ev
from zerowatch.engine.hooks import ObserverRegistry

#: What this module announces: the wire vocabulary's phases, and `step` around them all.
PHASES: tuple[str, ...] = (*ev.PHASES, "step")


class Phases:
    """Announces phases to the observers and labels them for the profiler."""

    def __init__(self, observers: ObserverRegistry) -> None:
        self.observers = observers

    def start(self, name: str) -> None:
        self.observers.call("on_phase_start", name, time.perf_counter())

    def end(self, name: str) -> None:
        self.observers.call("on_phase_end", name, time.perf_counter())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Announce `name` around the body and label it for the profiler."""
        with record_function(f"zerowatch::{name}"):
            self.start(name)
            try:
                yield
            finally:
                self.end(name)

    @contextmanager
    def offload(self, direction: str, nbytes: int) -> Iterator[None]:
        """A host copy ("d2h" or "h2d") of `nbytes`: its phase, and its bytes and times."""
        with self.phase(f"offload_{direction}"):
            t0 = time.perf_counter()
            yield
            t1 = time.perf_counter()
        self.observers.call("on_offload", direction, nbytes, t0, t1)


__all__ = ["PHASES", "Phases"]
