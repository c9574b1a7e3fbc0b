"""Reads first: the ingest writer and the roll-up worker step aside while a page or a read runs.

One server process runs its event loop, the ingest writer thread, the roll-up worker
thread and the reads (pages, the API, /metrics: FastAPI's thread pool) under one GIL. In a
recovery storm the writer and the roll-up worker have work for minutes, and a run page that
needs half a second of CPU got a third of it and took tens of seconds (bench/faults.py:
p95 39–48 s at 1,024 and 4,096 ranks). A person looking at the page, or Prometheus
scraping, should not wait behind a backlog that nobody is waiting for.

`ReadGate` counts the reads in flight (`ReadGateMiddleware`: every GET and HEAD). The
writer, before it takes its next group, and the roll-up worker, before each chunk of steps,
call `yield_to_reads()`: while reads are in flight it waits until they are done, for at
most `max_wait_s` (`ReadTuning.gate_max_wait_s`, 50 ms) at a time, so ingest slows down under a stream of reads but
never stops. What the writer does not take meanwhile waits in its queue (bounded by
admission.py, which sheds the excess with Retry-After) and joins a larger group.

A read request also sees one view of each step that is still being rolled up
(`request_view`): a run page reads the newest steps' rollups several times (its charts, its
memory and outlier panels, the doctor), and during a backlog every write bumps those steps'
marks, so without a view each read would compute the same steps from their rows again (up
to `ReadTuning.max_live_rank_steps` each, many seconds a page in a 1,024-rank storm). Within
one request a dirty step is computed once, as of the first read that needs it, and every
later read of the request uses that: one page, one consistent picture.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import Any

_READS = frozenset({"GET", "HEAD"})


class ReadGate:
    """Reads in flight, and a wait for them to be done (thread-safe)."""

    def __init__(self, *, max_wait_s: float) -> None:
        """`max_wait_s`: the longest a writer waits per unit of work (the app passes
        `Settings.read.gate_max_wait_s`)."""
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._reads = 0
        #: Waits that found reads in flight (tests, the benchmark).
        self.yielded = 0

    @property
    def reads(self) -> int:
        return self._reads

    def enter(self) -> None:
        with self._cond:
            self._reads += 1

    def leave(self) -> None:
        with self._cond:
            self._reads -= 1
            if self._reads == 0:
                self._cond.notify_all()

    def yield_to_reads(self) -> None:
        """Wait while reads are in flight, at most `max_wait_s`."""
        if not self._reads:  # the usual case: no lock taken
            return
        with self._cond:
            if self._reads:
                self.yielded += 1
                self._cond.wait_for(lambda: self._reads == 0, timeout=self.max_wait_s)


#: The dirty steps' rollups the current read request has computed: {(run, step): rollups}.
_VIEW: ContextVar[dict[tuple[int, int], Any] | None] = ContextVar("zerowatch_view", default=None)


def request_view() -> dict[tuple[int, int], Any] | None:
    """The current read request's rollups of dirty steps (read/rollups/reader.py fills it), or None
    outside a request (the roll-up worker, tests calling the reads directly)."""
    return _VIEW.get()


class ReadGateMiddleware:
    """ASGI middleware: every GET and HEAD request counts as a read while it runs."""

    def __init__(self, app: Any, *, gate: ReadGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in _READS:
            await self.app(scope, receive, send)
            return
        self.gate.enter()
        # Set in this request's task: the thread pool runs a handler in a copy of this
        # context, which holds the same dict.
        view = _VIEW.set({})
        try:
            await self.app(scope, receive, send)
        finally:
            _VIEW.reset(view)
            self.gate.leave()


__all__ = ["ReadGate", "ReadGateMiddleware", "request_view"]
