"""Fresh steps: the metric columns of rank-steps this process just stored, kept for the
roll-up worker.

The worker rolls a step up from its per-rank rows. Read back from the database, a
rank-step costs a fetch of ~25 columns and the decoding of six JSON documents (its phases,
parts, offload, memory, scalars and each collective's histogram): at 4,096 ranks that was a
quarter of the server's CPU per rank-step (bench/scale.py), spent on values the ingest
writer held a moment before. So the writer, once a group is committed, hands the group's
new rank-steps to this cache, which turns them into metric columns (columns.py: a handful
of numpy conversions for hundreds of rank-steps) and keeps them by (run, step). A step is
rolled up from these columns when they hold every rank-step the database holds for it, and
from the rows otherwise (compute.py).

What makes that safe, with several server processes or after a restart: the worker first
reads the step's (rank, seq) keys from the database (an index-only read, no JSON) and uses
the cache only for the newest row of each of those ranks that it holds (`lookup`); a row
another process stored, or one stored before this process started, comes from the rows.
Only committed rank-steps enter (the writer adds them after its commit), and the values
are those the rows hold (floats and integers round-trip exactly through both databases and
JSON). The cache is bounded (`fresh_max_rank_steps`: once full, newer rank-steps are not
kept), and steps leave it when they are rolled up or after `fresh_max_age_s` (another
process's worker may roll them up): it is a shortcut, never a source of truth.

A run that another process's worker rolls up is *shared* (`share`): what this cache holds
of it, and from then on its rank-steps `share_delay_s` after their commit (with the next
group, or at the worker's next tick when no group comes), are packed and published for
that worker (shared_blocks.py), which takes them in (`take_shared`).

The `Database` owns one cache (caches.py); the ingest writer, the store and the readers
reach it there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np
from sqlalchemy import Connection
from zerowatch.server.read.rollups.columns import Block, Found, block_of
from zerowatch.server.read.rollups.shared_blocks import Packed, SharedBlocks, pack
from zerowatch.server.read.rollups.tuning import ReadTuning


@dataclass(slots=True)
class _Piece:
    """The rank-steps of one step that one block holds: rank-step `at[i]` of `block` is
    rank `ranks[i]`'s row `seqs[i]`."""

    block: Block
    at: np.ndarray  # int64
    ranks: np.ndarray  # int64
    seqs: np.ndarray  # int64


#: A (rank, seq) as one int64 (`rank << _SEQ_BITS | seq`) where both fit.
_SEQ_BITS = 40
_RANK_LIMIT = 1 << (62 - _SEQ_BITS)


