"""Lists with room made for a step's appends, so that the training thread never grows one.

The probes' callbacks append to plain lists (the phase log, the collective records), and
at a step's end the recorder hands each list over whole and starts a new one. A new list
grows by reallocation: ~13 reallocations on the way to a 48-layer stage-3 step's ~620 log
items, and every one of 1 KiB or more is a "large" request to glibc's malloc, which first
consolidates the fast bins that the engine's C++ code has filled with its freed small
blocks since the last such request. That cost lands on whichever call asks first: inside
bench/agent_overhead.py, the collective record that took the records' list from 148 to
172 items cost 30-90 us in seven steps of ten (5 us in the others, the do-nothing
observer 3), and the grad_reduce boundaries, when the log grew, 4.5 us on average
against a median of 2.6.

Python cannot make an empty list with room (emptying a list frees its storage, and one
that shrinks below half its room is shrunk), so a list with room starts with padding: it
is made twice the room long, then cut to the room, which keeps the storage (a list
shrinks only below half of it). The items after the padding are the data; whoever reads
the list starts at its padding's end.

Making such a list is itself a large request (the same consolidation, ~20 us a list at
the step's end), so the next lists are made ahead on the shipper thread (`Spares`), and
the training thread takes a ready one at the step's end (it makes its own only when none
is ready: before the shipper's first wake-up, or when more steps came between two
wake-ups than lists were kept).
"""

from __future__ import annotations

from collections import deque
from typing import Any

#: Room made for a first step, before any step's size is known.
FIRST_ROOM = 256


def with_room(used: int) -> tuple[list[Any], int]:
    """A list to append to, with room for a step like the last one, which appended `used`
    items (and a quarter more).

    Returns:
        (the list, its padding: the number of items before the data), the padding even.
    """
    room = room_for(used)
    return _padded(room), room


def room_for(used: int) -> int:
    """The room made for a step like one that appended `used` items (even)."""
    return max(used + (used >> 2) + 16, FIRST_ROOM) & ~1


def _padded(room: int) -> list[Any]:
    items: list[Any] = [None] * (2 * room)
    del items[room:]  # (half the storage in use: not shrunk)
    return items


#: Ready lists a `Spares` keeps at most, and the bytes they may hold in all.
_KEEP = 64
_KEEP_BYTES = 1 << 21


class Spares:
    """Lists with room (`with_room`), made on one thread and taken on another.

    `take` (the training thread, at a step's end) pops a ready list, or makes one when
    none is; `make` (the shipper, at each step it assembles) makes lists with room for a
    step like the last one taken until `_KEEP` are ready (at most `_KEEP_BYTES` of them).
    A deque's append and pop are atomic: no lock.
    """

    def __init__(self) -> None:
        self._ready: deque[tuple[list[Any], int]] = deque()
        #: Items the last step appended (what the next list is made for).
        self._used = 0

    def take(self, used: int) -> tuple[list[Any], int]:
        """A list for the next step, the step that ends now having appended `used` items.

        Returns:
            (the list, its padding), as `with_room`.
        """
        self._used = used
        try:
            items, room = self._ready.pop()
        except IndexError:
            return with_room(used)
        if room < used:  # (made for smaller steps: the steps grew)
            self._ready.clear()
            return with_room(used)
        return items, room

    def make(self) -> None:
        """Make lists ready until enough are (the shipper wakes once a flush interval, and
        the steps of one interval each take one)."""
        room = room_for(self._used)
        keep = min(_KEEP, _KEEP_BYTES // (16 * room))
        ready = self._ready
        while len(ready) < keep:
            ready.append((_padded(room), room))


__all__ = ["FIRST_ROOM", "Spares", "room_for", "with_room"]
