"""The run page's doctor findings, kept while the run is unchanged.

The doctor costs a few hundred ms on a long run, a third of the run page, and its
findings follow from the stored steps: a reload while no step arrived may reuse them. The
memo belongs to the database's read caches (rollups/caches.py), so it is keyed by the
database by construction, and by the run's version: its id, newest step and newest event
time, and the reader's arguments. An entry is reused for at most `findings_ttl_s`, which
bounds how long a late rank's change (it moves no newest step) can go unseen; at most
`findings_runs` entries are kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any


class FindingsMemo:
    """Least recently stored out first; thread-safe."""

    def __init__(self, *, max_runs: int, ttl_s: float) -> None:
        self.max_runs = max_runs
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._memo: dict[Hashable, tuple[float, Any]] = {}

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The findings stored under `key` (the run's version) if younger than `ttl_s`,
        else `compute()`'s, stored."""
        now = time.monotonic()
        with self._lock:
            hit = self._memo.get(key)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        found = compute()
        with self._lock:
            self._memo.pop(key, None)
            self._memo[key] = (now, found)
            while len(self._memo) > self.max_runs:
                del self._memo[next(iter(self._memo))]
        return found


__all__ = ["FindingsMemo"]
