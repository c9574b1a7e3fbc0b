"""Per-step aggregates of the engine's collectives, by (op, purpose).

Each call adds to a count, a byte total (nccl-tests "size"), a latency sum and maximum and
a fixed-bucket latency histogram (events.LATENCY_BUCKETS: 50 µs to 30 s, +Inf last), so a
step's record stays the same size however many collectives ran. Bandwidths follow
nccl-tests: algbw = bytes / time, busbw = algbw · factor(op, n) with (n−1)/n for
all-gather and reduce-scatter and 2(n−1)/n for all-reduce.

Exposed communication is the time the training thread was blocked on communication: the
whole latency of a synchronous call plus the time spent waiting on an async one (the engine
measures that in `wait()`); what overlap_comm hid is latency − exposed.

Async collectives may complete on another thread, hence the lock. On CUDA the record's
latency and its exposed time come from its CUDA events, read when they have completed (a
step later): the latency from the launch on the compute stream to the collective's
completion, the exposed time from the compute stream's events around its wait (how long
that stream stalled). Host time around a NCCL call measures only the launch.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any

from zerowatch.agent.probes.room import Spares, with_room

from zerowatch import events as ev

_N_BUCKETS = len(ev.LATENCY_BUCKETS) + 1
_PURPOSES = frozenset(ev.PURPOSES)
_OPS = frozenset(ev.COLLECTIVE_OPS)


class _Agg:
    __slots__ = ("async_count", "buckets", "count", "lat_max", "lat_sum", "nbytes", "purpose",
                 "world")  # fmt: skip

    def __init__(self, world: int, purpose: str = "other") -> None:
        self.purpose = purpose
        self.count = 0
        self.nbytes = 0
        self.lat_sum = 0.0
        self.lat_max = 0.0
        self.buckets = [0] * _N_BUCKETS
        self.async_count = 0
        self.world = world

    def add(self, nbytes: int, latency: float, async_op: bool) -> None:
        if latency < 0.0:
            latency = 0.0
        self.count += 1
        self.nbytes += nbytes
        self.lat_sum += latency
        if latency > self.lat_max:
            self.lat_max = latency
        self.buckets[bisect_left(ev.LATENCY_BUCKETS, latency)] += 1
        if async_op:
            self.async_count += 1


@dataclass
class CollectiveWindow:
    """One step's collectives; CUDA-timed calls are resolved when `ready()`."""

    aggs: dict[tuple[str, str], _Agg] = field(default_factory=dict)
    #: op -> purpose as reported -> its aggregate in `aggs` (a purpose outside the
    #: vocabulary maps to the op's "other"): two lookups per call, no key tuple built.
    by_op: dict[str, dict[str, _Agg]] = field(default_factory=dict)
    pending_cuda: list[Any] = field(default_factory=list)
    exposed_s: float = 0.0
    #: (start, end) host times of the calls timed on the host.
    intervals: list[tuple[float, float]] = field(default_factory=list)
    #: Wall time some collective was running (the union of their intervals, so concurrent
    #: calls count once); known after `stats()`.
    wall_s: float = 0.0
    #: (op, purpose, nbytes, async, start, end) per call, on sampled steps.
    spans: list[tuple[str, str, int, bool, float, float]] | None = None
    #: Records taken with the window and not folded yet (`CollectiveAggregator.take_later`),
    #: from `unfolded[unfolded_from]` on: `stats()` folds them, and `exposed_s`, `wall_s`
    #: and `spans` are complete after it.
    unfolded: list[Any] | None = None
    unfolded_from: int = 0
    max_spans: int = 4096
    #: Who counts the records of ops outside the vocabulary (folded later).
    owner: CollectiveAggregator | None = None

    def _fold_later(self) -> None:
        records, self.unfolded = self.unfolded, None
        unknown = _fold(self, records[self.unfolded_from :] if records else [], self.max_spans)
        if unknown and self.owner is not None:
            self.owner.unknown_ops += unknown

    def ready(self) -> bool:
        """Whether the CUDA events of the device-timed calls have completed (host-timed
        calls are known at once); nothing is folded here."""
        return all(
            rec.cuda_events is None
            or (rec.cuda_events[1].query()
                and (rec.cuda_exposed is None or rec.cuda_exposed[1].query()))
            for rec in chain(self.pending_cuda,
                             islice(self.unfolded or (), self.unfolded_from, None))
        )  # fmt: skip

    def stats(self) -> list[ev.CollectiveStats]:
        if self.unfolded is not None:
            self._fold_later()
        device: list[tuple[float, float]] = []
        ref: Any = self.pending_cuda[0].cuda_events[0] if self.pending_cuda else None
        for rec in self.pending_cuda:
            start, end = rec.cuda_events
            at = float(ref.elapsed_time(start)) / 1e3  # device time, from the first launch
            device.append((at, at + max(float(start.elapsed_time(end)) / 1e3, 0.0)))
            start, end = rec.cuda_events
            latency = max(float(start.elapsed_time(end)) / 1e3, 0.0)
            _add(self.aggs, rec.op, rec.purpose, rec.nbytes, rec.world_size, latency, rec.async_op)
            if rec.cuda_exposed is not None:
                before, after = rec.cuda_exposed
                self.exposed_s += max(float(before.elapsed_time(after)) / 1e3, 0.0)
        self.pending_cuda = []
        # Host-timed and device-timed calls are on two clocks: each clock's union, added.
        self.wall_s = _union(self.intervals) + _union(device)
        return [
            ev.CollectiveStats.of_calls(
                op, purpose, world_size=a.world, count=a.count, nbytes=a.nbytes,
                latency_sum_s=a.lat_sum, latency_max_s=a.lat_max, buckets=a.buckets,
                async_count=a.async_count,
            )
            for (op, purpose), a in sorted(self.aggs.items())
        ]  # fmt: skip


