"""The probes only log what the engine reports during a step and resolve it when the step's
window is taken: the result is what resolving each report on arrival gave."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from zerowatch.agent import codec
from zerowatch.agent.probes import CollectiveAggregator, HostClock, PhaseTimer
from zerowatch.agent.probes import collectives as collectives_probe

from zerowatch import events as ev
from zerowatch.engine.hooks import CollectiveRecord, ObserverRegistry


def record(op: str = "all_gather", purpose: str = "param_fetch", latency: float = 1e-3,
           exposed: float = 5e-4, nbytes: int = 1024) -> CollectiveRecord:  # fmt: skip
    return CollectiveRecord(op=op, purpose=purpose, nbytes=nbytes, world_size=2, start=0.0,
                            end=latency, async_op=True, exposed_s=exposed)  # fmt: skip


def test_phase_boundaries_pair_into_intervals_when_read() -> None:
    timer = PhaseTimer(HostClock())
    timer.end("forward", 0.5)  # attached mid-phase: an end without a start is not timed
    timer.start("backward", 1.0)
    timer.start("grad_reduce", 1.2)
    timer.start("grad_reduce", 1.3)  # nested in itself: the outer interval counts
    timer.end("grad_reduce", 1.4)
    timer.end("grad_reduce", 1.5)
    timer.end("backward", 2.0)
    timer.start("grad_reduce", 2.0)  # after backward: not inside it
    timer.end("grad_reduce", 2.25)
    timer.start("optimizer_step", 3.0)  # open at the step's end: not timed
    window = timer.take(0.0, 4.0)
    assert window.intervals == [
        ("grad_reduce", 1.2, 1.5, True),
        ("backward", 1.0, 2.0, False),
        ("grad_reduce", 2.0, 2.25, False),
    ]
    totals = window.totals()
    assert totals["backward_inner"] == pytest.approx(0.7)
    assert "optimizer_step" not in totals
    timer.start("forward", 4.0)
    timer.reset()  # between steps: what was logged is forgotten
    timer.end("forward", 4.5)
    assert timer.take(4.0, 5.0).intervals == []


def test_collectives_fold_into_aggregates_when_taken() -> None:
    agg = CollectiveAggregator()
    agg.sample_next(True)
    agg.record(record(latency=1e-3, exposed=5e-4))
    agg.record(record(latency=3e-3, exposed=0.0))
    agg.record(record(op="all_reduce", purpose="mystery", latency=2e-3, exposed=2e-3))
    agg.record(record(op="send"))  # not a collective op: counted, not aggregated
    window = agg.take()
    assert agg.unknown_ops == 1
    stats = {(s.op, s.purpose): s for s in window.stats()}
    assert set(stats) == {("all_gather", "param_fetch"), ("all_reduce", "other")}
    gather = stats[("all_gather", "param_fetch")]
    assert gather.count == 2 and gather.bytes == 2048 and gather.async_count == 2
    assert gather.latency_sum_s == pytest.approx(4e-3) and gather.latency_max_s == 3e-3
    assert sum(gather.buckets) == 2
    assert gather.buckets[ev.bucket_index(1e-3)] == 1
    assert gather.buckets[ev.bucket_index(3e-3)] == 1
    assert window.exposed_s == pytest.approx(2.5e-3)
    assert window.spans is not None and len(window.spans) == 3
    assert agg.take().stats() == []  # the next window starts empty


def test_a_long_step_folds_its_collectives_as_they_pile_up() -> None:
    agg = CollectiveAggregator(max_spans=4)
    agg.sample_next(True)
    n = collectives_probe._FOLD_EVERY * 2 + 3
    for i in range(n):
        agg.record(record())
        if i % 100 == 0:
            agg.fold_if_full()  # (the recorder's `tidy`, at each of the shipper's wake-ups)
    # Bounded while the step runs: what waits unfolded is at most a fold's worth and the
    # records between two wake-ups.
    window = agg.take_later()
    assert len(window.unfolded or ()) - window.unfolded_from < collectives_probe._FOLD_EVERY + 100
    (stats,) = window.stats()
    assert stats.count == n and sum(stats.buckets) == n
    assert window.spans is not None and len(window.spans) == 4  # spans stay capped


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def on_phase_start(self, phase: str, t: float) -> None:
        self.seen.append((phase, t))

    def on_phase_end(self, phase: str, t: float) -> None:
        raise RuntimeError("observer bug")


def test_registry_calls_methods_bound_at_add_and_swallows_errors() -> None:
    registry = ObserverRegistry()
    first, second = Observer(), Observer()
    registry.add(first)
    registry.add(second)
    registry.add(object())  # no observer methods at all: skipped
    registry.call("on_phase_start", "forward", 1.0)
    registry.call("on_phase_end", "forward", 2.0)  # raises in both: counted, not raised
    registry.call("on_collective", record())  # nobody has it
    registry.remove(first)
    registry.call("on_phase_start", "backward", 3.0)
    assert first.seen == [("forward", 1.0)]
    assert second.seen == [("forward", 1.0), ("backward", 3.0)]
    assert registry.errors == 2


def test_one_pass_encoding_gives_the_same_values() -> None:
    event = ev.StepEvent(
        rank=0, seq=3, step=3, time=1.5, step_time_s=0.25, phases={"forward": 0.1},
        collectives=[], exposed_comm_s=0.0,
        spans=[ev.Span(name="step", cat="phase", start=1.0, end=1.25, args={"bytes": 4})],
    )  # fmt: skip
    assert json.loads(codec.encode(event)) == json.loads(codec.dumps(codec.to_dict(event)))
    assert json.loads(codec.encode(event))["spans"][0]["args"] == {"bytes": 4}
    assert b" " not in codec.encode(event)  # compact
    # Numbers a probe may hand over as numpy's (or another float subclass) are written too.
    odd = dataclasses.replace(event, step_time_s=np.float64(0.25), samples=np.int64(8))
    assert json.loads(codec.encode(odd)) == json.loads(codec.encode(event)) | {"samples": 8}


def test_collectives_taken_for_later_fold_into_the_same_window() -> None:
    """The recorder takes a step's records out at its end and folds them when the step's
    event is built (on the shipper thread): the same statistics, the same spans."""
    records = [record(latency=1e-3, exposed=5e-4), record(latency=3e-3, exposed=0.0),
               record(op="all_reduce", purpose="mystery", latency=2e-3, exposed=2e-3),
               record(op="send")]  # fmt: skip
    now, later = CollectiveAggregator(), CollectiveAggregator()
    for agg in (now, later):
        agg.sample_next(True)
        for rec in records:
            agg.record(rec)
    window_now = now.take()
    window_later = later.take_later()
    later.record(record())  # the next step's record stays out of the window taken
    assert window_later.stats() == window_now.stats()
    assert later.unknown_ops == now.unknown_ops == 1
    assert window_later.exposed_s == window_now.exposed_s
    assert window_later.spans == window_now.spans
    assert window_later.wall_s == window_now.wall_s
    assert [s.count for s in later.take().stats()] == [1]
