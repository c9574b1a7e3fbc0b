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
end: a small int, which Python never allocates) and its clock mark (on the host, the float
the engine passed). A callback therefore allocates nothing and touches the fewest objects,
which is what it costs between the engine's kernels, which evict the CPU's caches.
`take()` pairs the step's boundaries into intervals and lays out the edges of the outermost
ones in the order they happened, so the exclusive parts are one sweep over them (`_sweep`,
no sort) once their marks are known. On the host the marks are known at once: given the
step's first and last marks, `take()` pairs and sums in one pass over the log (the marks
are floats already) and sweeps the edges it laid out, the one cut of every path. The
recorder does not even do that on the training thread: `take_later()` hands the step's log
over (the list itself: a new one takes its place) and the window pairs it when it is first
read, on the shipper thread, where the steps of a flush interval are assembled one after
another (with warm caches).
"""

from __future__ import annotations

from typing import Any

from zerowatch.agent.probes.clock import Clock, HostClock
from zerowatch.agent.probes.room import Spares

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


def _sweep(
    edges: list[Any], step_s: float, seconds: Any, origin: float = 0.0
) -> list[float] | None:
    """Seconds per priority (index 0: other) of a step cut at `edges`.

    Args:
        edges: flat [mark, signed priority, ...] in the order they happened: +p opens an
            interval of priority p, -p closes one, 0 is ignored.
        step_s: the step's length; times are clipped to [0, step_s].
        seconds: mark -> seconds from the step's start; None when the marks are host
            times (seconds from `origin`).
        origin: the step's start, where `seconds` is None.

    Returns:
        None when the times do not run forward (the caller sorts instead).
    """
    counts = [0] * len(_BY_PRIORITY)
    out = [0.0] * len(_BY_PRIORITY)
    owner = _OWNER
    mask = 0  # bit p set while an interval of priority p is open
    prev = 0.0
    it = iter(edges)
    for mark, p in zip(it, it, strict=True):  # (mark, signed priority) pairs
        if not p:
            continue
        t = mark - origin if seconds is None else seconds(mark)
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
    out = _sweep(flat, step_s, None)
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
    """The phase intervals of one step, resolved once their clock marks are ready.

    Args:
        clock: whose marks these are.
        codes: the phase indices the intervals speak of.
        intervals: flat [phase index, start mark, end mark, ran inside backward, ...], in
            the order the intervals ended.
        edges: flat [mark, signed priority, ...] of the outermost intervals, in the order
            they happened (see `_sweep`).
    """

    def __init__(self, clock: Clock, codes: PhaseCodes | None = None,
                 intervals: list[Any] | None = None, edges: list[Any] | None = None) -> None:  # fmt: skip
        self.clock = clock
        self.codes = codes if codes is not None else PhaseCodes()
        self._iv: list[Any] = intervals if intervals is not None else []
        self._edges: list[Any] = edges if edges is not None else []
        #: Host marks are the times themselves: always ready, subtracted directly.
        self._on_host = isinstance(clock, HostClock)
        #: Set by `PhaseTimer.take(step_start, step_end)` on the host: the totals, and the
        #: parts of that step (for those very arguments), computed while pairing.
        self._totals: dict[str, float] | None = None
        self._parts_for: tuple[Any, float] | None = None
        self._parts: dict[str, float] | None = None
        #: (boundaries, index of the first, step start, step end) not paired yet
        #: (`PhaseTimer.take_later`).
        self._later: tuple[list[Any], int, float, float] | None = None

    @classmethod
    def later(cls, clock: Clock, codes: PhaseCodes, log: list[Any], step_start: float,
              step_end: float, first: int = 0) -> PhaseWindow:  # fmt: skip
        """A window of host-clock boundaries (`log[first:]`: code, mark, ...) paired when
        first read, as `PhaseTimer.take(step_start, step_end)` pairs them, no phase being
        open before the first boundary."""
        window = cls(clock, codes)
        window._later = (log, first, step_start, step_end)
        return window

    def _pair_later(self) -> None:
        assert self._later is not None
        log, first, origin, end = self._later
        self._later = None
        n = first + ((len(log) - first) & ~1)
        resolved = _pair_resolved(self.codes, log, n, origin, end, first)
        if resolved is not None:
            self._iv, self._edges, self._totals, self._parts_for, self._parts = resolved
        else:
            self._iv, self._edges = _pair_open(self.codes, log[first:], [])

    @property
    def intervals(self) -> list[tuple[str, Any, Any, bool]]:
        """(phase, start mark, end mark, ran inside backward), in the order they ended."""
        if self._later is not None:
            self._pair_later()
        names, iv = self.codes.names, self._iv
        return [(names[iv[j]], iv[j + 1], iv[j + 2], iv[j + 3]) for j in range(0, len(iv), 4)]

    def ready(self) -> bool:
        if self._on_host:
            return True
        if self._later is not None:
            self._pair_later()
        ready, iv = self.clock.ready, self._iv
        return all(ready(iv[j]) for j in range(2, len(iv), 4))

    def totals(self) -> dict[str, float]:
        """Seconds per phase, plus `backward_inner` when backward ran."""
        if self._later is not None:
            self._pair_later()
        if self._totals is not None:
            return dict(self._totals)
        iv = self._iv
        seconds = None if self._on_host else self.clock.seconds
        sums = [0.0] * len(self.codes.names)
        seen = [False] * len(sums)
        reduce_in_backward = 0.0
        grad_reduce = self.codes.grad_reduce
        for j in range(0, len(iv), 4):
            i = iv[j]
            d = iv[j + 2] - iv[j + 1] if seconds is None else seconds(iv[j + 1], iv[j + 2])
            if d > 0.0:
                sums[i] += d
                if i == grad_reduce and iv[j + 3]:
                    reduce_in_backward += d
            seen[i] = True
        out = {name: sums[i] for i, name in enumerate(self.codes.names) if seen[i]}
        if "backward" in out:
            out["backward_inner"] = max(out["backward"] - reduce_in_backward, 0.0)
        return out

    def parts(self, step_start: Any, step_s: float) -> dict[str, float]:
        """The step's exclusive parts (`exclusive_parts`), `step_start` its clock mark."""
        if self._later is not None:
            self._pair_later()
        if self._parts is not None and self._parts_for == (step_start, step_s):
            return dict(self._parts)
        seconds = self.clock.seconds
        if self._on_host:
            out = _sweep(self._edges, step_s, None, float(step_start))
        else:
            out = _sweep(self._edges, step_s, lambda mark: seconds(step_start, mark))
        if out is None:  # marks out of order (another thread's boundaries): sort them
            return exclusive_parts(
                [(name, seconds(step_start, start), seconds(step_start, end))
                 for name, start, end, _ in self.intervals],
                step_s,
            )  # fmt: skip
        return _as_parts(out)

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

    A boundary is two appends to `log` (its code and its clock mark); the recorder's
    callbacks append to it directly (`push`, `codes`), `start` / `end` are the same by
    name. `take()` pairs the step's boundaries into intervals in one loop. The boundaries
    start at `log[base]`: a log that `take_later` puts in place starts with padding, the
    room made for the next step's boundaries (`room.with_room`).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._mark = clock.mark
        self._on_host = isinstance(clock, HostClock)
        self.codes = PhaseCodes()
        #: code, mark, code, mark, ... per boundary, in order (`take_later` hands this list
        #: over and puts a new one here; `take` and `reset` empty it).
        self.log: list[Any] = []
        #: Padding items at the start of `log`, before the boundaries.
        self.base = 0
        self.push = self.log.append
        self._spares = Spares()
        #: Start marks of the phases open at the end of the log, per phase index.
        self._open: list[list[Any]] = [[] for _ in self.codes.names]
        #: Whether any of them holds a start (read at every step's end and start instead of
        #: looking at each list: between the engine's kernels every list is a cache miss).
        self._any_open = False

    def start(self, phase: str, t: float) -> None:
        code = self.codes.start.get(phase)
        if code is None:
            code = 2 * self.codes.add(phase)
        self.push(code)
        self.push(self._mark(t))

    def end(self, phase: str, t: float) -> None:
        code = self.codes.end.get(phase)
        if code is None:
            code = 2 * self.codes.add(phase) + 1
        self.push(code)
        self.push(self._mark(t))

    def take(self, step_start: Any = None, step_end: Any = None) -> PhaseWindow:
        """The intervals logged since the last `take()`, paired.

        Args:
            step_start, step_end: the step's first and last clock marks. On the host clock
                the window then also carries its totals and the step's parts, computed in
                the pairing pass (`PhaseWindow.parts(step_start, max(step_end - step_start,
                0))` returns them); on CUDA they are resolved when the marks are ready.
        """
        # (Phases carried over from the last window take the long way.)
        log, base = self.log, self.base
        if self._on_host and step_start is not None and step_end is not None and not self._any_open:
            n = base + ((len(log) - base) & ~1)  # (whole boundaries: code, mark)
            resolved = _pair_resolved(self.codes, log, n, float(step_start), float(step_end),
                                      base)  # fmt: skip
            if resolved is not None:
                del log[base:n]
                window = PhaseWindow(self.clock, self.codes)
                (window._iv, window._edges, window._totals, window._parts_for,
                 window._parts) = resolved  # fmt: skip
                return window
        open_ = self._open
        while len(open_) < len(self.codes.names):  # names an adapter added since
            open_.append([])
        n = len(log)
        intervals, edges = _pair_open(self.codes, log[base:n], open_)
        self._any_open = any(open_)
        del log[base:n]
        return PhaseWindow(self.clock, self.codes, intervals, edges)

    def take_later(self, step_start: Any, step_end: Any) -> PhaseWindow:
        """`take(step_start, step_end)` with the pairing left to whoever first reads the
        window (the recorder's step assembly, on the shipper thread): the step's boundaries
        are taken out of the log now, a slice, and nothing else is done on the training
        thread at the step's end: the log list is handed over whole, and `log` is a new
        list after it, with room for as many boundaries as this step logged (`room`: the
        next step's appends reallocate nothing; `make_room` makes it ahead). Host clock only, and for a step that
        started with nothing open (the recorder resets the timer at each step's start); a
        phase still open at the step's end is not carried over (the next `reset` would
        forget it). Otherwise this is `take()`."""
        if not self._on_host or self._any_open:
            return self.take(step_start, step_end)
        # The log itself goes with the window and a new one takes its place: no copy. (A
        # slice would touch every mark's float to count a reference, and between the
        # engine's kernels each is a cache miss: 36 us a step on 48 layers.) Whoever
        # appends to the log directly reads `log` again after this (the recorder does).
        boundaries, first = self.log, self.base
        self.log, self.base = self._spares.take(len(boundaries) - first)
        self.push = self.log.append
        return PhaseWindow.later(self.clock, self.codes, boundaries, float(step_start),
                                 float(step_end), first)  # fmt: skip

    def make_room(self) -> None:
        """Make a log with room ready for a coming `take_later` (on the shipper thread:
        see `room.Spares`)."""
        self._spares.make()

    def reset(self) -> None:
        del self.log[self.base :]
        if self._any_open:
            for stack in self._open:
                stack.clear()
            self._any_open = False