def _add(
    aggs: dict[tuple[str, str], _Agg],
    op: str,
    purpose: str,
    nbytes: int,
    world: int,
    latency: float,
    async_op: bool,
) -> None:
    key = (op, purpose)
    agg = aggs.get(key)
    if agg is None:
        agg = aggs[key] = _Agg(world, purpose)
    agg.add(nbytes, latency, async_op)


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= reach:
            continue
        total += b - (a if a > reach else reach)
        reach = b
    return total


#: Records wait in a list and are folded into the aggregates in one loop, when the step's
#: window is taken or once this many have arrived. Between the engine's kernels, which
#: evict the CPU's caches, appending a record costs a fraction of aggregating it there.
_FOLD_EVERY = 1024


class CollectiveAggregator:
    """Receives `CollectiveRecord`s (any thread); `take()` hands over one step's window.

    `record` is one append to a list (no lock: an append is atomic, and folding takes the
    records it copied out and no others). The bound on a long step is kept by the shipper
    thread (`fold_if_full` at each of its wake-ups), not checked per record. The records
    start at `pending[base]`, after the padding of a list with room (`room.py`).
    """

    def __init__(self, max_spans: int = 4096) -> None:
        self._lock = threading.Lock()
        self._window = CollectiveWindow()
        #: The records not folded yet, from `pending[base]` on: `record` appends, or the
        #: recorder's callback itself (another list after each `take_later`: read it again
        #: each time).
        self.pending, self._base = with_room(0)
        self._spares = Spares()
        self._max_spans = max_spans
        self.unknown_ops = 0

    def sample_next(self, on: bool) -> None:
        """Keep raw spans for the step now starting."""
        if not on and self._window.spans is None:  # (most steps: nothing to change, no lock)
            return
        with self._lock:
            self._window.spans = [] if on else None

    def record(self, rec: Any) -> None:
        """One collective (any thread)."""
        self.pending.append(rec)

    def fold_if_full(self) -> None:
        """Fold the pending records once `_FOLD_EVERY` wait: a long step stays bounded."""
        if len(self.pending) >= self._base + _FOLD_EVERY:
            with self._lock:
                self._fold()

    def take(self) -> CollectiveWindow:
        with self._lock:
            self._fold()
            window, self._window = self._window, CollectiveWindow()
        return window

    def take_later(self) -> CollectiveWindow:
        """`take()` with the records left to fold when the window's `stats()` is first
        read (the recorder's step assembly, on the shipper thread): at the step's end the
        training thread only takes the list of records out, whole, and a new list takes its
        place (a copy would touch every record to count a reference, a cache miss each
        between the engine's kernels); the new one has room for as many records
        (`room.py`). A record that another thread appends to the old list as it is taken
        goes with this window."""
        with self._lock:
            records, first = self.pending, self._base
            self.pending, self._base = self._spares.take(len(records) - first)
            window, self._window = self._window, CollectiveWindow()
        window.unfolded, window.unfolded_from = records, first
        window.max_spans = self._max_spans
        window.owner = self
        return window

    def make_room(self) -> None:
        """Make records lists with room ready for coming `take_later`s (on the shipper
        thread: `room.Spares`)."""
        self._spares.make()

    def discard(self) -> None:
        """Forget what arrived since the last window was taken (between two steps)."""
        if len(self.pending) == self._base and not self._window.by_op:  # (nothing did)
            return
        with self._lock:
            del self.pending[self._base :]
            if self._window.by_op:  # (a window nothing was folded into is as good as new)
                self._window = CollectiveWindow()

    def _fold(self) -> None:
        """Add the pending records to the current window (the lock held)."""
        pending, first = self.pending, self._base
        records = pending[first:]
        del pending[first : first + len(records)]  # (records appended meanwhile stay)
        self.unknown_ops += _fold(self._window, records, self._max_spans)


