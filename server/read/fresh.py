"""Fresh steps: the metrics of rank-steps this process just stored, kept for the compactor.

The compactor rolls a step up from its per-rank rows (rollups.py). Read back from the
database, a rank-step costs a fetch of ~25 columns and the decoding of six JSON documents
(its phases, parts, offload, memory, scalars and each collective's histogram): at 4,096
ranks that was a quarter of the server's CPU per rank-step (bench/scale.py), spent on
values the ingest writer held a moment before. So the writer, once a group is committed,
turns the group's new rank-steps into metric columns (`vocabulary.rank_table`, the one
definition of a rank-step's metrics: a handful of numpy conversions for hundreds of
rank-steps) and keeps them here, by (run, step). The compactor rolls a step up from these
columns when they hold every rank-step the database holds for it, and from the rows
otherwise.

What makes that safe, with several server processes or after a restart: the compactor
first reads the step's (rank, seq) keys from the database (an index-only read, no JSON)
and uses the cache only if it holds the newest row of every one of those ranks; a row
another process stored, or one stored before this process started, sends the step down
the row path. Only committed rank-steps enter (the writer adds them after its commit), and
the values are those the rows hold (floats and integers round-trip exactly through both
databases and JSON). The cache is bounded (`max_rank_steps`: once full, newer rank-steps
are not kept), and steps leave it when they are rolled up or after `max_age_s` (with
several server processes, another process's compactor may roll them up): it is a
shortcut, never a source of truth.

Several server processes (PostgreSQL: `serve --workers N`, or servers behind a load
balancer): each stores part of every step, and one of them rolls a run up (the one whose
compactor holds the run's claim, rollups.py). Its cache holds only its own part; the rest,
read back from the rows, cost that compactor 30-47 us per rank-step of the step with two
processes (half of them rows). So a process whose compactor found a run claimed by another
*shares* that run (`share`): what it holds of it, and from then on its rank-steps of it
at most `share_delay_s` after their commit (converted with whatever else waits), are
published, packed (`pack`: the same columns, bytes for bytes; one row per converted
group), in the `fresh_blocks` table. The claiming compactor takes them into its own cache
at the start of its round (`take_shared`: deleted as they are read, so each is taken
once) and matches them by (rank, seq) like its own. A block that comes too late, or not
at all, only sends its ranks down the row path; blocks nobody took are deleted after
`MAX_AGE_S` (rollups.Compactor.sweep_shared); the table holds at most
`MAX_SHARED_RANK_STEPS` (past that, rank-steps are not published: their rows serve).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import orjson
from sqlalchemy import Connection, Engine, delete, func, insert, select
from zerowatch.server import models as m
from zerowatch.server.read.vocabulary import rank_table

from zerowatch import events as ev

log = logging.getLogger(__name__)

N_BUCKETS = len(ev.LATENCY_BUCKETS) + 1
#: Rank-steps kept at most: 32 steps of a 4,096-rank run (about 1 KB each).
MAX_RANK_STEPS = 131_072
#: Seconds a step is kept at most: a step is rolled up once its ranks are in (16 s after its
#: first at 4,096 ranks), or after `rollup_incomplete_s` (30 s) without them.
MAX_AGE_S = 120.0
#: Seconds a shared run's stored rank-steps wait before they are converted and published
#: (with more of them: converting costs as much again in small groups).
SHARE_DELAY_S = 0.2
#: Rank-steps the `fresh_blocks` table holds at most (all processes together; ~0.7 KB each).
MAX_SHARED_RANK_STEPS = 262_144


@dataclass(slots=True)
class Block:
    """The metrics of the rank-steps of one written group.

    `values[j, i]` is metric `names[j]` of rank-step i (NaN: none); `hists[op][i]` the
    latency histogram of rank-step i's rows of that op (zeros where it has none), and
    `latency_sums[op]` the `latency_sum_s` of every row of that op with the rank-step it
    belongs to (what a rollup's histogram and its sum add up over ranks). Arrays, not lists:
    the cache holds a hundred thousand rank-steps, and the garbage collector walks every
    list it holds."""

    names: list[str]
    values: np.ndarray  # (metrics, rank-steps) float64
    hists: dict[str, np.ndarray]  # op -> (rank-steps, N_BUCKETS) int64
    latency_sums: dict[str, tuple[np.ndarray, np.ndarray]]  # op -> (values, rank-step index)


def block_of(
    rows: Sequence[Sequence[Any]],
    colls: Sequence[Sequence[Sequence[Any]]],
    *,
    row_columns: Sequence[str],
    coll_columns: Sequence[str],
) -> Block:
    """The Block of rank-steps given as the ingest writer stored them: `rows[i]` a steps
    row, `colls[i]` its collectives rows, tuples in the order of `row_columns` and
    `coll_columns` (JSON columns as Python values)."""
    row_index = {c: i for i, c in enumerate(row_columns)}
    coll_index = {c: i for i, c in enumerate(coll_columns)}
    table = rank_table(rows, colls, row_index=row_index, coll_index=coll_index)
    names = list(table)
    values = np.array([table[n] for n in names]) if names else np.empty((0, len(rows)))
    hists: dict[str, np.ndarray] = {}
    sums: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    flat = [c for cs in colls for c in cs]
    if flat:
        at = np.array([i for i, cs in enumerate(colls) for _ in cs], dtype=np.int64)
        by_position = list(zip(*flat, strict=True))
        ops = by_position[coll_index["op"]]
        op_of = np.array(ops, dtype=object)
        lats = np.array(by_position[coll_index["latency_sum_s"]], dtype=np.float64)
        # Checked at ingest: one count per bucket (store.validate_batch).
        buckets = np.fromiter(
            chain.from_iterable(by_position[coll_index["buckets"]]),
            dtype=np.int64,
            count=len(flat) * N_BUCKETS,
        ).reshape(len(flat), N_BUCKETS)
        for op in dict.fromkeys(ops):
            sel = np.flatnonzero(op_of == op)
            h = hists[op] = np.zeros((len(rows), N_BUCKETS), dtype=np.int64)
            np.add.at(h, at[sel], buckets[sel])
            sums[op] = (lats[sel], at[sel])
    return Block(names, values, hists, sums)


@dataclass(slots=True)
class _Piece:
    """The rank-steps of one step that one block holds: rank-step `at[i]` of `block` is
    rank `ranks[i]`'s row `seqs[i]`."""

    block: Block
    at: np.ndarray  # int64
    ranks: np.ndarray  # int64
    seqs: np.ndarray  # int64


def pack(
    block: Block, at: np.ndarray, steps: np.ndarray, ranks: np.ndarray, seqs: np.ndarray
) -> bytes:
    """Rank-steps `at` (ascending) of `block`, which are (step, rank, seq) `steps[i]`,
    `ranks[i]`, `seqs[i]`, as bytes (`unpack` gives them back, every value the same): a
    JSON header (metric names; per op its histograms' integer type and its sums' count),
    then steps, ranks, seqs, the metric values and, per op, its histograms, latency sums and
    the rank-step of each sum, as raw little-endian arrays."""
    n = len(at)
    ops = []
    arrays = [steps.astype("<i8"), ranks.astype("<i8"), seqs.astype("<i8"),
              block.values[:, at].astype("<f8")]  # fmt: skip
    for op, hist in block.hists.items():
        h = hist[at]
        lats, rows = block.latency_sums[op]
        sel = np.isin(rows, at)
        # A rank-step's calls of one op per bucket: a few hundred at most, so a narrow type.
        dtype = next(t for t in ("<u2", "<u4", "<i8") if h.size == 0 or (
            h.min() >= 0 and h.max() <= np.iinfo(t).max))  # fmt: skip
        ops.append([op, dtype, int(sel.sum())])
        arrays += [h.astype(dtype), lats[sel].astype("<f8"),
                   np.searchsorted(at, rows[sel]).astype("<i4")]  # fmt: skip
    header = orjson.dumps({"n": n, "names": block.names, "ops": ops})
    return b"".join([len(header).to_bytes(4, "little"), header, *(a.tobytes() for a in arrays)])


def unpack(data: bytes) -> tuple[Block, np.ndarray, np.ndarray, np.ndarray]:
    """What `pack` packed: a block of its own and its rank-steps' steps, ranks and seqs."""
    size = int.from_bytes(data[:4], "little")
    header = orjson.loads(data[4 : 4 + size])
    n, names = header["n"], header["names"]
    at = 4 + size

    def take(dtype: str, count: int, as_: type = np.int64) -> np.ndarray:
        nonlocal at
        a = np.frombuffer(data, dtype=dtype, count=count, offset=at)
        at += a.nbytes
        return a.astype(as_)  # native, and a copy the block owns

    steps, ranks, seqs = (take("<i8", n) for _ in range(3))
    values = take("<f8", len(names) * n, np.float64).reshape(len(names), n)
    hists: dict[str, np.ndarray] = {}
    sums: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for op, dtype, k in header["ops"]:
        hists[op] = take(dtype, n * N_BUCKETS).reshape(n, N_BUCKETS)
        sums[op] = (take("<f8", k, np.float64), take("<i4", k))
    if at != len(data):
        raise ValueError(f"a packed fresh block of {len(data)} bytes holds {at}")
    return Block(list(names), values, hists, sums), steps, ranks, seqs


@dataclass(slots=True)
class Found:
    """The rank-steps of one step the cache holds, among those asked for: `ranks`
    (ascending) and, per block, `(block, at, pos)`: rank-step `at[i]` of the block is rank
    `ranks[pos[i]]`'s."""

    ranks: np.ndarray
    parts: list[tuple[Block, np.ndarray, np.ndarray]]


#: A (rank, seq) as one int64 (`rank << _SEQ_BITS | seq`) where both fit.
_SEQ_BITS = 40
_RANK_LIMIT = 1 << (62 - _SEQ_BITS)


class FreshSteps:
    """The cache (see the module docstring). Thread-safe: the writer adds, the compactor and
    readers look up.

    The writer's groups are small (a few hundred rank-steps: the requests in flight), and
    converting a group costs as much in fixed numpy and Python overhead as in per-row work;
    so rows wait in a pending list until `convert_rows` are there (or a lookup needs them)
    and are converted together."""

    def __init__(
        self,
        max_rank_steps: int = MAX_RANK_STEPS,
        convert_rows: int = 2048,
        max_age_s: float = MAX_AGE_S,
    ) -> None:
        self.max_rank_steps = max_rank_steps
        self.convert_rows = convert_rows
        self.max_age_s = max_age_s
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
        #: Steps served from the cache, partly from it, and from the rows alone (tests).
        self.hits = 0
        self.partial = 0
        self.misses = 0
        #: Rank-steps not kept because the cache was full.
        self.refused = 0
        #: Readers' rollups of dirty steps (rollups._live).
        self.live = LiveMemo()
        #: Runs another process's compactor rolls up: their rank-steps are published.
        self._shared: set[int] = set()
        #: Packed blocks to publish: (run, rank-steps, data).
        self._outbox: list[tuple[int, int, bytes]] = []
        #: Seconds a shared run's rank-steps wait to be converted with more.
        self.share_delay_s = SHARE_DELAY_S
        self._pending_since = 0.0
        self._publish_lock = threading.Lock()
        #: The database that `publish` writes to (set by `of`); None: nothing is published.
        self.engine: weakref.ReferenceType[Engine] | None = None
        #: Rank-steps published, and not published because the table was full.
        self.published = 0
        self.unpublished = 0
        #: Rank-steps taken from what other processes published (`take_shared`).
        self.taken = 0
        self._room_checked = -1.0
        self._room = 0

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
        and `coll_columns`, JSON columns as Python values (see `block_of`)."""
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
            # A shared run's rank-steps wait at most `share_delay_s`: the claiming
            # compactor rolls a step up `settle_s` after its last rank-step came.
            if len(self._pending) >= self.convert_rows or (
                self._shared and now - self._pending_since >= self.share_delay_s
            ):
                self._convert()
        self.publish()

    def flush_shared(self) -> None:
        """Publish the shared runs' rank-steps that wait (the compactor's tick: the last
        ones of a run, which no later group pushes out)."""
        with self._lock:
            if self._shared:
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
        processes on one database another process's compactor may roll them up, and this
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
        up (and its compactor discards them, not this one's)."""
        keep = set(dirty)
        with self._lock:
            done = [step for run, step in self._steps if run == pk and step not in keep]
        self.discard(pk, done)

    def publish(self) -> None:
        """Write the packed blocks waiting to the database, in one transaction (while the
        table has room: `MAX_SHARED_RANK_STEPS`)."""
        with self._lock:
            out, self._outbox = self._outbox, []
        engine = self.engine() if self.engine is not None else None
        if not out or engine is None:
            return
        n = sum(k for _, k, _ in out)
        try:
            self._write(engine, out, n)
        except Exception:  # a shortcut: the rows are stored, and serve
            log.exception("publishing fresh rank-steps")
            self.unpublished += n

    def _write(self, engine: Engine, out: list[tuple[int, int, bytes]], n: int) -> None:
        b = m.fresh_blocks
        with self._publish_lock, engine.begin() as conn:
            now = time.time()
            if now - self._room_checked >= 1.0:  # one count a second, not one a group
                self._room_checked = now
                used = conn.execute(select(func.coalesce(func.sum(b.c.n), 0))).scalar()
                self._room = MAX_SHARED_RANK_STEPS - int(used or 0)
            if n > self._room:
                self.unpublished += n
                return
            self._room -= n
            conn.execute(
                insert(b),
                [{"run": pk, "n": k, "created": now, "data": data} for pk, k, data in out],
            )
            self.published += n

    def take_shared(self, conn: Connection, pk: int) -> int:
        """Take what other processes published of run `pk` into this cache (this process's
        compactor rolls it up): deleted from the table in the caller's transaction, so each
        block is taken once. Returns the rank-steps taken."""
        b = m.fresh_blocks
        got = conn.execute(delete(b).where(b.c.run == pk).returning(b.c.id, b.c.data)).all()
        taken = 0
        with self._lock:
            for _, data in sorted(got):  # in the order they were published
                block, steps, ranks, seqs = unpack(bytes(data))
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


