"""Fresh rank-steps shared between server processes: a byte format and a table protocol.

Several server processes (PostgreSQL: `serve --workers N`, or servers behind a load
balancer) each store part of every step, and one of them rolls a run up: the one whose
worker holds the run's claim (claims.py). Its fresh-steps cache (fresh.py) holds only its
own part; the rest, read back from the rows, cost that worker 30-47 us per rank-step of
the step with two processes (half of them rows). So a process whose worker found a run
claimed by another *shares* that run: its fresh rank-steps of it are packed (`pack`: the
same columns, bytes for bytes; one row per converted group) and published in the
`fresh_blocks` table (`SharedBlocks.publish`). The claiming worker takes them into its
own cache at the start of its round (`SharedBlocks.take`: deleted as they are read, so
each is taken once) and matches them by (rank, seq) like its own.

A block that comes too late, or not at all, only sends its ranks down the row path;
blocks nobody took are swept after `fresh_max_age_s` (`SharedBlocks.sweep`); the table
holds at most `max_shared_rank_steps` (past that, rank-steps are not published: their
rows serve).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import orjson
from sqlalchemy import Connection, Engine, delete, func, insert, select
from zerowatch.server import models as m
from zerowatch.server.read.metric_table import N_BUCKETS
from zerowatch.server.read.rollups.columns import Block
from zerowatch.server.read.rollups.tuning import ReadTuning

log = logging.getLogger(__name__)

#: A packed block waiting to be published: (run, rank-steps, bytes).
Packed = tuple[int, int, bytes]


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


class SharedBlocks:
    """The `fresh_blocks` table of one database, as this process publishes to it and takes
    from it (see the module docstring). Thread-safe."""

    def __init__(self, engine: Engine, tuning: ReadTuning) -> None:
        self.engine = engine
        self.tuning = tuning
        self._lock = threading.Lock()
        self._room_checked = -1.0
        self._room = 0
        #: Rank-steps published, and not published because the table was full or a write
        #: failed.
        self.published = 0
        self.unpublished = 0

    def publish(self, out: list[Packed]) -> None:
        """Write packed blocks in one transaction, while the table has room. A failure is
        logged: the rows are stored, and serve."""
        if not out:
            return
        n = sum(k for _, k, _ in out)
        try:
            self._write(out, n)
        except Exception:
            log.exception("publishing fresh rank-steps")
            self.unpublished += n

    def _write(self, out: list[Packed], n: int) -> None:
        b = m.fresh_blocks
        with self._lock, self.engine.begin() as conn:
            now = time.time()
            if now - self._room_checked >= self.tuning.shared_room_check_s:
                self._room_checked = now
                used = conn.execute(select(func.coalesce(func.sum(b.c.n), 0))).scalar()
                self._room = self.tuning.max_shared_rank_steps - int(used or 0)
            if n > self._room:
                self.unpublished += n
                return
            self._room -= n
            conn.execute(
                insert(b),
                [{"run": pk, "n": k, "created": now, "data": data} for pk, k, data in out],
            )
            self.published += n

    @staticmethod
    def runs(conn: Connection) -> set[int]:
        """The runs some process published blocks of."""
        return {int(pk) for pk in conn.execute(select(m.fresh_blocks.c.run).distinct()).scalars()}

    @staticmethod
    def take(conn: Connection, pk: int) -> list[tuple[Block, np.ndarray, np.ndarray, np.ndarray]]:
        """What other processes published of run `pk`, in the order they published it,
        unpacked: deleted from the table in the caller's transaction, so each block is
        taken once."""
        b = m.fresh_blocks
        got = conn.execute(delete(b).where(b.c.run == pk).returning(b.c.id, b.c.data)).all()
        return [unpack(bytes(data)) for _, data in sorted(got)]

    def sweep(self, conn: Connection, now: float) -> int:
        """Delete blocks older than `fresh_max_age_s` (no worker took them: the run's claim
        went away). Returns how many."""
        b = m.fresh_blocks
        gone = conn.execute(delete(b).where(b.c.created < now - self.tuning.fresh_max_age_s))
        return int(gone.rowcount or 0)


__all__ = ["Packed", "SharedBlocks", "pack", "unpack"]
