"""Group commit: concurrent ingest requests share one transaction.

A 1,000-rank job sends a thousand small batches a second (an agent flushes every half
second, so a batch is often one step of one rank). One transaction per batch would spend
most of the server's time beginning and committing. Instead, request threads hand their
batch to the `Ingestor` and wait; whichever thread finds no writer at work becomes the
writer, takes every batch waiting (up to `max_group`), writes them all in one transaction,
commits, wakes their owners, and repeats while more are waiting (flat combining). Nobody
is answered before their batch is committed, so an answer still means "stored".

The group is written with one multi-row statement per table (store.ingest_many), so fifty
one-event batches cost about what one fifty-event batch does. Each batch stays atomic on its
own: it is validated before anything of it is written, so a bad batch is refused alone; if
the group's transaction fails for another reason, it is rolled back and every batch of the
group is retried in a transaction of its own, so one batch's failure never loses another's
events.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from zerowatch.server import store
from zerowatch.server.db import Database

from zerowatch import events as ev


@dataclass
class _Job:
    run_id: str
    batch: ev.EventBatch
    done: threading.Event = field(default_factory=threading.Event)
    result: store.IngestResult | None = None
    error: BaseException | None = None


class Ingestor:
    """Writes event batches with group commit (see the module docstring)."""

    def __init__(
        self,
        db: Database,
        *,
        trace_sample_every: int = 1,
        max_group: int = 256,
        max_group_events: int = 20_000,
    ) -> None:
        self.db = db
        self.trace_sample_every = trace_sample_every
        self.max_group = max_group
        self.max_group_events = max_group_events
        self._lock = threading.Lock()
        self._pending: list[_Job] = []
        self._writing = False
        #: Groups written and batches in them (for tests and the benchmark).
        self.groups = 0
        self.batches = 0

    def submit(self, *, run_id: str, batch: ev.EventBatch) -> store.IngestResult | None:
        """Store `batch` (blocks until committed). None when the run does not exist.

        Raises:
            store.BatchError: the batch is inconsistent with the run (nothing stored).
        """
        job = _Job(run_id, batch)
        with self._lock:
            self._pending.append(job)
            lead = not self._writing
            if lead:
                self._writing = True
        if lead:
            self._drain()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _take(self) -> list[_Job]:
        with self._lock:
            group: list[_Job] = []
            n_events = 0
            while self._pending and len(group) < self.max_group:
                if group and n_events + len(self._pending[0].batch.events) > self.max_group_events:
                    break
                job = self._pending.pop(0)
                group.append(job)
                n_events += len(job.batch.events)
            if not group:
                self._writing = False
            return group

    def _drain(self) -> None:
        while True:
            group = self._take()
            if not group:
                return
            try:
                self._write_group(group)
            except BaseException:
                # The group failed as a whole: retry each batch alone.
                for job in group:
                    self._write_alone(job)
            for job in group:
                job.done.set()

    def _write_group(self, group: list[_Job]) -> None:
        now = time.time()
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
                store.ingest_many(conn, items, now=now, trace_sample_every=self.trace_sample_every)
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


__all__ = ["Ingestor"]
