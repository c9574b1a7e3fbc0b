"""The probes' lists with room made ahead: a step's appends reallocate nothing, and the
windows taken from such lists read as from plain ones, step after step."""

from __future__ import annotations

import sys

from zerowatch.agent.probes import CollectiveAggregator, HostClock, PhaseTimer
from zerowatch.agent.probes.room import FIRST_ROOM, Spares, with_room

from zerowatch.engine.hooks import CollectiveRecord


def test_a_list_with_room_takes_that_many_appends_in_its_storage() -> None:
    items, room = with_room(1000)
    assert room >= 1000 and room % 2 == 0 and items == [None] * room
    size = sys.getsizeof(items)
    for i in range(room):
        items.append(i)
    assert sys.getsizeof(items) == size  # (no reallocation)
    assert items[room:] == list(range(room))


def test_spares_are_made_ahead_and_taken_until_a_step_outgrows_them() -> None:
    spares = Spares()
    items, room = spares.take(10)  # none ready: made on the spot
    assert room == FIRST_ROOM and len(items) == room
    spares.make()  # (the shipper) lists for steps like the last one taken
    ready, room = spares.take(10)
    assert room == FIRST_ROOM and ready is not items
    spares.make()
    big, room = spares.take(5000)  # the ready ones are too small for what comes now
    assert room >= 5000 and len(big) == room


def _step(timer: PhaseTimer, t0: float) -> None:
    for phase, a, b in (("forward", 0.0, 0.3), ("param_gather", 0.1, 0.2),
                        ("backward", 0.4, 0.8), ("grad_reduce", 0.5, 0.7)):  # fmt: skip
        timer.start(phase, t0 + a)
        if phase in ("forward", "backward"):
            continue
        timer.end(phase, t0 + b)
        timer.end("forward" if phase == "param_gather" else "backward", t0 + b + 0.1)


def test_steps_taken_later_from_padded_logs_read_as_taken_at_once() -> None:
    later, now = PhaseTimer(HostClock()), PhaseTimer(HostClock())
    for n in range(4):
        t0 = 10.0 * n
        for timer in (later, now):
            timer.reset()
            _step(timer, t0)
        if n == 1:
            later.make_room()  # (the shipper, after the first steps)
        window, expected = later.take_later(t0, t0 + 1.0), now.take(t0, t0 + 1.0)
        assert later.log[later.base :] == []
        assert window.intervals == expected.intervals
        assert window.totals() == expected.totals()
        assert window.parts(t0, 1.0) == expected.parts(t0, 1.0)


def record(latency: float) -> CollectiveRecord:
    return CollectiveRecord(op="all_gather", purpose="param_fetch", nbytes=1024, world_size=2,
                            start=0.0, end=latency, async_op=True, exposed_s=0.0)  # fmt: skip


def test_records_taken_later_from_padded_lists_fold_as_taken_at_once() -> None:
    later, now = CollectiveAggregator(), CollectiveAggregator()
    for n in range(4):
        for agg in (later, now):
            agg.discard()
            for i in range(300 * n + 1):  # (the third step outgrows the room made)
                agg.pending.append(record(1e-3 * (i % 7 + 1)))
        if n == 1:
            later.make_room()
        window, expected = later.take_later(), now.take()
        assert len(later.pending) == later._base
        assert window.stats() == expected.stats()
        assert window.wall_s == expected.wall_s


def test_records_piling_up_are_folded_when_the_shipper_looks() -> None:
    agg = CollectiveAggregator()
    for _ in range(3000):
        agg.pending.append(record(1e-3))  # as the recorder appends: nothing checked
    agg.fold_if_full()  # (the recorder's `tidy`, at the shipper's wake-up)
    assert len(agg.pending) - agg._base == 0
    (stats,) = agg.take_later().stats()
    assert stats.count == 3000