class FreshSteps:
    """The cache (see the module docstring). Thread-safe: the writer adds, the worker and
    readers look up.

    The writer's groups are small (a few hundred rank-steps: the requests in flight), and
    converting a group costs as much in fixed numpy and Python overhead as in per-row work;
    so rows wait in a pending list until `fresh_convert_rows` are there (or a lookup needs
    them) and are converted together.

    Args:
        tuning: its bounds (`fresh_*`, `share_delay_s`).
        shared: where shared runs' rank-steps are published; None: nothing is.
    """

    def __init__(self, tuning: ReadTuning, shared: SharedBlocks | None = None) -> None:
        self.max_rank_steps = tuning.fresh_max_rank_steps
        self.convert_rows = tuning.fresh_convert_rows
        self.max_age_s = tuning.fresh_max_age_s
        self.share_delay_s = tuning.share_delay_s
        self.shared = shared
        self._lock = threading.Lock()
        #: (run, step) -> its rank-steps, block by block in the order they came (a (rank,
        #: seq) stored again after retention deleted it: the later copy counts).
        self._steps: dict[tuple[int, int], list[_Piece]] = {}
        #: (run, step) -> when its first rank-step came (time.monotonic()).
        self._born: dict[tuple[int, int], float] = {}
        self._size = 0
        #: Rows not yet converted: (steps row, its collectives rows).
        self._pending: list[tuple[Sequence[Any], Sequence[Sequence[Any]]]] = []
        self._columns: tuple[Sequence[str], Sequence[str]] = ((), ())
        self._pending_since = 0.0
        #: Runs another process's worker rolls up: their rank-steps are published.
        self._shared: set[int] = set()
        #: Packed blocks to publish.
        self._outbox: list[Packed] = []
        #: Steps served from the cache, partly from it, and from the rows alone (tests).
        self.hits = 0
        self.partial = 0
        self.misses = 0
        #: Rank-steps not kept because the cache was full.
        self.refused = 0
        #: Rank-steps taken from what other processes published (`take_shared`).
        self.taken = 0

    def __len__(self) -> int:
        return self._size + len(self._pending)

    def add(
        self,
        rows: Sequence[Sequence[Any]],
        colls: Sequence[Sequence[Sequence[Any]]],
        *,
        row_columns: Sequence[str],
        coll_columns: Sequence[str],
    ) -> None:
        """Keep committed rank-steps: `rows[i]` a steps row, `colls[i]` its collectives
        rows, tuples in the order of `row_columns` (which name the run, rank, seq and step)
        and `coll_columns`, JSON columns as Python values (see `columns.block_of`)."""
        now = time.monotonic()
        with self._lock:
            if self._columns != (row_columns, coll_columns):
                self._convert()
                self._columns = (row_columns, coll_columns)
            # Full: newer rank-steps take the row path. The oldest steps are the next to be
            # rolled up (and, in a recovery storm, the first whose ranks have all arrived).
            room = max(self.max_rank_steps - self._size - len(self._pending), 0)
            self.refused += max(len(rows) - room, 0)
            if not self._pending:
                self._pending_since = now
            self._pending.extend(zip(rows[:room], colls[:room], strict=True))
            # A shared run's rank-steps wait `share_delay_s`: the claiming worker rolls a
            # step up `settle_s` after its last rank-step came.
            if len(self._pending) >= self.convert_rows or (
                self._shared and now - self._pending_since >= self.share_delay_s
            ):
                self._convert()
        self.publish()

    def flush_shared(self, *, waited_s: float = 0.0) -> None:
        """Publish the shared runs' rank-steps once the oldest waited `waited_s` (the
        worker's tick, with `share_delay_s`: the last ones of a run, which no later group
        pushes out; converted at every tick, they would go in smaller groups, at a higher
        cost each)."""
        with self._lock:
            if self._shared and time.monotonic() - self._pending_since >= waited_s:
                self._convert()
        self.publish()

    def _convert(self) -> None:
        """Turn the pending rows into blocks, and pack those of shared runs for `publish`
        (the lock held)."""
        if not self._pending:
            return
        row_columns, coll_columns = self._columns
        run_at, rank_at, seq_at, step_at = (
            list(row_columns).index(k) for k in ("run", "rank", "seq", "step")
        )
        by_run: dict[int, tuple[list[Sequence[Any]], list[Sequence[Sequence[Any]]]]] = {}
        for row, colls in self._pending:
            rows, cs = by_run.setdefault(row[run_at], ([], []))
            rows.append(row)
            cs.append(colls)
        self._pending = []
        for pk, (rows, cs) in by_run.items():
            block = block_of(rows, cs, row_columns=row_columns, coll_columns=coll_columns)
            n = len(rows)
            steps, ranks, seqs = (
                np.fromiter(map(itemgetter(at), rows), dtype=np.int64, count=n)
                for at in (step_at, rank_at, seq_at)
            )
            if pk in self._shared:
                self._outbox.append((pk, n, pack(block, np.arange(n), steps, ranks, seqs)))
            self._place(pk, block, steps, ranks, seqs)
        self._expire(time.monotonic())

    def _place(
        self, pk: int, block: Block, steps: np.ndarray, ranks: np.ndarray, seqs: np.ndarray
    ) -> None:
        """Keep a block's rank-steps of run `pk` step by step (one piece per step, no loop
        over rows; the lock held)."""
        now = time.monotonic()
        order = np.argsort(steps, kind="stable")
        for part in np.split(order, np.flatnonzero(np.diff(steps[order])) + 1):
            key = (pk, int(steps[part[0]]))
            pieces = self._steps.get(key)
            if pieces is None:
                pieces = self._steps[key] = []
                self._born[key] = now
            pieces.append(_Piece(block, part, ranks[part], seqs[part]))
            self._size += len(part)

    def _expire(self, now: float) -> None:
        """Forget steps older than `max_age_s` (the lock held): with several server
        processes on one database another process's worker may roll them up, and this
        one would hold them for nothing."""
        for key, born in self._born.items():  # oldest first
            if born > now - self.max_age_s:
                break
            self._size -= _count(self._steps.pop(key))
        self._born = {k: b for k, b in self._born.items() if k in self._steps}

    def lookup(
        self, pk: int, step: int, ranks: np.ndarray, seqs: np.ndarray
    ) -> tuple[Found, np.ndarray]:
        """Which of the rank-steps asked for this cache holds: `ranks` (int64, ascending,
        unique) and `seqs` name the database's newest row of each rank of the step. Returns
        what it holds, and a mask of those it does not hold (another process stored them
        and did not publish them, or they came before this one started)."""
        with self._lock:
            self._convert()  # a shared run's packed blocks wait for the writer or the tick
            pieces = list(self._steps.get((pk, step)) or ())
        which, at = _held(pieces, ranks, seqs)
        found = Found(ranks[which >= 0] if len(ranks) else ranks, [])
        if len(found.ranks):
            pos = np.cumsum(which >= 0) - 1
            for i in np.unique(which[which >= 0]).tolist():
                sel = which == i
                found.parts.append((pieces[i].block, at[sel], pos[sel]))
        missing = which < 0
        with self._lock:
            if not missing.any():
                self.hits += 1
            elif len(found.ranks):
                self.partial += 1
            else:
                self.misses += 1
        return found, missing

    def share(self, pk: int) -> None:
        """Another process rolls run `pk` up: publish what this cache holds of it, and from
        now on its rank-steps as they are stored (see the module docstring). What it holds
        stays here too, for this process's readers (until `retain` drops it)."""
        with self._lock:
            if pk in self._shared:
                return
            self._convert()
            self._shared.add(pk)
            for (run, step), pieces in self._steps.items():
                if run == pk:
                    for p in pieces:
                        steps = np.full(len(p.at), step, dtype=np.int64)
                        data = pack(p.block, p.at, steps, p.ranks, p.seqs)
                        self._outbox.append((pk, len(p.at), data))
        self.publish()

    def own(self, pk: int) -> None:
        """This process rolls run `pk` up: publish none of it."""
        with self._lock:
            self._shared.discard(pk)

    def retain(self, pk: int, dirty: Sequence[int]) -> None:
        """Keep only the `dirty` steps of shared run `pk`: another process rolled the others
        up (and its worker discards them, not this one's)."""
        keep = set(dirty)
        with self._lock:  # rows still pending stay: converting them now costs more
            done = [step for run, step in self._steps if run == pk and step not in keep]
            self._drop(pk, done)

    def publish(self) -> None:
        """Write the packed blocks waiting (shared_blocks.py)."""
        with self._lock:
            out, self._outbox = self._outbox, []
        if out and self.shared is not None:
            self.shared.publish(out)

    def take_shared(self, conn: Connection, pk: int) -> int:
        """Take what other processes published of run `pk` into this cache (this process's
        worker rolls it up), in the caller's transaction. Returns the rank-steps taken."""
        got = SharedBlocks.take(conn, pk)
        taken = 0
        with self._lock:
            for block, steps, ranks, seqs in got:
                if self._size + len(steps) > self.max_rank_steps:
                    self.refused += len(steps)
                    continue
                self._place(pk, block, steps, ranks, seqs)
                taken += len(steps)
        self.taken += taken
        return taken

    def discard(self, pk: int, steps: Sequence[int]) -> None:
        """Forget the steps of run `pk` (rolled up, or thinned by retention)."""
        with self._lock:
            self._convert()
            self._drop(pk, steps)

    def _drop(self, pk: int, steps: Sequence[int]) -> None:
        """Forget the steps of run `pk` that were converted (the lock held)."""
        for step in steps:
            dropped = self._steps.pop((pk, step), None)
            if dropped is not None:
                self._size -= _count(dropped)
                del self._born[(pk, step)]

    def forget_run(self, pk: int) -> None:
        """Forget every step of run `pk` (deleted)."""
        with self._lock:
            self._convert()
            for key in [k for k in self._steps if k[0] == pk]:
                self._size -= _count(self._steps.pop(key))
                del self._born[key]
            self._shared.discard(pk)
            self._outbox = [o for o in self._outbox if o[0] != pk]


