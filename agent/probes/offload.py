"""Host<->device copies per direction within a step: bytes, seconds, bandwidth.

On a GPU machine this is the PCIe figure of ZeRO-Offload; on CPU the copies are memcpys
between the engine's buffers and the numbers are what they are.
"""

from __future__ import annotations

import threading

from zerowatch import events as ev


def direction_of(name: str) -> str | None:
    """ "d2h" / "h2d" from the engine's names ("d2h", "offload_d2h", ...); else None."""
    if name.endswith("d2h"):
        return "d2h"
    if name.endswith("h2d"):
        return "h2d"
    return None


class OffloadProbe:
    """Sums copies per direction; `take()` hands over one step's stats and spans."""

    def __init__(self, max_spans: int = 4096) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}
        self._spans: list[tuple[str, int, float, float]] | None = None
        self._max_spans = max_spans

    def sample_next(self, on: bool) -> None:
        if not on and self._spans is None:  # (most steps: nothing to change, no lock)
            return
        with self._lock:
            self._spans = [] if on else None

    def record(self, direction: str, nbytes: int, start: float, end: float) -> bool:
        d = direction_of(direction)
        if d is None:
            return False
        with self._lock:
            tot = self._totals.get(d)
            if tot is None:
                tot = self._totals[d] = [0, 0.0]
            tot[0] += int(nbytes)
            tot[1] += max(end - start, 0.0)
            if self._spans is not None and len(self._spans) < self._max_spans:
                self._spans.append((d, int(nbytes), start, end))
        return True

    def take(self) -> tuple[list[ev.OffloadStats], list[tuple[str, int, float, float]] | None]:
        if not self._totals and not self._spans:  # no copies (most engines, most steps)
            self._spans = None
            return [], None
        with self._lock:
            totals, self._totals = self._totals, {}
            spans, self._spans = self._spans, None
        out = [
            ev.OffloadStats(
                direction=d,  # type: ignore[arg-type]
                bytes=int(nbytes),
                seconds=secs,
                bandwidth_bytes_per_s=nbytes / secs if secs > 0 else 0.0,
            )
            for d, (nbytes, secs) in sorted(totals.items())
        ]
        return out, spans


__all__ = ["OffloadProbe", "direction_of"]
