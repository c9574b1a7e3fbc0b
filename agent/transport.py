"""The shipper: a background thread that gets events to the server without ever holding up
training (knows nothing of torch).

    training thread --submit()--> bounded queue --> shipper thread
                                                     | encode, batch (<= batch_max_events,
                                                     |   <= flush_interval_s old)
                                                     |-- online:  gzip + POST (tenacity retries)
                                                     |-- offline: append to the on-disk spool,
                                                     |            probe the server with backoff,
                                                     |            replay the spool oldest first

`submit` is a `put_nowait`: when the queue is full (the shipper is far behind) the event is
dropped and counted, the training thread never waits. Once anything sits in the spool, new
events go behind it, so a rank's events reach the server in seq order; the server drops any
(run, rank, seq) it already holds, so an event sent twice (a response lost after the server
stored it) is stored once.

One rank creates the run (`creates_run`: rank 0, as soon as its shipper starts); the
others post to its id, and an answer that the run is not there yet (404) sends their events
to the spool and the shipper back to probing, quietly, until it is. A rank that has seen
its run missing for `join_timeout_s` (rank 0 gone, a server that lost its database)
creates it itself, so a job of 4,096 ranks makes one POST /runs at start, not 4,096.

A server that refuses the token (401/403) or the RunCreate gets nothing more from this
process: events go to the spool, for `zerowatch upload` with the right token.

A server that turns a request away with `Retry-After` (shedding a recovery storm with 503,
a database that is down or full with 503/507) is left alone at least that long: the
shipper spools, and probes again after the wait plus up to half of it (jitter), never
earlier. Segments an earlier process of this run left in the spool are replayed first.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerowatch.agent import codec
from zerowatch.agent.client import (
    IngestClient,
    PayloadTooLarge,
    RunNotFound,
    ServerRejected,
    ServerUnavailable,
    honoured_wait_s,
)
from zerowatch.agent.errors import AgentHealth, log
from zerowatch.agent.spool import Spool

from zerowatch import events as ev

#: Batches replayed from the spool before the shipper goes back to its queue.
_REPLAY_BATCHES_PER_TURN = 16


@dataclass
class TransportStats:
    """What the shipper did, for `Run.stats` and the benchmark."""

    submitted: int = 0
    sent: int = 0
    accepted: int = 0
    duplicates: int = 0
    spooled: int = 0
    #: Answers that said when to come back (Retry-After), and the seconds waited for them.
    told_to_wait: int = 0
    waited_s: float = 0.0
    queue_peak: int = 0
    online: bool = False


class Transport:
    """Ships one rank's events; `submit` from the training thread, the rest on its own thread."""

    def __init__(
        self,
        *,
        run_id: str,
        run_create: bytes,
        client: IngestClient | None,
        spool: Spool,
        health: AgentHealth,
        queue_size: int,
        batch_max_events: int,
        flush_interval_s: float,
        retry_max_wait_s: float,
        http_timeout_s: float,
        rank: int = 0,
        creates_run: bool = True,
        join_timeout_s: float = 60.0,
    ) -> None:
        self.run_id = run_id
        #: Whether this rank creates the run (rank 0), or joins the one another creates.
        self.creates_run = creates_run
        self._join_timeout = join_timeout_s
        #: time.monotonic() when a joiner was first told its run is missing; None: it is not.
        self._missing_since: float | None = None
        self._run_create = run_create
        self._client = client
        self.spool = spool
        self._health = health
        # A deque, not a queue.Queue: appending wakes nobody, so handing over an event costs
        # the training thread no thread switch; the shipper looks every flush interval.
        self._q: deque[Any] = deque()
        self._queue_size = queue_size
        self._batch_max = batch_max_events
        self._flush_interval = flush_interval_s
        self._max_wait = retry_max_wait_s
        self._http_timeout = http_timeout_s
        self._stop = threading.Event()
        self._deadline: float | None = None
        self._disabled: str | None = None if client is not None else "no server"
        self._run_created = False
        # Events an earlier process of this run left in the spool go first.
        self._offline = client is None or spool.pending
        self._next_probe = 0.0
        self._backoff = 0.0
        self.stats = TransportStats()
        self._on_wake: list[Callable[[], None]] = []
        #: The heartbeat's body builder and interval (`heartbeat`), and when it is next due.
        self._heartbeat: Callable[[], bytes] | None = None
        self._heartbeat_every = 0.0
        self._next_heartbeat = 0.0
        self._thread = threading.Thread(
            target=self._main, name=f"zerowatch-shipper-rank{rank}", daemon=True
        )
        spool.set_run(run_create)

    # -- training-thread side ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def every_wake(self, fn: Callable[[], None]) -> None:
        """Call `fn` on the shipper thread at each of its wake-ups (before it ships; an
        error is counted, never raised). Call before `start`."""
        self._on_wake.append(fn)

    def heartbeat(self, body: Callable[[], bytes], interval_s: float) -> None:
        """Send `body()` (a HeartbeatBatch) every `interval_s`, once, without retries or
        spool (the next one replaces a lost one). Call before `start`."""
        self._heartbeat, self._heartbeat_every = body, interval_s

    def submit(self, event: Any) -> None:
        """Hand one event (or a callable that builds it, called on the shipper thread) to
        the shipper; never blocks, never raises."""
        q = self._q
        if len(q) >= self._queue_size:
            self._health.drop(
                1,
                f"the agent's queue is full (queue_size={self._queue_size}); the shipper is behind",
            )
            return
        q.append(event)
        stats = self.stats
        stats.submitted += 1
        if len(q) > stats.queue_peak:
            stats.queue_peak = len(q)

    @property
    def queued(self) -> int:
        """Events handed over and not yet shipped or spooled."""
        return len(self._q)

    def close(self, end_event: ev.EndEvent | None, timeout_s: float) -> None:
        """Send `end_event` last, flush, and stop the shipper within about `timeout_s`."""
        self._deadline = time.monotonic() + timeout_s
        if self._client is not None:
            self._client.deadline = self._deadline
        if end_event is not None:
            self._q.append(end_event)  # past the bound if need be: it reports the drops
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + self._http_timeout + 1.0)
        if self._thread.is_alive():
            # Stuck beyond every bound (a request that ignores its timeout): spool what
            # is still queued from here, so it survives the process.
            self._health.warn_once(
                "shipper-stuck",
                "zerowatch agent: the shipper did not finish in time; spooling what is "
                "queued to %s",
                self.spool.run_dir,
            )
            lines = []
            while self._q:
                line = self._encode(self._q.popleft())
                if line is not None:
                    lines.append(line)
            self.stats.spooled += self.spool.append(lines, final=True)
        elif self.spool.pending:
            server = self._client.server if self._client is not None else "URL"
            log.warning(
                "zerowatch: events of run %s wait in %s; send them with "
                "`zerowatch upload %s --server %s`",
                self.run_id,
                self.spool.dir,
                self.spool.run_dir,
                server,
            )
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()

    # -- shipper thread ---------------------------------------------------------------

    def _network_ok(self) -> bool:
        if self._disabled is not None:
            return False
        return self._deadline is None or time.monotonic() < self._deadline

    def _main(self) -> None:
        try:
            self._loop()
        except Exception as e:  # the shipper must not die silently with events in hand
            self._health.error("the shipper thread", e)
            with contextlib.suppress(Exception):  # keep what is queued, as far as possible
                lines = [line for line in map(self._encode, list(self._q)) if line is not None]
                self._q.clear()
                self.stats.spooled += self.spool.append(lines, final=True)
        finally:
            self.stats.online = not self._offline
            self.spool.close()

    def _loop(self) -> None:
        # The first wake-up at a random point of the interval: ranks that started together
        # do not all post at the same instant, every interval (the server sees an even
        # stream of POSTs instead of world_size of them at once).
        wait = random.uniform(0.0, min(self._flush_interval, self._heartbeat_every or 1e9))
        if self.creates_run:
            self._create_now()
        while True:
            stopping = self._stop.is_set()
            if not stopping:
                stopping = self._stop.wait(wait)  # close() wakes it early
            wait = self._flush_interval
            if self._heartbeat is not None:
                wait = min(wait, self._heartbeat_every)
            for fn in self._on_wake:
                try:
                    fn()
                except Exception as e:
                    self._health.error("the shipper's housekeeping", e)
            self._drain_queue()
            # At close, one last (its flight recorder as the run ends: a collective that
            # failed stays launched in it).
            self._send_heartbeat(force=stopping)
            if self._offline and self.spool.pending:
                self._replay()
            if stopping and not self._q:
                self._drain_spool()
                return

    def _send_heartbeat(self, *, force: bool = False) -> None:
        """The rank's heartbeat, when due (or `force`) and the server is there (after the
        queue: the steps it names are sent first)."""
        now = time.monotonic()
        if self._heartbeat is None or (now < self._next_heartbeat and not force):
            return
        self._next_heartbeat = now + self._heartbeat_every
        if self._client is None or self._offline or not self._network_ok():
            return
        try:
            self._client.post_heartbeat(self.run_id, self._heartbeat())
        except (ServerUnavailable, ServerRejected):
            pass  # the next one goes out in an interval; events carry the rest
        except Exception as e:
            self._health.error("sending a heartbeat", e)

    def _drain_queue(self) -> None:
        """Ship everything queued, in batches of at most `batch_max_events`."""
        q = self._q
        while q:
            lines: list[bytes] = []
            while q and len(lines) < self._batch_max:
                item = q.popleft()
                if isinstance(item, ev.EndEvent):
                    # Everything before it is shipped or spooled first, so its counts are
                    # final; and the spool is replayed first if the server is back, which
                    # also frees the disk for the end event when the disk was full.
                    self._ship(lines)
                    lines = []
                    self._drain_spool()
                    item.dropped_events = self._health.dropped
                    item.agent_errors = self._health.errors
                    line = self._encode(item)
                    if line is not None:
                        self._ship([line], final=True)
                    continue
                line = self._encode(item)
                if line is not None:
                    lines.append(line)
            self._ship(lines)

    def _encode(self, event: Any) -> bytes | None:
        """One queued item as a JSON line: an event, or a callable that builds it (the
        recorder's steps, assembled here, off the training thread; None: it could not be,
        counted by the recorder)."""
        try:
            if callable(event):
                event = event()
                if event is None:
                    return None
            return codec.encode(event)
        except Exception as e:
            self._health.error("encoding an event", e)
            self._health.drop(1, "an event could not be encoded")
            return None

    def _ship(self, lines: list[bytes], *, final: bool = False) -> None:
        if not lines:
            return
        if self._offline or self.spool.pending or not self._network_ok():
            self.stats.spooled += self.spool.append(lines, final=final)
            self._replay()
            return
        try:
            self._send(lines, retry=self._deadline is None)
        except ServerUnavailable as e:
            self._go_offline(e)
            self.stats.spooled += self.spool.append(lines, final=final)

    def _create_now(self) -> None:
        """Create the run before the first flush (the joiners' events wait for it)."""
        if not self._network_ok() or self._offline:
            return
        try:
            self._ensure_run()
        except ServerUnavailable as e:
            self._go_offline(e)

    def _ensure_run(self) -> None:
        if self._run_created:
            return
        assert self._client is not None
        if not self.creates_run:
            missing = self._missing_since
            if missing is None or time.monotonic() - missing < self._join_timeout:
                return  # rank 0 creates it
            self._health.warn_once(
                "join-timeout",
                "zerowatch agent: run %s still missing on the server after %.0f s; "
                "this rank creates it",
                self.run_id,
                self._join_timeout,
            )
        try:
            self._client.create_run(self._run_create)
        except ServerRejected as e:
            self._disable(f"the server refused the run ({e})")
            raise ServerUnavailable(str(e)) from e
        self._run_created = True

    def _send(self, lines: list[bytes], *, retry: bool) -> None:
        """POST lines as one or more batches; raises ServerUnavailable to go offline."""
        assert self._client is not None
        self._ensure_run()
        try:
            res = self._client.post_events(
                self.run_id, codec.batch_body(self.run_id, lines), retry=retry
            )
        except RunNotFound:
            self._run_created = False  # the server lost it: create it again on the next try
            if self._missing_since is None:
                self._missing_since = time.monotonic()
            raise
        except PayloadTooLarge:
            if len(lines) == 1:
                self._health.drop(1, "an event is larger than the server's size limit (413)")
                return
            half = len(lines) // 2
            self._send(lines[:half], retry=retry)
            self._send(lines[half:], retry=retry)
            return
        except ServerRejected as e:
            if e.status in (401, 403):
                self._disable(f"the server refused the token ({e})")
                raise ServerUnavailable(str(e)) from e
            self._health.drop(len(lines), f"the server rejected a batch ({e})")
            return
        self._missing_since = None
        self.stats.sent += len(lines)
        self.stats.accepted += res.accepted
        self.stats.duplicates += res.duplicates

    def _disable(self, why: str) -> None:
        self._disabled = why
        self._health.warn_once(
            "disabled",
            "zerowatch agent: %s; events of run %s go to the spool %s for `zerowatch upload`",
            why,
            self.run_id,
            self.spool.run_dir,
        )

    def _go_offline(self, why: ServerUnavailable) -> None:
        joining = isinstance(why, RunNotFound) and not self.creates_run
        if not self._offline and not joining:  # (a joiner before rank 0's run: no news)
            self._health.warn_once(
                "offline",
                "zerowatch agent: server unavailable (%s); spooling events to %s and retrying "
                "in the background",
                why,
                self.spool.run_dir,
            )
        self._offline = True
        self._backoff = min(max(self._backoff * 2, 0.1), self._max_wait)
        # Full jitter: ranks that lost the server together do not come back in lockstep.
        wait = random.uniform(0.5, 1.0) * self._backoff
        if why.retry_after_s is not None:  # the server said when: never earlier
            wait = max(wait, honoured_wait_s(why.retry_after_s))
            self.stats.told_to_wait += 1
            self.stats.waited_s += wait
        self._next_probe = time.monotonic() + wait

    def _replay(self, *, max_batches: int = _REPLAY_BATCHES_PER_TURN) -> None:
        """Send the spool oldest first; stop at the first failure (and probe again later)."""
        if not self._network_ok() or time.monotonic() < self._next_probe:
            return
        for _ in range(max_batches):
            lines, offset = self.spool.read_batch(self._batch_max)
            if not lines:
                self._offline = False
                self._backoff = 0.0
                return
            try:
                self._send(lines, retry=False)
            except ServerUnavailable as e:
                self._go_offline(e)
                return
            self.spool.commit(offset)
        # More left: the loop calls again after it has looked at its queue.

    def _drain_spool(self) -> None:
        """At close: replay the spool while the server takes it and the deadline allows; a
        server still away gets one more try (with retries), not a wait."""
        while self.spool.pending and self._network_ok():
            before = self.stats.sent
            self._next_probe = 0.0
            self._replay()
            if self.stats.sent == before:
                return


__all__ = ["Transport", "TransportStats"]
