"""Group commit: concurrent ingest requests share one transaction.

A 1,000-rank job sends hundreds of small batches a second (an agent of a job that size
flushes every four seconds, so a batch is a few steps of one rank). One transaction per batch would
spend most of the server's time beginning and committing, and one thread hop per request
most of the rest. Instead, requests hand their batch to the `Ingestor` and wait: the
request handlers on the event loop await a future (`submit_async`), other callers block
(`submit`). One writer thread takes every batch waiting (up to `max_group`), writes them all
in one transaction, commits, answers their owners (the event loop's futures with a single
wake-up per group), and repeats while more are waiting. Nobody is answered before their
batch is committed, so an answer still means "stored".

The group is written with one multi-row statement per table (store.ingest_many), so fifty
one-event batches cost about what one fifty-event batch does. A group is worth waiting for:
every commit writes the pages it touched, whatever it holds (on SQLite one POST of 16 events
in a transaction of its own cost three times what it does in a group of 16 POSTs), so the
writer lingers up to `linger_s` (20 ms) for more batches once one is waiting, unless
`linger_events` already are. Each batch stays atomic on its own: it is validated before anything of it is written, so a bad batch is refused alone; if
the group's transaction fails for another reason, it is rolled back and every batch of the
group is retried in a transaction of its own, so one batch's failure never loses another's
events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read_gate import ReadGate

from zerowatch import events as ev

log = logging.getLogger(__name__)


@dataclass
class _Job:
    run_id: str
    batch: ev.EventBatch
    #: Set for a blocking caller; an async caller gets `future` resolved on its loop.
    done: threading.Event | None = None
    future: asyncio.Future[store.IngestResult | None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    result: store.IngestResult | None = None
    error: BaseException | None = None


@dataclass
class _Queue:
    jobs: list[_Job] = field(default_factory=list)
    #: Events in `jobs` (kept as they come and go, not summed per look).
    events: int = 0
    closed: bool = False


class Ingestor:
    """Writes event batches with group commit (see the module docstring)."""

    def __init__(
        self,
        db: Database,
        *,
        trace_sample_every: int = 1,
        max_group: int = 256,
        max_group_events: int = 20_000,
        linger_s: float = 0.02,
        linger_events: int = 1024,
        gate: ReadGate | None = None,
    ) -> None:
        self.db = db
        #: Reads in flight that the writer steps aside for (read_gate.py); None: never.
        self.gate = gate
        #: The fresh-steps cache the writer hands committed rank-steps to (the database's).
        self.fresh = db.caches.fresh
        self.trace_sample_every = trace_sample_every
        self.max_group = max_group
        self.max_group_events = max_group_events
        self.linger_s = linger_s
        self.linger_events = linger_events
        self._cond = threading.Condition()
        self._queue = _Queue()
        self._writer: threading.Thread | None = None
        #: Groups written and batches in them (for tests and the benchmark).
        self.groups = 0
        self.batches = 0

    def submit(self, *, run_id: str, batch: ev.EventBatch) -> store.IngestResult | None:
        """Store `batch` (blocks until committed). None when the run does not exist.

        Raises:
            store.BatchError: the batch is inconsistent with the run (nothing stored).
        """
        job = _Job(run_id, batch, done=threading.Event())
        self._enqueue(job)
        assert job.done is not None
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    async def submit_async(self, *, run_id: str, batch: ev.EventBatch) -> store.IngestResult | None:
        """`submit` for a coroutine: awaits the commit without holding a thread."""
        loop = asyncio.get_running_loop()
        job = _Job(run_id, batch, future=loop.create_future(), loop=loop)
        self._enqueue(job)
        assert job.future is not None
        return await job.future

    def close(self) -> None:
        """Write what is queued, then stop the writer thread (a later batch starts it again)."""
        with self._cond:
            self._queue.closed = True
            self._cond.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join()
        with self._cond:
            self._queue.closed = False

    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            queue = self._queue
            queue.jobs.append(job)
            queue.events += len(job.batch.events)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name="zerowatch-ingest", daemon=True
                )
                self._writer.start()
            # Wake the writer only when it has something new to decide: the first batch
            # of a group, or enough events to stop lingering. A writer lingering for more
            # wakes at its deadline anyway; waking it for every request (hundreds a
            # second) costs a thread switch and a GIL hand-over each (a sixth of the event
            # loop's wall-clock samples at 2,048 ranks; its CPU time did not change).
            if len(queue.jobs) == 1 or queue.events >= self.linger_events:
                self._cond.notify()

    def _take(self) -> list[_Job] | None:
        """The next group; None once closed and drained."""
        with self._cond:
            while not self._queue.jobs:
                if self._queue.closed:
                    self._writer = None  # the next batch starts a new writer
                    return None
                self._cond.wait()
            # Linger: a group of a few events costs a commit (and its pages written to the
            # WAL) for little; while fewer than `linger_events` wait, give the requests on
            # their way `linger_s` to join this group.
            deadline = time.monotonic() + self.linger_s
            while not self._queue.closed:
                left = deadline - time.monotonic()
                if self._queue.events >= self.linger_events or left <= 0:
                    break
                self._cond.wait(left)
            if self.gate is not None and self.gate.reads:
                # A page or a read is running: step aside (read_gate.py); what comes in
                # meanwhile joins this group.
                self._cond.release()
                try:
                    self.gate.yield_to_reads()
                finally:
                    self._cond.acquire()
            pending = self._queue.jobs
            group: list[_Job] = []
            n_events = 0
            for job in pending:
                if len(group) >= self.max_group or (
                    group and n_events + len(job.batch.events) > self.max_group_events
                ):
                    break
                group.append(job)
                n_events += len(job.batch.events)
            del pending[: len(group)]
            self._queue.events -= n_events
            return group

    def _write_loop(self) -> None:
        while (group := self._take()) is not None:
            kept: list[store.StoredRankStep] | None = None
            try:
                kept = self._write_group(group)
            except BaseException:
                # The group failed as a whole: retry each batch alone.
                for job in group:
                    self._write_alone(job)
            finally:
                try:
                    _answer(group)
                except Exception:  # never leave the writer dead with requests waiting
                    log.exception("answering an ingest group")
            if kept:
                self._keep(kept)

    def _keep(self, kept: list[store.StoredRankStep]) -> None:
        """Hand the group's committed rank-steps to the fresh-steps cache (read/rollups/fresh.py),
        after their requests were answered."""
        try:
            self.fresh.add(
                [row for row, _ in kept], [colls for _, colls in kept],
                row_columns=store.STEP_COLUMNS, coll_columns=store.COLLECTIVE_COLUMNS,
            )  # fmt: skip
        except Exception:  # a shortcut for the roll-up worker: never worth the writer's life
            log.exception("keeping fresh rank-steps")

    def _write_group(self, group: list[_Job]) -> list[store.StoredRankStep]:
        """Write the group in one transaction; returns its newly stored rank-steps."""
        now = time.time()
        kept: list[store.StoredRankStep] = []
        with self.db.write() as conn:
            refs: dict[str, store.RunRef | None] = {}
            items: list[tuple[store.RunRef, ev.EventBatch]] = []
            for job in group:
                if job.run_id not in refs:
                    refs[job.run_id] = store.run_ref(conn, run_id=job.run_id)
                ref = refs[job.run_id]
                if ref is not None:
                    items.append((ref, job.batch))
            outcomes = iter(
                store.ingest_many(
                    conn, items, now=now, trace_sample_every=self.trace_sample_every, kept=kept
                )
            )
        for job in group:
            if refs[job.run_id] is None:
                job.result, job.error = None, None  # unknown run: 404
                continue
            out = next(outcomes)
            if isinstance(out, store.BatchError):
                job.result, job.error = None, out
            else:
                job.result, job.error = out, None
        self.groups += 1
        self.batches += len(group)
        return kept

    def _write_alone(self, job: _Job) -> None:
        try:
            job.result = store.ingest_batch(
                self.db,
                run_id=job.run_id,
                batch=job.batch,
                trace_sample_every=self.trace_sample_every,
            )
            job.error = None
        except BaseException as e:
            job.result, job.error = None, e


def _answer(group: list[_Job]) -> None:
    """Wake every owner: blocking callers one by one, each event loop once for its jobs."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
    for job in group:
        if job.loop is not None:
            by_loop.setdefault(job.loop, []).append(job)
        elif job.done is not None:
            job.done.set()
    for loop, jobs in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            loop.call_soon_threadsafe(_resolve, jobs)


def _resolve(jobs: list[_Job]) -> None:
    for job in jobs:
        fut = job.future
        if fut is None or fut.done():  # the request was cancelled meanwhile
            continue
        if job.error is not None:
            fut.set_exception(job.error)
        else:
            fut.set_result(job.result)


__all__ = ["Ingestor"]
