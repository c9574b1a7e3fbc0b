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

Bookkeeping is by index. Every phase name has an index (`PhaseCodes`); a boundary is logged
as two items appended to one flat list: its code (2·index for a start, 2·index + 1 for an
end: a small int, which Python never allocates) and its clock mark (`clock.py`: on the
host the time itself, on a GPU a CUDA event). A callback therefore allocates nothing and
touches the fewest objects, which is what it costs between the engine's kernels, which
evict the CPU's caches.

At a step's end the timer hands its log over whole (`PhaseTimer.take`: a new list takes
its place, with room for a step like it: `room.py`) with the step's first and last marks,
and nothing else happens on the training thread. The window is read once its clock says its marks are known (`ready`: on the host
at once, on a GPU when the step's events have completed); the first read turns every
mark into seconds from the step's start (`Clock.seconds`), gives the marks back to the
clock (`Clock.release`) and pairs the boundaries in one pass (`_pair`, the one pairing of
every clock): phases nested in themselves count once (the outer interval), an end without
a start (attached mid-phase) and a start still open at the step's end are not timed. The
same pass sums the phases and lays out the edges of the outermost intervals in the order
they happened, so the exclusive parts are one sweep over them (`_sweep`, no sort), unless
the times do not run forward (marks on another stream or thread): then the intervals are
sorted first (`exclusive_parts`).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain, islice
from typing import Any

from zerowatch.agent.probes.clock import Clock
from zerowatch.agent.probes.room import Spares, with_room

from zerowatch import events as ev
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
#: Part names by priority (0: other).
_BY_PRIORITY = ["other", *(part for part, _ in sorted(set(_PART_OF.values()), key=lambda x: x[1]))]
_TOP_DOWN = range(len(_BY_PRIORITY) - 1, 0, -1)
#: The part that owns an instant, by the mask of the priorities open then: its highest bit
#: (a list index, where `int.bit_length` would be a call per edge).
_OWNER = [0] + [mask.bit_length() - 1 for mask in range(1, 1 << len(_BY_PRIORITY))]


def _sweep(edges: list[Any], step_s: float) -> list[float] | None:
    """Seconds per priority (index 0: other) of a step cut at `edges`.

    Args:
        edges: flat [time, signed priority, ...] in the order they happened, times in
            seconds from the step's start: +p opens an interval of priority p, -p closes
            one, 0 is ignored.
        step_s: the step's length; times are clipped to [0, step_s].

    Returns:
        None when the times do not run forward (the caller sorts instead).
    """
    counts = [0] * len(_BY_PRIORITY)
    out = [0.0] * len(_BY_PRIORITY)
    owner = _OWNER
    mask = 0  # bit p set while an interval of priority p is open
    prev = 0.0
    it = iter(edges)
    for t, p in zip(it, it, strict=True):  # (time, signed priority) pairs
        if not p:
            continue
        if t > step_s:
            t = step_s
        elif t < 0.0:
            t = 0.0
        if t > prev:
            out[owner[mask]] += t - prev
            prev = t
        elif t < prev:
            return None
        if p > 0:
            counts[p] += 1
            mask |= 1 << p
        else:
            counts[-p] -= 1
            if counts[-p] <= 0:
                counts[-p] = 0
                mask &= ~(1 << -p)
    if step_s > prev:
        out[_OWNER[mask]] += step_s - prev
    return out


def _as_parts(seconds_by_priority: list[float]) -> dict[str, float]:
    out = dict.fromkeys(_PARTS, 0.0)
    for prio, s in enumerate(seconds_by_priority):
        out[_BY_PRIORITY[prio]] += s
    return out


def exclusive_parts(intervals: list[tuple[str, float, float]], step_s: float) -> dict[str, float]:
    """The step cut into STEP_PARTS (see the module docstring).

    Args:
        intervals: (phase, start, end) in seconds from the step's start; phases outside
            `_PART_OF` are ignored, intervals are clipped to the step.
        step_s: the step's length.

    Returns:
        {part: seconds} for every part in STEP_PARTS (0.0 where absent); the values add up
        to `step_s` and none is negative. Whatever is open at the step's end owns the rest.
    """
    # A sweep over the interval boundaries, sorted (at one instant ends before starts).
    sorted_edges: list[tuple[float, int]] = []
    for phase, t0, t1 in intervals:
        owner = _PART_OF.get(phase)
        if owner is None:
            continue
        a, b = max(t0, 0.0), min(t1, step_s)
        if b > a:
            sorted_edges.append((a, owner[1]))
            sorted_edges.append((b, -owner[1]))
    sorted_edges.sort(key=lambda e: (e[0], e[1] > 0, abs(e[1])))
    flat: list[Any] = [x for edge in sorted_edges for x in edge]
    out = _sweep(flat, step_s)
    assert out is not None  # sorted: the times run forward
    return _as_parts(out)


class PhaseCodes:
    """Phase names <-> indices, and the boundary codes a timer logs (2·i start, 2·i + 1
    end). The engine's phases have fixed indices; any other name an adapter reports gets
    the next one when first seen."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.start: dict[str, int] = {}
        self.end: dict[str, int] = {}
        #: Exclusive-part priority per index (0: the phase is no part).
        self.priority: list[int] = []
        for name in ev.PHASES:
            self.add(name)
        self.backward = self.start["backward"] >> 1
        self.grad_reduce = self.start["grad_reduce"] >> 1

    def add(self, name: str) -> int:
        """The index of `name`, assigned now if it has none."""
        code = self.start.get(name)
        if code is not None:
            return code >> 1
        i = len(self.names)
        self.names.append(name)
        self.priority.append(_PART_OF.get(name, ("", 0))[1])
        self.end[name] = 2 * i + 1
        self.start[name] = 2 * i  # last: readers check `start` first
        return i


class PhaseWindow:
    """The phase boundaries of one step, paired when first read (once `ready()`).

    Args:
        clock: whose marks these are.
        codes: the phase indices the boundaries speak of.
        log: flat [code, mark, ...] per boundary from `log[first]` on, in the order they
            happened.
        start, end: the step's first and last marks.
        first: where the boundaries start in `log` (after its padding).
    """

    def __init__(self, clock: Clock, codes: PhaseCodes, log: list[Any], start: Any, end: Any,
                 first: int = 0) -> None:  # fmt: skip
        self.clock = clock
        self.codes = codes
        self.start = start
        self.end = end
        self._log: list[Any] | None = log
        self._first = first
        self._paired: _Paired | None = None

    def _marks(self, log: list[Any]) -> Any:
        """The step's marks in the order they were made."""
        return chain((self.start,), islice(log, self._first + 1, None, 2), (self.end,))

    def ready(self) -> bool:
        """Whether the step's marks are known (on the host: always)."""
        return self._log is None or self.clock.ready(self._marks(self._log))

    def discard(self) -> None:
        """Give the marks back unread (a step that is dropped)."""
        log, self._log = self._log, None
        if log is not None:
            self.clock.release(self._marks(log))

    def _pair(self) -> _Paired:
        if self._paired is None:
            log, self._log = self._log, None
            assert log is not None, "a discarded window is not read"
            clock, start = self.clock, self.start
            seconds = clock.seconds
            step_s = max(seconds(start, self.end), 0.0)
            first = self._first
            times = [seconds(start, mark) for mark in islice(log, first + 1, None, 2)]
            clock.release(self._marks(log))
            self._paired = _pair_boundaries(self.codes, islice(log, first, None, 2), times,
                                            step_s)  # fmt: skip
        return self._paired

    @property
    def step_s(self) -> float:
        """The step's length in seconds (from its first mark to its last)."""
        return self._pair().step_s

    @property
    def intervals(self) -> list[tuple[str, float, float, bool]]:
        """(phase, start, end, ran inside backward) in seconds from the step's start, in the
        order they ended."""
        names, iv = self.codes.names, self._pair().intervals
        return [(names[iv[j]], iv[j + 1], iv[j + 2], iv[j + 3]) for j in range(0, len(iv), 4)]

    def totals(self) -> dict[str, float]:
        """Seconds per phase, plus `backward_inner` when backward ran."""
        return dict(self._pair().totals)

    def parts(self) -> dict[str, float]:
        """The step's exclusive parts (`exclusive_parts`): they add up to `step_s`."""
        return dict(self._pair().parts)

    def spans(self) -> list[tuple[str, float, float]]:
        """(phase, host start, host end) per interval, for the trace export: the step's host
        start plus each interval's times on the step's clock."""
        t0 = self.clock.host_time(self.start)
        return [(phase, t0 + a, t0 + max(b, a)) for phase, a, b, _ in self.intervals]


class PhaseTimer:
    """Collects phase boundaries on the training thread; `take()` hands over one step's.

    A boundary is two appends to `log` (its code and its clock mark): `start` / `end` by
    name, or the recorder's callbacks directly (`codes`). `take()` hands the log itself over
    and a new list takes its place: whoever appends directly reads `log` again each time.
    The boundaries start at `log[base]`, after the padding of a list with room (`room.py`).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.codes = PhaseCodes()
        #: code, mark, code, mark, ... per boundary of the step in progress, in order, from
        #: `log[base]` on.
        self.log, self.base = with_room(0)
        self._spares = Spares()

    def start(self, phase: str, t: float) -> None:
        code = self.codes.start.get(phase)
        if code is None:
            code = 2 * self.codes.add(phase)
        log = self.log
        log.append(code)
        log.append(self.clock.mark(t))

    def end(self, phase: str, t: float) -> None:
        code = self.codes.end.get(phase)
        if code is None:
            code = 2 * self.codes.add(phase) + 1
        log = self.log
        log.append(code)
        log.append(self.clock.mark(t))

    def take(self, step_start: Any, step_end: Any) -> PhaseWindow:
        """The boundaries logged since the last `take()` or `reset()`, as the window of the
        step between the marks `step_start` and `step_end` (paired when first read)."""
        log, first = self.log, self.base
        self.log, self.base = self._spares.take(len(log) - first)
        return PhaseWindow(self.clock, self.codes, log, step_start, step_end, first)

    def make_room(self) -> None:
        """Make logs with room ready for coming `take()`s (on the shipper thread:
        `room.Spares`)."""
        self._spares.make()

    def reset(self) -> None:
        """Forget the boundaries logged since the last `take()` (between two steps)."""
        log, base = self.log, self.base
        if len(log) > base:
            self.clock.release(islice(log, base + 1, None, 2))
            del log[base:]


class _Paired:
    """What one pass over a step's boundaries gives (`_pair_boundaries`)."""

    __slots__ = ("intervals", "parts", "step_s", "totals")

    def __init__(self, intervals: list[Any], totals: dict[str, float], parts: dict[str, float],
                 step_s: float) -> None:  # fmt: skip
        #: flat [phase index, start, end, ran inside backward, ...] in the order they ended.
        self.intervals = intervals
        self.totals = totals
        self.parts = parts
        self.step_s = step_s


def _pair_boundaries(codes: PhaseCodes, boundary_codes: Iterable[int], times: list[float],
                     step_s: float) -> _Paired:  # fmt: skip
    """Pair one step's boundaries into intervals, sum the phases and cut the step into its
    exclusive parts, in one pass (the module docstring says what is timed).

    Args:
        codes: the phase indices.
        boundary_codes: each boundary's code, in the order they happened.
        times: each boundary's time in seconds from the step's start, in the same order.
        step_s: the step's length.
    """
    priority = codes.priority
    n_phases = len(codes.names)
    depth = [0] * n_phases  # open starts per phase index
    outer = [0.0] * n_phases  # the outermost open start's time
    outer_edge = [-1] * n_phases  # where that start sits in `edges`
    sums = [0.0] * n_phases
    seen = [False] * n_phases
    backward, grad_reduce = codes.backward, codes.grad_reduce
    reduce_in_backward = 0.0
    intervals: list[Any] = []
    # The outermost intervals' edges, in the order they happened, for the cut (`_sweep`).
    edges: list[Any] = []
    for code, t in zip(boundary_codes, times, strict=True):
        i = code >> 1
        d = depth[i]
        if code & 1:  # an end
            if not d:  # (without a start, attached mid-phase: nothing to time)
                continue
            depth[i] = d - 1
            if d > 1:  # (nested in the same phase: the outer interval counts)
                continue
            start = outer[i]
            in_backward = depth[backward] > 0
            intervals += (i, start, t, in_backward)
            seconds = t - start
            if seconds > 0.0:
                sums[i] += seconds
                if in_backward and i == grad_reduce:
                    reduce_in_backward += seconds
            seen[i] = True
            p = priority[i]
            if p:
                edges += (t, -p)
        else:
            depth[i] = d + 1
            if not d:
                outer[i] = t
                p = priority[i]
                if p:
                    outer_edge[i] = len(edges)
                    edges += (t, p)
    for i, d in enumerate(depth):
        if d and outer_edge[i] >= 0:  # still open at the step's end: not timed
            edges[outer_edge[i] + 1] = 0
    cut = _sweep(edges, step_s)
    names = codes.names
    if cut is None:  # times out of order (marks on another stream or thread): sort them
        parts = exclusive_parts([(names[intervals[j]], intervals[j + 1], intervals[j + 2])
                                 for j in range(0, len(intervals), 4)], step_s)  # fmt: skip
    else:
        parts = _as_parts(cut)
    totals = {names[i]: sums[i] for i in range(n_phases) if seen[i]}
    if "backward" in totals:
        totals["backward_inner"] = max(totals["backward"] - reduce_in_backward, 0.0)
    return _Paired(intervals, totals, parts, step_s)


__all__ = ["TOP_LEVEL", "PhaseCodes", "PhaseTimer", "PhaseWindow", "exclusive_parts"]