def _fold(w: CollectiveWindow, records: list[Any], max_spans: int) -> int:
    """Add `records` to the window's aggregates (one loop, no key tuple per call).

    Returns:
        How many records were of an op outside the vocabulary (not aggregated).
    """
    unknown = 0
    by_op, intervals, buckets_of = w.by_op, w.intervals, ev.LATENCY_BUCKETS
    spans = w.spans
    exposed_s = w.exposed_s
    for rec in records:
        try:
            agg = by_op[rec.op][rec.purpose]
        except KeyError:
            new = _agg_of(w, rec)
            if new is None:
                unknown += 1
                continue
            agg = new
        start, end = rec.start, rec.end
        if rec.cuda_events is not None:
            w.pending_cuda.append(rec)
        else:
            latency = end - start
            if latency < 0.0:
                latency = 0.0
            agg.count += 1
            agg.nbytes += int(rec.nbytes)
            agg.lat_sum += latency
            if latency > agg.lat_max:
                agg.lat_max = latency
            agg.buckets[bisect_left(buckets_of, latency)] += 1
            if rec.async_op:
                agg.async_count += 1
            intervals.append((start, end))
        # On CUDA the exposed time is the compute stream's stall, read with the events.
        if rec.cuda_exposed is None:
            exposed = rec.exposed_s
            if exposed > 0.0:
                exposed_s += float(exposed)
        if spans is not None and len(spans) < max_spans:
            spans.append((rec.op, agg.purpose, int(rec.nbytes), bool(rec.async_op),
                          start, end))  # fmt: skip
    w.exposed_s = exposed_s
    return unknown


def _agg_of(w: CollectiveWindow, rec: Any) -> _Agg | None:
    """The aggregate a record of a new (op, purpose) adds to, now in `w.by_op`; None for an
    op outside the vocabulary."""
    op, purpose = rec.op, rec.purpose
    if op not in _OPS:
        return None
    key = (op, purpose if purpose in _PURPOSES else "other")
    agg = w.aggs.get(key)
    if agg is None:
        agg = w.aggs[key] = _Agg(int(rec.world_size), key[1])
    w.by_op.setdefault(op, {})[purpose] = agg
    return agg


__all__ = ["CollectiveAggregator", "CollectiveWindow"]
