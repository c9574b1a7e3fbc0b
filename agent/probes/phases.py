"""Wall-clock per phase of one step, from the engine's phase boundaries.

The top-level phases forward, backward and optimizer_step do not overlap and, with the gap
between them (`other`: user code, data loading, anything outside the engine), make up the
step. grad_reduce, param_gather and the offload copies nest inside them. A phase that runs
several times in a step (forward under gradient accumulation, one param_gather per
submodule) is summed; a phase nested in itself is counted once (the outer interval).

DeepSpeed's `wall_clock_breakdown` names map onto these: fwd = forward, bwd = backward,
bwd_allreduce = grad_reduce, step = optimizer_step, and bwd_inner = `backward_inner`, the
backward time outside gradient reduction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerowatch.agent.probes.clock import Clock

#: Phases that partition the step (with `other`).
TOP_LEVEL = ("forward", "backward", "optimizer_step")


@dataclass
class PhaseWindow:
    """The phase intervals of one step, resolved once their clock marks are ready."""

    clock: Clock
    #: (phase, start mark, end mark, ran inside backward)
    intervals: list[tuple[str, Any, Any, bool]] = field(default_factory=list)

    def ready(self) -> bool:
        return all(self.clock.ready(end) for _, _, end, _ in self.intervals)

    def totals(self) -> dict[str, float]:
        """Seconds per phase, plus `backward_inner` when backward ran."""
        out: dict[str, float] = {}
        reduce_in_backward = 0.0
        for phase, start, end, in_backward in self.intervals:
            d = max(self.clock.seconds(start, end), 0.0)
            out[phase] = out.get(phase, 0.0) + d
            if phase == "grad_reduce" and in_backward:
                reduce_in_backward += d
        if "backward" in out:
            out["backward_inner"] = max(out["backward"] - reduce_in_backward, 0.0)
        return out

    def spans(self) -> list[tuple[str, float, float]]:
        """(phase, host start, host end) per interval, for the trace export."""
        out = []
        for phase, start, end, _ in self.intervals:
            t0 = self.clock.host_time(start)
            out.append((phase, t0, t0 + max(self.clock.seconds(start, end), 0.0)))
        return out


class PhaseTimer:
    """Collects phase boundaries on the training thread; `take()` hands over one step's
    intervals.

    A boundary is only logged when it arrives (one append); `take()` pairs the step's
    boundaries into intervals in one loop. Between the engine's kernels, which evict the
    CPU's caches, that costs a fraction of pairing each boundary as it comes.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._mark = clock.mark
        #: (phase, is a start, clock mark) per boundary, in order.
        self._log: list[tuple[str, bool, Any]] = []
        #: Start marks of the phases open at the end of the log, per phase.
        self._open: dict[str, list[Any]] = {}

    def start(self, phase: str, t: float) -> None:
        self._log.append((phase, True, self._mark(t)))

    def end(self, phase: str, t: float) -> None:
        self._log.append((phase, False, self._mark(t)))

    def take(self) -> PhaseWindow:
        window = PhaseWindow(self.clock)
        log, self._log = self._log, []
        open_ = self._open
        for phase, is_start, mark in log:
            stack = open_.get(phase)
            if is_start:
                if stack is None:
                    stack = open_[phase] = []
                stack.append(mark)
            elif stack:  # (an end without a start, attached mid-phase: nothing to time)
                start = stack.pop()
                if not stack:  # (nested in the same phase: the outer interval counts)
                    in_backward = bool(open_.get("backward"))
                    window.intervals.append((phase, start, mark, in_backward))
        return window

    def reset(self) -> None:
        self._log = []
        self._open.clear()


__all__ = ["TOP_LEVEL", "PhaseTimer", "PhaseWindow"]
