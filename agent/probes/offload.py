"""Host<->device copies per direction within a step: bytes, seconds, bandwidth.

On a GPU machine this is the PCIe figure of ZeRO-Offload: each copy's time is the pair of
CUDA events the engine recorded on the copy's stream around it, read when they have
completed (a step later, like the collectives'; `OffloadWindow.ready`). Host time there
would be the launch of a `non_blocking` copy, microseconds for megabytes. On CPU the copies
are memcpys between the engine's buffers, timed on the host, and the numbers are what they
are.
"""

from __future__ import annotations

import threading
from typing import Any

from zerowatch import events as ev


def direction_of(name: str) -> str | None:
    """ "d2h" / "h2d" from the engine's names ("d2h", "offload_d2h", ...); else None."""
    if name.endswith("d2h"):
        return "d2h"
    if name.endswith("h2d"):
        return "h2d"
    return None


class OffloadWindow:
    """One step's copies: host-timed totals, and the CUDA-timed copies' events."""

    __slots__ = ("pending", "totals")

    def __init__(self, totals: dict[str, list[float]], pending: list[tuple[str, Any]]) -> None:
        #: direction -> [bytes, host-timed seconds]
        self.totals = totals
        #: (direction, (start, end) CUDA events) per CUDA-timed copy, not read yet.
        self.pending = pending

    def ready(self) -> bool:
        """Whether every copy's end event has completed (its time can be read)."""
        return all(events[1].query() for _, events in self.pending)

    def stats(self) -> list[ev.OffloadStats]:
        """Bytes, seconds and bandwidth per direction (once `ready()`)."""
        for d, (start, end) in self.pending:
            self.totals[d][1] += max(float(start.elapsed_time(end)) / 1e3, 0.0)
        self.pending = []
        return [
            ev.OffloadStats(
                direction=d,  # type: ignore[arg-type]
                bytes=int(nbytes),
                seconds=secs,
                bandwidth_bytes_per_s=nbytes / secs if secs > 0 else 0.0,
            )
            for d, (nbytes, secs) in sorted(self.totals.items())
        ]


#: The window of a step without copies (most engines, most steps).
_NONE = OffloadWindow({}, [])


class OffloadProbe:
    """Sums copies per direction; `take()` hands over one step's window and spans."""

    def __init__(self, max_spans: int = 4096) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}
        self._pending: list[tuple[str, Any]] = []
        self._spans: list[tuple[str, int, float, float]] | None = None
        self._max_spans = max_spans

    def sample_next(self, on: bool) -> None:
        if not on and self._spans is None:  # (most steps: nothing to change, no lock)
            return
        with self._lock:
            self._spans = [] if on else None

    def record(self, direction: str, nbytes: int, start: float, end: float,
               cuda_events: Any = None) -> bool:  # fmt: skip
        """One copy: its time is `end - start` on the host, or on a GPU the time between
        its (start, end) CUDA events, read when the step's window is."""
        d = direction_of(direction)
        if d is None:
            return False
        with self._lock:
            tot = self._totals.get(d)
            if tot is None:
                tot = self._totals[d] = [0, 0.0]
            tot[0] += int(nbytes)
            if cuda_events is None:
                tot[1] += max(end - start, 0.0)
            else:
                self._pending.append((d, cuda_events))
            if self._spans is not None and len(self._spans) < self._max_spans:
                self._spans.append((d, int(nbytes), start, end))
        return True

    def take(self) -> tuple[OffloadWindow, list[tuple[str, int, float, float]] | None]:
        if not self._totals and not self._spans:  # no copies (most engines, most steps)
            self._spans = None
            return _NONE, None
        with self._lock:
            totals, self._totals = self._totals, {}
            pending, self._pending = self._pending, []
            spans, self._spans = self._spans, None
        return OffloadWindow(totals, pending), spans


__all__ = ["OffloadProbe", "OffloadWindow", "direction_of"]