@dataclass(slots=True)
class StepColumns:
    """One step's metrics over some of its ranks: `table[name][i]` is rank `ranks[i]`'s
    value (NaN: none); per collective op the latency histogram summed over those ranks and
    every row's latency sum (added up exactly once the step is whole)."""

    ranks: np.ndarray  # int64, ascending
    table: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]  # op -> N_BUCKETS int64
    latency_sums: dict[str, list[float]]

    def merged(self, other: StepColumns) -> StepColumns:
        """These ranks and `other`'s (disjoint) together, ranks ascending."""
        ranks = np.concatenate([self.ranks, other.ranks])
        order = np.argsort(ranks, kind="stable")
        n_self, n = len(self.ranks), len(ranks)
        table = {}
        for name in {**self.table, **other.table}:
            col = np.full(n, np.nan)
            if name in self.table:
                col[:n_self] = self.table[name]
            if name in other.table:
                col[n_self:] = other.table[name]
            table[name] = col[order]
        counts = {op: c.copy() for op, c in self.counts.items()}
        for op, c in other.counts.items():
            counts[op] = counts[op] + c if op in counts else c.copy()
        sums = {op: list(v) for op, v in self.latency_sums.items()}
        for op, v in other.latency_sums.items():
            sums.setdefault(op, []).extend(v)
        return StepColumns(ranks[order], table, counts, sums)


