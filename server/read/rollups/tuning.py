"""The read path's tuning: every size, age, batch and lock id of the rollups and their
caches, in one frozen object the app owns (`Settings.read`, handed to `Database.open`).

Each field says what it bounds and the measurement behind its value; `__post_init__`
refuses a value the read path cannot use, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class ReadTuning:
    """The read path's tuning constants (see the module docstring)."""

    # -- rollups ------------------------------------------------------------------------
    #: Ranks kept at each end of an outlier metric's distribution, per step.
    top_k: int = 16
    #: Dirty steps a reader computes itself (the newest); older ones wait for the worker.
    max_live_steps: int = 256
    #: ... and at most this many rank-steps of them: 8 steps of a 4,096-rank run. Bounded
    #: in steps alone, a page read during a recovery storm (thousands of dirty steps) read
    #: 256 steps x 4,096 ranks of rows per request, and a few such requests at once took the
    #: server past 12 GB (bench/faults.py, 4,096 ranks).
    max_live_rank_steps: int = 32_768
    #: A backlog: more dirty steps than this many times what a reader computes (the worker
    #: is behind, as in a recovery storm). A reader then computes a quarter as many: the
    #: newest steps of a backlog are partial anyway, and every page's read of them from the
    #: rows was what kept a run page from answering in under 2 s (bench/faults.py).
    backlog_factor: int = 4
    #: Steps one statement names at most (an IN list).
    chunk_steps: int = 400
    #: ... and rank-steps one chunk of a rollup reads at most (one step at 4,096 ranks): a
    #: chunk's rows are held decoded (400 steps of a 4,096-rank run took the worker past
    #: 7 GB after a recovery storm), and the worker steps aside for reads between chunks,
    #: so a chunk is what a read may wait behind (at 32,768 rank-steps a /metrics scrape in
    #: a 4,096-rank storm took up to 1.8 s; bench/faults.py).
    chunk_rank_steps: int = 4_096

    # -- the roll-up worker ---------------------------------------------------------------
    #: Dirty steps one round of the worker takes at most.
    worker_max_steps: int = 256
    #: Seconds between two passes of retention, and of the sweep of shared blocks.
    retention_interval_s: float = 30.0
    #: Seconds a claim on a run is kept without steps to roll up (PostgreSQL).
    claim_idle_s: float = 60.0

    # -- claims between server processes (PostgreSQL advisory locks) ---------------------
    #: The transaction lock that serialises the writes of one run (worker and retention).
    run_write_lock_id: int = 7077
    #: The session lock by which one process's worker claims a run.
    run_claim_lock_id: int = 7078

    # -- the fresh-steps cache (fresh.py) and the blocks shared through the database -----
    #: Rank-steps kept at most: 32 steps of a 4,096-rank run (about 1 KB each).
    fresh_max_rank_steps: int = 131_072
    #: Seconds a step is kept at most: a step is rolled up once its ranks are in (16 s
    #: after its first at 4,096 ranks), or after `rollup_incomplete_s` (30 s) without them.
    fresh_max_age_s: float = 120.0
    #: Rows that wait to be converted together (converting a small group costs as much in
    #: fixed numpy overhead as in per-row work).
    fresh_convert_rows: int = 2_048
    #: Seconds a shared run's stored rank-steps wait before they are converted and
    #: published (with more of them: converting costs as much again in small groups).
    share_delay_s: float = 0.2
    #: Rank-steps the `fresh_blocks` table holds at most (all processes together; ~0.7 KB
    #: each). A shared block older than `fresh_max_age_s` is swept.
    max_shared_rank_steps: int = 262_144
    #: Seconds between two counts of what the `fresh_blocks` table holds (one count a
    #: second, not one a group).
    shared_room_check_s: float = 1.0

    # -- reads first (read_gate.py) ----------------------------------------------------------
    #: Longest the ingest writer or the worker waits for reads in flight, per unit of work.
    gate_max_wait_s: float = 0.05

    # -- memos of readers -------------------------------------------------------------------
    #: Dirty steps whose reader-computed rollups are kept (live_memo.py).
    live_memo_steps: int = 256
    #: The run page's doctor findings kept (read/findings_memo.py): runs, and seconds each
    #: is reused (bounds how long a late rank's change can go unseen).
    findings_runs: int = 64
    findings_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if value < 0:
                    raise ValueError(f"read.{f.name}: must be >= 0, got {value}")
            elif value < 1:
                raise ValueError(f"read.{f.name}: must be >= 1, got {value}")


__all__ = ["ReadTuning"]
