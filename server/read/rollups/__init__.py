"""Per-step rollups across ranks: the read model every page, API read, /metrics, alert input
and the doctor stand on.

A 4,096-rank job stores 4,096 rows a step. Nobody reads them all: a person wants the step's
distribution over ranks and the ranks that stand out. So for every (run, step, metric) the
roll-up worker keeps one `step_rollups` row (stats.py): n, min, p10, p50, p90, max, mean,
the ranks at the min and the max and, for the metrics that name outliers, the `top_k`
ranks at either end. A series over "all ranks" reads one row per step.

Where a rollup value comes from, and why it is right
----------------------------------------------------
A reader (`read`, reader.py) answers a step from exactly one of two sources: its stored
`step_rollups` rows, or, while the step has a `dirty_steps` mark, a rollup computed from the
step's rank-steps (compute.py) as they are now. A computed rollup takes each rank's newest
row, from the fresh-steps cache (fresh.py; published blocks of other processes,
shared_blocks.py) where it holds that exact (rank, seq), and from the stored rows
otherwise; it is memoised by the mark's (version, since) (live_memo.py) and within one read
request by (run, step) (read_gate.request_view). Three invariants make that exact:

1. Ingest writes a step's rows and, in the same transaction, bumps the version of the
   step's mark and sets its `since` (store.py `_mark_dirty`). So (version, since) names one
   state of the step's rows, and anything computed after reading a mark holds at least
   the rows of that version.
2. The worker (worker.py) reads a mark's version, computes the step, and in one
   transaction replaces its rollups and deletes the mark *only if its version is the one
   it read*: a rank that arrived meanwhile bumped the version, so its mark stays and the
   step is rolled up again, late ranks included.
3. A reader reads the marks first and the stored rollups after (each statement may see a
   newer commit): a step rolled up in between is then in one or both (the computed one is
   used), never in neither.

Bounds: a reader computes at most `max_live_steps` dirty steps (the newest) and
`max_live_rank_steps` rank-steps, a quarter of that in a backlog (`backlog_factor`); older
dirty steps wait for the worker. Every size, age and lock id is a field of `ReadTuning`
(tuning.py), which the app owns (`Settings.read`); the caches are the `Database`'s
(caches.py), never a process global.

Modules: stats (Stats, quantiles), columns (a step's metric columns), rows (columns read
from stored rows), compute (a step's rollup, cache or rows), reader (reads), totals (a
run's totals), worker (`RollupWorker`), claims (PostgreSQL advisory locks between
processes), retention (thinning old rows), fresh (the fresh-steps cache), shared_blocks
(its byte format and cross-process table), live_memo, caches, tuning.
"""

from zerowatch.server.read.rollups.caches import ReadCaches, caches_of
from zerowatch.server.read.rollups.compute import compute
from zerowatch.server.read.rollups.reader import (
    dirty_in,
    dirty_versions,
    in_backlog,
    live_steps,
    metric_names,
    newest_rolled_up,
    newest_steps,
    read,
    step_bounds,
)
from zerowatch.server.read.rollups.retention import Retention
from zerowatch.server.read.rollups.stats import Stats
from zerowatch.server.read.rollups.totals import NONFINITE, SKIPPED, hist_key, totals
from zerowatch.server.read.rollups.tuning import ReadTuning
from zerowatch.server.read.rollups.worker import RollupWorker

__all__ = [
    "NONFINITE",
    "SKIPPED",
    "ReadCaches",
    "ReadTuning",
    "Retention",
    "RollupWorker",
    "Stats",
    "caches_of",
    "compute",
    "dirty_in",
    "dirty_versions",
    "hist_key",
    "in_backlog",
    "live_steps",
    "metric_names",
    "newest_rolled_up",
    "newest_steps",
    "read",
    "step_bounds",
    "totals",
]
