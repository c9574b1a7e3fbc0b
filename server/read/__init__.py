"""Reads: the one read model every page, API route, /metrics, alert input and the doctor use.

Each module is one concept: `metric_table` (each step metric's name, unit, SQL, numpy
extractor and statistics, defined once), `vocabulary` (metric names and how a rank-step's
value is read, from the table's definitions), `rollups` (a package: per-step statistics over ranks, where each value comes from
and why it is right, the roll-up worker and the caches the `Database` owns), `runs`
(the run resource, ranks and hosts, recent figures), `series` (a metric over steps: rank
statistics or selected ranks; breakdown, heatmap, outliers), `compare` (runs side by
side), `trace` (Chrome-trace export), `jobs` (a run's checkpoint calls; the runs of one
job across restarts and where its time went), and the doctor: `doctor` (the entry,
`findings`), `doctor_evidence` (what it reads), `doctor_checks` (the table of checks, one
function per kind of finding, in `doctor_ranks`, `doctor_comm`, `doctor_memory`,
`doctor_training` and `doctor_stage`; `doctor_measured` the run as the planner sees it,
`doctor_finding` the `Finding`), `doctor_figures` (the run's named figures: step time,
exposed share, straggler), `doctor_crash` (the crash findings), `doctor_settings` (the
thresholds) and
`forensics` (hang and desync findings from the ranks' heartbeats).

The functions a route calls are keyword-only, take the `Database` as `db` and return plain
data ready for JSON. The readers they are built of take an open `Connection` and the run's
key, so the reads of one answer share a transaction; the doctor's checks and forensics are
pure functions of what was read. The package exports the names that do not
shadow its modules: `series.series`, `compare.compare`, `trace.trace`, `doctor.findings`
and the others are reached through their modules.
"""

from zerowatch.server.read.rollups import Retention, RollupWorker
from zerowatch.server.read.runs import get_run, hosts_of, list_runs, ranks_of, run_record
from zerowatch.server.read.series import (
    BadSelection,
    Selection,
    metrics_catalog,
    rank_heatmap,
    step_breakdown,
)
from zerowatch.server.read.vocabulary import UnknownMetric, metric_unit

__all__ = [
    "BadSelection",
    "Retention",
    "RollupWorker",
    "Selection",
    "UnknownMetric",
    "get_run",
    "hosts_of",
    "list_runs",
    "metric_unit",
    "metrics_catalog",
    "rank_heatmap",
    "ranks_of",
    "run_record",
    "step_breakdown",
]
