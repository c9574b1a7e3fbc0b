"""Admission control of ingest: shed what the server cannot take, before it is read.

A job of thousands of ranks whose server was away comes back all at once: every agent
creates its run again (idempotent) and replays its spool. Taking every request would queue
their batches (parsed, in memory) for the one writer thread without bound, and the event
loop would spend itself parsing bodies that wait minutes, while pages and /metrics wait
behind them; run creations, answered on the thread pool, would pile up there (an agent
whose request timed out asks again while its first request still waits for a thread: that
queue grew by megabytes a second in a 1,024-rank storm). So what agents POST (`/runs` and
`/runs/{id}/events`) is admitted up to a bound (at most `Settings.ingest_max_pending`
requests admitted and not yet answered, which bounds the writer's queue too; lower while
answers are slow, see `Admission`); one more is answered at once, before its body is read:

    503  {"detail": "the server is busy: ...; retry after S s"}   Retry-After: S

S spreads the crowd over the time the server needs to serve it. The server keeps a
"next free slot" in time: each request it sheds is told to come back at that slot, which
then moves on by the time one request takes (1 / the answers per second of the last
seconds). A thousand agents shed together are handed a thousand slots one after another,
so they return at about the rate the writer drains, instead of all at once again. The slot
falls back to "now" when the crowd is gone, and never runs further ahead than
`max_retry_after_s` (60). The agent waits at least S (with jitter).

What is shed first is not even admitted: a POST without the token (auth.authenticate, from
its headers) is answered 401/403 at once and holds no slot, so clients that trickle in the
bodies of unauthenticated POSTs cannot fill the bound and lock the agents out (the events
door, ingest_path.py, does the same before it admits).

Pure ASGI (no request object, no body read): shedding costs the server next to nothing.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from typing import Any

from fastapi import HTTPException
from zerowatch.server import errors
from zerowatch.server.auth import authenticate, request_headers

#: What agents POST: their RunCreate (every rank, idempotent) and their event batches.
_INGEST_PATH = re.compile(r"^/api/v1/runs(/[^/]+/events)?/?$")
#: Agents' other POSTs: authenticated from their headers too, not admitted (no slot).
_HEARTBEATS_PATH = re.compile(r"^/api/v1/runs/[^/]+/heartbeats/?$")
#: Answers per second assumed before any was measured.
_INITIAL_RATE = 20.0
#: Measurement window of the answer rate.
_RATE_WINDOW_S = 2.0
#: Admitted requests should be answered within this (well inside the agent's 5 s timeout):
#: slower answers lower the limit, fast ones raise it again.
TARGET_LATENCY_S = 1.0
#: The adaptive limit never goes below this (nor above `max_pending`, when that is lower).
_MIN_LIMIT = 4


class Admission:
    """The bound on ingest requests in hand, and the Retry-After of those shed.

    The bound adapts below `max_pending` (additive increase, multiplicative decrease on
    the answers' latency, as TCP does with its window): an answer slower than
    `TARGET_LATENCY_S` takes a tenth off the limit (at most once per target latency), a
    faster one adds one back. On a fast machine the limit sits at `max_pending`; on a
    slow or busy one it falls until requests in hand are answered in about a second, so an
    agent never times out waiting in a queue and sends its batch again.

    Thread-safe (the event loop admits; nothing else touches it, but tests may)."""

    def __init__(self, max_pending: int, *, max_retry_after_s: int = 60) -> None:
        if max_pending < 1:
            raise ValueError(f"ingest_max_pending: must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self.max_retry_after_s = max_retry_after_s
        #: The bound in force now (see the class docstring).
        self.limit = float(max_pending)
        self._last_decrease = 0.0
        self._lock = threading.Lock()
        self.pending = 0
        #: Requests admitted and shed since start (for tests, the benchmark and logs).
        self.admitted = 0
        self.shed = 0
        self._rate = _INITIAL_RATE
        self._window_start = time.monotonic()
        self._window_answers = 0
        self._next_slot = 0.0

    def try_admit(self) -> int | None:
        """Admit one request (None), or refuse it: the seconds it should wait."""
        now = time.monotonic()
        with self._lock:
            if self.pending < int(self.limit):
                self.pending += 1
                self.admitted += 1
                return None
            self.shed += 1
            slot = min(max(self._next_slot, now + 1.0), now + self.max_retry_after_s)
            self._next_slot = slot + 1.0 / self._rate
            return min(math.ceil(slot - now), self.max_retry_after_s)

    def release(self, latency_s: float = 0.0) -> None:
        """One admitted request was answered, `latency_s` after it was admitted."""
        now = time.monotonic()
        with self._lock:
            self.pending -= 1
            if latency_s > TARGET_LATENCY_S:
                if now - self._last_decrease >= TARGET_LATENCY_S:
                    floor = min(_MIN_LIMIT, self.max_pending)
                    self.limit = max(self.limit * 0.9, floor)
                    self._last_decrease = now
            elif self.limit < self.max_pending:
                self.limit = min(self.limit + 1.0, float(self.max_pending))
            self._window_answers += 1
            elapsed = now - self._window_start
            if elapsed >= _RATE_WINDOW_S:
                measured = self._window_answers / elapsed
                # Under load the window is full of answers; an idle window says nothing.
                if self.pending or measured > self._rate:
                    self._rate = max(0.5 * self._rate + 0.5 * measured, 1.0)
                self._window_start, self._window_answers = now, 0

    @property
    def rate(self) -> float:
        """Ingest answers per second, as last measured under load."""
        return self._rate


#: Set in the scope of a request already admitted in front of the middleware (by the events
#: door, server/ingest_path.py, which leaves to the app a URL the route would not match).
ADMITTED = "zerowatch.admitted"


class AdmissionMiddleware:
    """Sheds agents' POSTs past `Admission.max_pending` with 503 + Retry-After (see module).

    A POST without the token (`token`, checked by auth.authenticate on its headers) is
    answered 401/403 before it is admitted: it holds no slot while its body trickles in.
    Heartbeats are authenticated the same way (before their body is read), not admitted."""

    def __init__(self, app: Any, admission: Admission, token: str | None = None) -> None:
        self.app = app
        self.admission = admission
        self.token = token

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        ingest = bool(_INGEST_PATH.match(path))
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or not (ingest or _HEARTBEATS_PATH.match(path))
            or scope.get(ADMITTED)
        ):
            await self.app(scope, receive, send)
            return
        try:
            authenticate(self.token, request_headers(scope.get("headers", ())))
        except HTTPException as e:
            await errors.answer(e, scope["method"], scope["path"])(scope, receive, send)
            return
        if ingest:
            await admitted(self.admission, self.app, scope, receive, send)
        else:  # a heartbeat: authenticated before its body is read, held to no bound
            await self.app(scope, receive, send)


async def admitted(
    admission: Admission,
    app: Any,
    scope: Any,
    receive: Any,
    send: Any,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Run `app` on the request if `admission` takes it, else answer 503 + Retry-After
    (with `headers` besides its own)."""
    wait_s = admission.try_admit()
    if wait_s is not None:
        await _busy(send, wait_s, admission, headers)
        return
    start = time.monotonic()
    try:
        await app(scope, receive, send)
    finally:
        admission.release(time.monotonic() - start)


async def _busy(
    send: Any, wait_s: int, admission: Admission, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    body = json.dumps(
        {
            "detail": f"the server is busy: {admission.pending} ingest requests in hand "
            f"(limit {int(admission.limit)} of ingest_max_pending {admission.max_pending}); "
            f"retry after {wait_s} s"
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # The connection stays open: the server discards the unread body, and a
                # crowd that reconnected for every retry would cost more than its requests.
                (b"retry-after", str(wait_s).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


__all__ = ["ADMITTED", "Admission", "AdmissionMiddleware", "admitted"]
