"""The collective flight recorder: per process group, a ring of the last collectives.

Every collective the engine issues is announced before it can block
(`on_collective_launch(group, seq, op, numel, dtype, t)`, engine/comm.py) and reported when
it completes (`CollectiveRecord` with the same group and seq). The recorder keeps, per group,
the numbers of the last collective launched and the last completed, and the last `size`
calls in a ring (seq, op, element count, dtype, launched at). The shipper
thread reads it for the rank's heartbeat (`snapshot`): a rank whose training thread is stuck
in a collective shows it launched and not completed; a rank stuck elsewhere shows the
group's last launch behind the others'; two ranks at one seq in different ops or sizes are
out of step (a desync).

Cost on the training thread: a launch is a dict lookup and one slot written in place (a
list of five items made when the ring was: no allocation); a completion is a lookup and
one store, the group's completed number. A group's collectives complete in the order they
were issued (one stream, one queue per group), so a call is completed when its seq is at
most that number. The ring is read without a lock: a snapshot taken while a slot is
rewritten sees one call or the next, and says which by its seq.
"""

from __future__ import annotations

from typing import Any

#: Calls kept per group (a power of two: the slot is seq & (size - 1)).
RING_SIZE = 64
#: The newest calls of each group that a heartbeat carries.
HEARTBEAT_CALLS = 8


class _Ring:
    __slots__ = ("completed", "launched", "mask", "slots")

    def __init__(self, size: int) -> None:
        self.launched = 0
        self.completed = 0
        self.mask = size - 1
        #: [seq, op, numel, dtype, launched at]
        self.slots: list[list[Any]] = [[0, "", 0, None, 0.0] for _ in range(size)]


class FlightRecorder:
    """The last collectives of each process group this rank issued (see the module
    docstring). `on_collective_launch` and `on_collective` are called on the thread that
    issues or completes the collective; `snapshot` on any other."""

    def __init__(self, size: int = RING_SIZE) -> None:
        if size < 1 or size & (size - 1):
            raise ValueError(f"size: expected a power of two >= 1, got {size!r}")
        self._size = size
        #: Group name -> its ring (the recorder's collective callback reads it directly).
        self.rings: dict[str, _Ring] = {}

    def on_collective_launch(self, group: str, seq: int, op: str, numel: int, dtype: Any,
                             t: float) -> None:  # fmt: skip
        ring = self.rings.get(group)
        if ring is None:
            ring = self.rings[group] = _Ring(self._size)
        slot = ring.slots[seq & ring.mask]
        slot[0], slot[1], slot[2], slot[3], slot[4] = seq, op, numel, dtype, t
        ring.launched = seq

    def on_collective(self, record: Any) -> None:
        ring = self.rings.get(record.group)
        if ring is not None and record.seq > ring.completed:
            ring.completed = record.seq

    def snapshot(self, to_unix: float, calls: int = HEARTBEAT_CALLS) -> dict[str, Any]:
        """{group: {"launched", "completed", "calls": [[seq, op, numel, dtype, state,
        launched at, None], ...]}}: the newest `calls` calls of each group, oldest first,
        times as unix seconds (`to_unix` added to the perf_counter readings), state
        "launched" or "completed" (the completion's time is not kept: None)."""
        out: dict[str, Any] = {}
        for name, ring in list(self.rings.items()):
            launched, completed = ring.launched, ring.completed
            rows = []
            for seq in range(max(launched - min(calls, self._size) + 1, 1), launched + 1):
                slot = list(ring.slots[seq & ring.mask])
                if slot[0] != seq:
                    continue
                rows.append([seq, slot[1], int(slot[2]), _dtype(slot[3]),
                             "completed" if seq <= completed else "launched",
                             round(slot[4] + to_unix, 6), None])  # fmt: skip
            out[name] = {"launched": launched, "completed": completed, "calls": rows}
        return out


def _dtype(dtype: Any) -> str:
    """torch.float32 -> "float32" (any other object as its str)."""
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


__all__ = ["HEARTBEAT_CALLS", "RING_SIZE", "FlightRecorder"]