def columns(found: Found) -> StepColumns:
    """The StepColumns of cached rank-steps (`FreshSteps.lookup`): what `rollups.compute`
    gets from the rows of those ranks."""
    n = len(found.ranks)
    cols: dict[str, np.ndarray] = {}
    hists: dict[str, np.ndarray] = {}
    sums: dict[str, list[float]] = {}
    for block, at, pos in found.parts:
        sub = block.values[:, at]
        for j, name in enumerate(block.names):
            col = cols.get(name)
            if col is None:
                col = cols[name] = np.full(n, np.nan)
            col[pos] = sub[j]
        for op, h in block.hists.items():
            total = hists.get(op)
            if total is None:
                total = hists[op] = np.zeros(N_BUCKETS, dtype=np.int64)
                sums[op] = []
            total += h[at].sum(axis=0)
            lats, rows = block.latency_sums[op]
            sums[op].extend(lats[np.isin(rows, at)].tolist())
    cols = {name: c for name, c in cols.items() if not np.isnan(c).all()}
    return StepColumns(found.ranks.copy(), cols, hists, sums)


class LiveMemo:
    """Rollups of dirty steps computed by readers, by (run, step, (version, since) of its mark):
    what rollups.read computed once, given again while the step's rows have not changed
    (see rollups._live). Least recently used out first; thread-safe."""

    def __init__(self, max_steps: int = 256) -> None:
        self.max_steps = max_steps
        self._lock = threading.Lock()
        self._memo: dict[tuple[int, int, tuple[int, float]], Any] = {}
        self.hits = 0

    def get(self, key: tuple[int, int, tuple[int, float]]) -> Any:
        with self._lock:
            got = self._memo.pop(key, None)
            if got is not None:
                self._memo[key] = got  # most recently used last
                self.hits += 1
            return got

    def put(self, key: tuple[int, int, tuple[int, float]], value: Any) -> None:
        with self._lock:
            self._memo.pop(key, None)
            self._memo[key] = value
            while len(self._memo) > self.max_steps:
                del self._memo[next(iter(self._memo))]


_CACHES: weakref.WeakKeyDictionary[Engine, FreshSteps] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def of(engine: Engine) -> FreshSteps:
    """The cache of the database behind `engine` in this process (made on first use)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(engine)
        if cache is None:
            cache = _CACHES[engine] = FreshSteps()
            cache.engine = weakref.ref(engine)
        return cache


__all__ = [
    "Block", "Found", "FreshSteps", "LiveMemo", "StepColumns", "block_of", "columns", "of",
    "pack", "unpack",
]  # fmt: skip