def _count(pieces: list[_Piece]) -> int:
    return sum(len(p.at) for p in pieces)


def _held(
    pieces: list[_Piece], ranks: np.ndarray, seqs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each (ranks[i], seqs[i]): the piece that holds it (-1: none; the last one when
    several do) and its rank-step in that piece's block."""
    which = np.full(len(ranks), -1, dtype=np.int64)
    at = np.zeros(len(ranks), dtype=np.int64)
    if not pieces or not len(ranks):
        return which, at
    c_ranks = np.concatenate([p.ranks for p in pieces])
    c_seqs = np.concatenate([p.seqs for p in pieces])
    c_piece = np.repeat(np.arange(len(pieces)), [len(p.at) for p in pieces])
    c_at = np.concatenate([p.at for p in pieces])
    both = (c_ranks, ranks, c_seqs, seqs)
    if (
        min(a.min() for a in both) >= 0
        and max(c_ranks.max(), ranks.max()) < _RANK_LIMIT
        and (max(c_seqs.max(), seqs.max()) < 1 << _SEQ_BITS)
    ):
        c_key = c_ranks << _SEQ_BITS | c_seqs
        key = ranks << _SEQ_BITS | seqs
        # The last copy of each key: np.unique keeps the first of the reversed order.
        keys, first = np.unique(c_key[::-1], return_index=True)
        last = len(c_key) - 1 - first
        pos = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
        ok = keys[pos] == key
        which[ok] = c_piece[last[pos[ok]]]
        at[ok] = c_at[last[pos[ok]]]
        return which, at
    # Ranks or seqs past what one int64 key holds: a dict (never seen in practice).
    index = {
        (r, q): i for i, (r, q) in enumerate(zip(c_ranks.tolist(), c_seqs.tolist(), strict=True))
    }
    for j, (r, q) in enumerate(zip(ranks.tolist(), seqs.tolist(), strict=True)):
        i = index.get((r, q))
        if i is not None:
            which[j], at[j] = c_piece[i], c_at[i]
    return which, at


__all__ = ["FreshSteps"]
