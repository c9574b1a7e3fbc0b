"""A list with room for a step's appends, so that the training thread never grows one."""

from __future__ import annotations

from typing import Any


def with_room(used: int) -> tuple[list[Any], int]:
    """A list to append a step's items to, with room for as many as the last step appended
    (`used`), and a quarter more; its first items are padding.

    Returns:
        (the list, its padding: how many items come before the data; even).
    """
    room = max(used + (used >> 2) + 16, 64) & ~1
    # Twice the room, cut back: CPython keeps the storage of a list cut to at least half of
    # it, so `room` appends reallocate nothing (a reallocation of 1 KiB or more makes glibc
    # consolidate the engine's freed blocks, on the training thread).
    items: list[Any] = [None] * (2 * room)
    del items[room:]
    return items, room


__all__ = ["with_room"]
