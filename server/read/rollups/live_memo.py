"""Rollups of dirty steps that readers computed, kept while the step's rows are unchanged.

A run page reads the rollups of the same newest steps several times (its charts, the run
resource, the doctor), and while a backlog lasts each of those reads would compute up to
`max_live_rank_steps` rank-steps again (seconds a page after a 1,024-rank recovery
storm). The memo is keyed by (run, step, (version, since) of the step's dirty mark): a
mark's version changes in the transaction that writes the step's rows, so an entry holds
at least the rows of its version, and a later rank makes a new key (reader.py).
"""

from __future__ import annotations

import threading
from typing import Any

#: (run, step, (version, since) of its dirty mark).
MemoKey = tuple[int, int, tuple[int, float]]


class LiveMemo:
    """Least recently used out first, at most `max_steps` steps; thread-safe."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self._lock = threading.Lock()
        self._memo: dict[MemoKey, Any] = {}
        self.hits = 0

    def get(self, key: MemoKey) -> Any:
        with self._lock:
            got = self._memo.pop(key, None)
            if got is not None:
                self._memo[key] = got  # most recently used last
                self.hits += 1
            return got

    def put(self, key: MemoKey, value: Any) -> None:
        with self._lock:
            self._memo.pop(key, None)
            self._memo[key] = value
            while len(self._memo) > self.max_steps:
                del self._memo[next(iter(self._memo))]


__all__ = ["LiveMemo", "MemoKey"]