def _pair_resolved(
    codes: PhaseCodes, log: list[Any], n: int, origin: float, end: float, first: int = 0
) -> tuple[list[Any], list[Any], dict[str, float], tuple[float, float], dict[str, float]] | None:
    """Pair the host-clock boundaries `log[first:n]` of one step (starting with no phase open)
    and, in the same pass, sum the phases and lay out the outermost intervals' edges; then
    cut the step into its exclusive parts (`_sweep`, the one cut of every path).

    Returns:
        (intervals, edges, totals, (origin, step_s), parts), or None when a phase is still
        open at the end or the marks do not run forward (`_pair_open` handles those).
    """
    priority = codes.priority
    n_phases = len(codes.names)
    depth = [0] * n_phases  # open starts per phase index
    outer = [0.0] * n_phases  # the outermost open start's mark
    sums = [0.0] * n_phases
    seen = [False] * n_phases
    backward, grad_reduce = codes.backward, codes.grad_reduce
    reduce_in_backward = 0.0
    intervals: list[Any] = []
    # The outermost intervals' edges, in the order they happened, for the cut (`_sweep`).
    edges: list[Any] = []
    it = iter(log[first:n])
    for code, mark in zip(it, it, strict=True):
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
            intervals += (i, start, mark, in_backward)
            seconds = mark - start
            if seconds > 0.0:
                sums[i] += seconds
                if in_backward and i == grad_reduce:
                    reduce_in_backward += seconds
            seen[i] = True
            p = priority[i]
            if p:
                edges += (mark, -p)
        else:
            depth[i] = d + 1
            if not d:
                outer[i] = mark
                p = priority[i]
                if p:
                    edges += (mark, p)
    if any(depth):  # still open: timed in the window where they end
        return None
    step_s = end - origin
    if step_s < 0.0:
        step_s = 0.0
    cut = _sweep(edges, step_s, None, origin)
    if cut is None:
        return None
    names = codes.names
    totals = {names[i]: sums[i] for i in range(n_phases) if seen[i]}
    if "backward" in totals:
        totals["backward_inner"] = max(totals["backward"] - reduce_in_backward, 0.0)
    return intervals, edges, totals, (origin, step_s), _as_parts(cut)


