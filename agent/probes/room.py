"""Lists with room made for a step's appends, so that the training thread never grows one.

The probes' callbacks append to plain lists (the phase log, the collective records), and
at a step's end the recorder hands each list over whole and starts a new one. A new list
grows by reallocation, and a reallocation of 1 KiB or more is a "large" request to glibc's
malloc, which first consolidates the fast bins that the engine's C++ code has filled with
its freed small blocks: that cost lands on the training thread's callback that asked.

So a list starts with room (`with_room`: padding items, the data after them; whoever reads
the list starts at its padding's end), and since making one is itself a large request,
the next lists are made ahead on the shipper thread (`Spares`); the training thread takes
a ready one at the step's end (it makes its own only when none is ready: before the
shipper's first wake-up, or when more steps came between two wake-ups than lists were
kept)."""

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
    """`room` padding items in a list with storage for `room` more."""
    # Twice the room, cut back: CPython keeps the storage of a list cut to at least half of
    # it. bench/agent_overhead.py --no-server --stages 0,3 --repeats 4, the same run: with
    # these lists made ahead 1.55 us a callback at stage 3 / 48 layers and 2.52 at 4 layers,
    # with new empty lists 1.76 and 2.88.
    items: list[Any] = [None] * (2 * room)
    del items[room:]
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
