"""The roll-up worker: the background thread that rolls dirty steps up and keeps the read
model's tables tidy.

Each round (`run_once`) it claims the runs with dirty steps (claims.py; SQLite: all of
them), takes in the fresh rank-steps other processes published of its runs
(shared_blocks.py), picks the marks worth rolling up (settled, of steps that every rank
has reached or that nobody wrote to for `incomplete_s`), computes their rollups
(compute.py) and, per run, in one short transaction replaces the steps' rollup rows,
applies the change to the run's totals (totals.py) and clears the marks whose version it
read. On a slower clock (`retention_interval_s`) it thins old per-rank rows
(retention.py) and sweeps shared blocks nobody took.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, delete, func, select, tuple_
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.read.rollups.claims import RunClaims, lock_run_writes
from zerowatch.server.read.rollups.compute import compute
from zerowatch.server.read.rollups.retention import Retention, delete_rank_rows, horizon
from zerowatch.server.read.rollups.shared_blocks import SharedBlocks
from zerowatch.server.read.rollups.stats import Stats
from zerowatch.server.read.rollups.totals import COUNTED, TotalsDelta
from zerowatch.server.read_gate import ReadGate

log = logging.getLogger(__name__)


class RollupWorker:
    """Rolls dirty steps up in the background (see the module docstring).

    Args:
        db: the database; its `caches` give the tuning and the fresh-steps cache.
        interval_s: seconds between rounds.
        settle_s: seconds nobody wrote to a step before it is rolled up.
        incomplete_s: ... for a step that not every rank has reached.
        retention: which per-rank rows stay.
        gate: reads in flight that the worker steps aside for (read_gate.py); None: never.
        claim_idle_s: seconds a claim is kept without steps; None: the tuning's.
        max_steps: dirty steps one round takes at most; None: the tuning's.
    """

    def __init__(
        self,
        db: Database,
        *,
        interval_s: float = 0.5,
        settle_s: float = 0.5,
        incomplete_s: float = 30.0,
        retention: Retention | None = None,
        gate: ReadGate | None = None,
        claim_idle_s: float | None = None,
        max_steps: int | None = None,
    ) -> None:
        self.db = db
        self.tuning = tuning = db.caches.tuning
        self.fresh = db.caches.fresh
        self.gate = gate
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.incomplete_s = max(incomplete_s, settle_s)
        self.max_steps = tuning.worker_max_steps if max_steps is None else max_steps
        self.retention = retention or Retention()
        self.retention_interval_s = tuning.retention_interval_s
        idle = tuning.claim_idle_s if claim_idle_s is None else claim_idle_s
        self.claims = RunClaims(db, tuning, idle_s=idle)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one round at a time in this process
        self._last_retention = 0.0
        self._last_sweep = 0.0
        #: Steps rolled up since start (tests, the benchmark).
        self.compacted = 0

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._loop, name="zerowatch-rollups", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self.claims.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                while self.run_once() >= self.max_steps and not self._stop.is_set():
                    pass
                now = time.time()
                if now - self._last_sweep >= self.retention_interval_s:
                    self._last_sweep = now
                    self.sweep_shared(now)
                if (
                    self.retention.full_steps
                    and now - self._last_retention >= self.retention_interval_s
                ):
                    self._last_retention = now
                    self.apply_retention()
            except Exception:  # the next tick tries again; ingest is unaffected
                log.exception("rolling steps up")

    def flush(self) -> int:
        """Roll up every dirty step now, settled or not. Returns how many."""
        total = 0
        while (n := self.run_once(settle=False)) > 0:
            total += n
        return total

    def run_once(self, *, settle: bool = True, now: float | None = None) -> int:
        """Roll up at most `max_steps` dirty steps. Returns how many were taken."""
        now = time.time() if now is None else now
        d = m.dirty_steps.c
        cache = self.fresh
        with self._lock:
            self.claims.release_idle(time.time())
            with self.db.read() as conn:
                ready = [d.since <= now - self.settle_s] if settle else []
                # Every run with dirty steps is claimed (or found claimed) at once, settled or
                # not: the other processes start to share their part of its steps before the
                # first of them is rolled up.
                runs = [int(pk) for pk in conn.execute(select(d.run).distinct()).scalars()]
                theirs = [pk for pk in runs if not self._claim(pk, time.time())]
                for pk in theirs:  # rolled up elsewhere: hold only what is still dirty
                    cache.retain(
                        pk, conn.execute(select(d.step).where(d.run == pk)).scalars().all()
                    )
                runs = [pk for pk in runs if pk not in theirs]
                published: list[int] = []
                if self.db.dialect == "postgresql" and runs:  # SQLite: one process, no others
                    sent = SharedBlocks.runs(conn)
                    published = [pk for pk in runs if pk in sent]
            cache.flush_shared(waited_s=self.tuning.share_delay_s)
            if published:
                with self.db.write() as conn:
                    for pk in published:
                        cache.take_shared(conn, pk)
            if not runs:
                return 0
            with self.db.read() as conn:
                q = select(d.run, d.step, d.version, d.since).where(d.run.in_(runs), *ready)
                marks = conn.execute(q.order_by(d.run, d.step).limit(self.max_steps)).all()
                if settle:
                    marks = self._complete_or_old(conn, marks, now)
                if not marks:
                    return 0
                by_run: dict[int, list[tuple[int, int]]] = defaultdict(list)
                for mk in marks:
                    by_run[int(mk.run)].append((int(mk.step), int(mk.version)))
                horizons = {pk: horizon(conn, pk) for pk in by_run}
                pause = self.gate.yield_to_reads if self.gate is not None else None
                computed = {
                    pk: compute(
                        conn,
                        pk,
                        [st for st, _ in items if not self.retention.thinned(st, horizons[pk])],
                        pause=pause,
                    )
                    for pk, items in by_run.items()
                }
            for pk, items in by_run.items():
                self._write(pk, items, computed[pk], horizons[pk])
                cache.discard(pk, [st for st, _ in items])
            self.compacted += len(marks)
            return len(marks)

    def _claim(self, pk: int, now: float) -> bool:
        """Whether this worker may roll run `pk` up now (claims.py); the fresh-steps cache
        shares what it holds of a run another process claimed."""
        got = self.claims.claim(pk, now)
        if got:
            self.fresh.own(pk)
        else:
            self.fresh.share(pk)
        return got

    def _complete_or_old(self, conn: Connection, marks: list[Any], now: float) -> list[Any]:
        """The settled marks worth rolling up now: steps that every rank of the run has
        reached, and steps nobody wrote to for `incomplete_s` (a rank that died, or one
        whose agent is offline). A step whose last ranks are still on their way would be
        rolled up now and again when they arrive: a step's ranks reach a busy server over
        one flush interval of the agents (16 s at 4,096 ranks), and a pause of the server
        longer than `settle_s` in between is no sign that they are all in."""
        s = m.steps.c
        chunk = self.tuning.chunk_steps
        by_run: dict[int, list[Any]] = defaultdict(list)
        for mk in marks:
            by_run[int(mk.run)].append(mk)
        sizes: dict[int, int] = dict(
            conn.execute(
                select(m.runs.c.id, m.runs.c.world_size).where(m.runs.c.id.in_(list(by_run)))
            ).all()
        )
        old = now - self.incomplete_s
        keep = []
        for pk, items in by_run.items():
            young = [int(mk.step) for mk in items if mk.since > old]
            counts: dict[int, int] = {}
            for i in range(0, len(young), chunk):
                counts.update(
                    conn.execute(
                        select(s.step, func.count())
                        .where(s.run == pk, s.step.in_(young[i : i + chunk]))
                        .group_by(s.step)
                    ).all()
                )
            world = int(sizes.get(pk) or 0)
            keep += [mk for mk in items if mk.since <= old or counts.get(int(mk.step), 0) >= world]
        return keep

    def _write(
        self, pk: int, items: list[tuple[int, int]], stats: dict[int, dict[str, Stats]],
        horizon: int,
    ) -> None:  # fmt: skip
        """Replace the steps' rollups, update the run's totals, delete thinned steps' rows
        and clear the marks of the versions read, in one transaction."""
        steps = [st for st, _ in items]
        chunk = self.tuning.chunk_steps
        r, d = m.step_rollups, m.dirty_steps
        with self.db.write() as conn:
            lock_run_writes(conn, pk, self.tuning)
            delta = TotalsDelta()
            for i in range(0, len(steps), chunk):
                part = steps[i : i + chunk]
                old = conn.execute(
                    select(r.c.metric, r.c.max, r.c.extra).where(
                        r.c.run == pk, r.c.step.in_(part), r.c.metric.in_(COUNTED)
                    )
                ).all()
                for row in old:
                    delta.add(row.metric, row.max, row.extra or {}, -1)
                conn.execute(delete(r).where(r.c.run == pk, r.c.step.in_(part)))
            rows = []
            for step, per_metric in stats.items():
                for name, st in per_metric.items():
                    rows.append(
                        {
                            "run": pk, "metric": name, "step": step, "n": st.n, "min": st.min,
                            "p10": st.p10, "p50": st.p50, "p90": st.p90, "max": st.max,
                            "mean": st.mean, "min_rank": st.min_rank, "max_rank": st.max_rank,
                            "extra": st.extra,
                        }
                    )  # fmt: skip
                    if name in COUNTED:
                        delta.add(name, st.max, st.extra, +1)
            if rows:
                conn.execute(r.insert(), rows)
            delta.apply(conn, pk)
            thinned = [st for st in steps if self.retention.thinned(st, horizon)]
            if thinned:
                delete_rank_rows(conn, pk, thinned, chunk=chunk)
            pairs = [(pk, st, ver) for st, ver in items]
            for i in range(0, len(pairs), chunk):
                conn.execute(
                    delete(d).where(
                        tuple_(d.c.run, d.c.step, d.c.version).in_(pairs[i : i + chunk])
                    )
                )

    def sweep_shared(self, now: float) -> int:
        """Delete shared blocks nobody took (shared_blocks.py). Returns how many."""
        shared = self.fresh.shared
        if shared is None:
            return 0
        with self.db.write() as conn:
            return shared.sweep(conn, now)

    def apply_retention(self) -> int:
        """Thin old per-rank rows of every run (retention.py). Returns rank-steps deleted."""
        return self.retention.apply(self.db, chunk=self.tuning.chunk_steps)


__all__ = ["RollupWorker"]