def _pair_open(
    codes: PhaseCodes, log: list[Any], open_: list[list[Any]]
) -> tuple[list[Any], list[Any]]:
    """Pair boundaries (code, mark, ...) into intervals, whatever clock, with the phases
    open before the first one in `open_` (start marks per phase index; updated: what is
    still open at the end stays there).

    Returns:
        (intervals, edges) as `PhaseWindow` takes them.
    """
    priority = codes.priority
    while len(open_) < len(codes.names):
        open_.append([])
    in_backward = open_[codes.backward]
    intervals: list[Any] = []
    edges: list[Any] = []
    start_edge = [-1] * len(open_)  # where each open outer start sits in edges
    # Phases still open from the last window enter at their outer start.
    for i, stack in enumerate(open_):
        if stack and priority[i]:
            start_edge[i] = len(edges)
            edges += (stack[0], priority[i])
    for j in range(0, len(log) - 1, 2):
        code = log[j]
        i = code >> 1
        stack = open_[i]
        if not code & 1:  # a start
            if not stack and priority[i]:
                start_edge[i] = len(edges)
                edges += (log[j + 1], priority[i])
            stack.append(log[j + 1])
        elif stack:  # (an end without a start, attached mid-phase: nothing to time)
            start = stack.pop()
            if not stack:  # (nested in the same phase: the outer interval counts)
                intervals += (i, start, log[j + 1], bool(in_backward))
                if priority[i]:
                    edges += (log[j + 1], -priority[i])
                    start_edge[i] = -1
    # Still open: timed in the window where they end, not here.
    for i, pos in enumerate(start_edge):
        if pos >= 0 and open_[i]:
            edges[pos + 1] = 0
    return intervals, edges


__all__ = ["TOP_LEVEL", "PhaseCodes", "PhaseTimer", "PhaseWindow", "exclusive_parts"]
