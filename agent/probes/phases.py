"""Wall-clock per phase of one step, from the engine's phase boundaries.

The top-level phases forward, backward and optimizer_step do not overlap and, with the gap
between them (`other`: user code, data loading, anything outside the engine), make up the
step. grad_reduce, param_gather and the offload copies nest inside them. A phase that runs
several times in a step (forward under gradient accumulation, one param_gather per
submodule) is summed; a phase nested in itself is counted once (the outer interval).

DeepSpeed's `wall_clock_breakdown` names map onto these: fwd = forward, bwd = backward,
bwd_allreduce = grad_reduce, step = optimizer_step, and bwd_inner = `backward_inner`, the
backward time outside gradient reduction.

Phases nest, so they cannot be stacked. `PhaseWindow.parts` cuts the step instead into
`events.STEP_PARTS`, parts that never overlap and add up to the step: every instant of the
step goes to the innermost phase running then (an offload copy before a gradient reduce,
that before a parameter gather, that before forward / backward / optimizer step), and an
instant in no phase to `other`. So `forward_compute` is the forward's self time, and the
time the training thread spent blocked in a gather is `exposed_param_gather`, counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerowatch.agent.probes.clock import Clock

from zerowatch.events import STEP_PARTS as _PARTS

#: Phases that partition the step (with `other`).
TOP_LEVEL = ("forward", "backward", "optimizer_step")

#: Phase -> (exclusive part, priority): where phases nest, the higher priority (the inner
#: one) owns the time. The top-level phases never overlap one another.
_PART_OF = {
    "forward": ("forward_compute", 1),
    "backward": ("backward_compute", 2),
    "optimizer_step": ("optimizer_step", 3),
    "param_gather": ("exposed_param_gather", 4),
    "grad_reduce": ("exposed_grad_reduce", 5),
    "offload_d2h": ("exposed_offload", 6),
    "offload_h2d": ("exposed_offload", 6),
}
_BY_PRIORITY = ["other", *(part for part, _ in sorted(set(_PART_OF.values()), key=lambda x: x[1]))]
_TOP_DOWN = range(len(_BY_PRIORITY) - 1, 0, -1)


def exclusive_parts(intervals: list[tuple[str, float, float]], step_s: float) -> dict[str, float]:
    """The step cut into STEP_PARTS (see the module docstring).

    Args:
        intervals: (phase, start, end) in seconds from the step's start; phases outside
            `_PART_OF` are ignored, intervals are clipped to the step.
        step_s: the step's length.

    Returns:
        {part: seconds} for every part in STEP_PARTS (0.0 where absent); the values add up
        to `step_s` and none is negative.
    """
    # A sweep over the interval boundaries, keeping how many intervals of each priority
    # are open; each elementary segment goes to the highest priority open (0: other).
    edges: list[tuple[float, int, int]] = []
    for phase, t0, t1 in intervals:
        owner = _PART_OF.get(phase)
        if owner is None:
            continue
        a, b = max(t0, 0.0), min(t1, step_s)
        if b > a:
            edges.append((a, 1, owner[1]))
            edges.append((b, -1, owner[1]))
    edges.sort()
    out = dict.fromkeys(_PARTS, 0.0)
    open_ = [0] * len(_BY_PRIORITY)
    prev = 0.0
    for t, delta, prio in edges:
        if t > prev:
            top = next((p for p in _TOP_DOWN if open_[p]), 0)
            out[_BY_PRIORITY[top]] += t - prev
            prev = t
        open_[prio] += delta
    if step_s > prev:
        out["other"] += step_s - prev
    return out


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

    def parts(self, step_start: Any, step_s: float) -> dict[str, float]:
        """The step's exclusive parts (`exclusive_parts`), `step_start` its clock mark."""
        seconds = self.clock.seconds
        return exclusive_parts(
            [(phase, seconds(step_start, start), seconds(step_start, end))
             for phase, start, end, _ in self.intervals],
            step_s,
        )  # fmt: skip

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


__all__ = ["TOP_LEVEL", "PhaseTimer", "PhaseWindow", "exclusive_parts"]
