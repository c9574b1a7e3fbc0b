"""The probes' lists come with room for a step's appends: appending reallocates nothing, and
windows taken step after step from such lists read as a fresh probe's."""

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


def _step(timer: PhaseTimer, t0: float, n: int) -> None:
    for i in range(n):  # (steps of growing size: later ones outgrow the room made)
        timer.start("param_gather", t0 + 0.001 * i)
        timer.end("param_gather", t0 + 0.001 * i + 0.0005)


def test_steps_taken_one_after_another_read_as_each_alone() -> None:
    timer = PhaseTimer(HostClock())
    for n in (1, 200, 500, 3):
        t0 = 10.0 * n
        _step(timer, t0, n)
        alone = PhaseTimer(HostClock())
        _step(alone, t0, n)
        window, expected = timer.take(t0, t0 + 1.0), alone.take(t0, t0 + 1.0)
        timer.make_room()  # (the shipper, as it builds the step)
        assert window.intervals == expected.intervals
        assert window.totals() == expected.totals()
        assert window.parts() == expected.parts()


def record(latency: float) -> CollectiveRecord:
    return CollectiveRecord(op="all_gather", purpose="param_fetch", nbytes=1024, world_size=2,
                            start=0.0, end=latency, async_op=True, exposed_s=0.0)  # fmt: skip


def test_records_taken_one_step_after_another_fold_as_each_alone() -> None:
    agg = CollectiveAggregator()
    for n in (1, 300, 900, 2):
        alone = CollectiveAggregator()
        for a in (agg, alone):
            a.discard()
            for i in range(n):
                a.record(record(1e-3 * (i % 7 + 1)))
        window, expected = agg.take_later(), alone.take()
        agg.make_room()
        assert window.stats() == expected.stats()
        assert window.wall_s == expected.wall_s
