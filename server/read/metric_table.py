"""The metric table: each step metric's name, unit, SQL expression, per-rank extractor and
statistics, defined once.

A step metric is one value per rank-step. `STEP_METRICS` lists the ones read from the steps
table's own columns (or derived from them); `COLLECTIVE_FIELDS` the fields of
`collective.<op>.<field>`, each an aggregate of the rank-step's rows of that op (busbw is
weighted by time here, for SQL and numpy alike); `FAMILIES` the keyed families read from
a JSON column (`phase.<phase>`, `memory.<kind>.<key>`, ...), with their units (their
extraction is vocabulary.py's, one function per family for SQL and one for numpy).

Every reader takes its definitions from here: the rollups' numpy columns
(vocabulary.rank_table), the per-rank series' SQL (vocabulary.step_expr and
collective_expr), the units of the pages and the API (vocabulary.metric_unit), the
columns the store writes (store.STEP_COLUMNS) and a rollup reads (`ROLLUP_COLUMNS`), the
statistics of a rollup (`STATS`, `OUTLIER_METRICS`) and /metrics. Adding a step metric is
one entry here (with its column in models.py and its field in events.StepEvent).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Float, Integer, cast, func

from zerowatch import events as ev

#: Counts in a collective's latency histogram: one per LATENCY_BUCKETS bucket, +Inf last.
N_BUCKETS = len(ev.LATENCY_BUCKETS) + 1
#: The statistics of a rollup (one metric of one step over its ranks).
STATS = ("min", "p10", "p50", "p90", "max", "mean")


# -- numbers --------------------------------------------------------------------------------

_NUMBERS = frozenset({float, int, type(None)})


def num(v: Any) -> float | None:
    """A finite float of a stored value, or None (None, bools, text, non-finite)."""
    if type(v) is float:  # the common case first: one type check
        return v if math.isfinite(v) else None
    if v is None or isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def floats(values: Sequence[Any]) -> np.ndarray:
    """`values` as float64, NaN where `num` has no value."""
    if set(map(type, values)) <= _NUMBERS:
        try:
            a = np.array(values, dtype=float)
        except OverflowError:  # an integer beyond a float
            a = np.array([num(v) for v in values], dtype=float)
    else:
        a = np.array([num(v) for v in values], dtype=float)
    bad = ~np.isfinite(a)
    if bad.any():
        a[bad] = np.nan
    return a


# -- metrics of the steps table's columns -----------------------------------------------------


def _difference(a: Sequence[Any], b: Sequence[Any]) -> np.ndarray:
    d = np.array(a, dtype=float) - np.array(b, dtype=float)
    d[~np.isfinite(d)] = np.nan
    return d


def _flag(values: Sequence[Any]) -> np.ndarray:
    return np.array([1.0 if v else 0.0 for v in values])


@dataclass(frozen=True, slots=True)
class StepMetric:
    """A metric read from the steps table's columns.

    `reads` are the columns it is computed from; `sql(s)` its expression over the steps
    table's columns `s` and `rank(*columns)` its values over rank-steps from those columns
    (float64, NaN: none); both default to the one column as a number. `outliers`: its
    rollups keep the ranks at both ends."""

    name: str
    unit: str
    reads: tuple[str, ...] = ()
    sql: Callable[[Any], Any] | None = None
    rank: Callable[..., np.ndarray] = floats
    outliers: bool = False

    @property
    def columns(self) -> tuple[str, ...]:
        return self.reads or (self.name,)

    def expr(self, s: Any) -> Any:
        """Its SQL expression over the steps table's columns `s`."""
        return self.sql(s) if self.sql is not None else s[self.name]


def _as_float(column: str) -> Callable[[Any], Any]:
    """A 0/1 flag column as a float (through an integer: PostgreSQL casts no boolean to a
    float)."""
    return lambda s: cast(cast(s[column], Integer), Float)


STEP_METRICS = (
    StepMetric("step_time_s", "s", outliers=True),
    StepMetric("exposed_comm_s", "s", outliers=True),
    StepMetric("hidden_comm_s", "s"),
    #: The step's CPU time on the training thread and on the process's other threads.
    StepMetric("thread_cpu_s", "s"),
    StepMetric("other_cpu_s", "s"),
    StepMetric("grad_norm", ""),
    StepMetric("loss", ""),
    StepMetric("lr", ""),
    StepMetric("loss_scale", ""),
    StepMetric("samples_per_s", "samples/s"),
    StepMetric("tokens_per_s", "tokens/s"),
    StepMetric("mfu", ""),
    StepMetric("samples", "samples"),
    StepMetric("tokens", "tokens"),
    #: The step time less the communication compute did not hide: the time a rank spends
    #: computing (what tells a straggler apart: ranks of a synchronous job share their
    #: step time).
    StepMetric(
        "busy_s",
        "s",
        reads=("step_time_s", "exposed_comm_s"),
        sql=lambda s: s.step_time_s - s.exposed_comm_s,
        rank=_difference,
        outliers=True,
    ),
    StepMetric("skipped", "", sql=_as_float("skipped"), rank=_flag),
    StepMetric("nonfinite", "", sql=_as_float("nonfinite"), rank=_flag),
    StepMetric("clipped", "", sql=_as_float("clipped"), rank=_flag),
)
STEP_METRIC = {metric.name: metric for metric in STEP_METRICS}


# -- collective.<op>.<field> ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CollectiveField:
    """A field of `collective.<op>.<field>`: over a rank-step's rows of the op, the sum
    (`agg="max"`: the max) of the product of the `of` columns, divided by the sum of `per`
    where given (no value where that sum is 0)."""

    name: str
    unit: str
    of: tuple[str, ...]
    per: str | None = None
    agg: str = "sum"

    def expr(self, c: Any) -> Any:
        """Its SQL aggregate over one rank-step's collectives rows `c` of the op."""
        value = c[self.of[0]]
        for col in self.of[1:]:
            value = value * c[col]
        total = func.max(value) if self.agg == "max" else func.sum(value)
        if self.per is None:
            return total
        return total * 1.0 / func.nullif(func.sum(c[self.per]), 0)


COLLECTIVE_FIELDS = (
    CollectiveField("latency_s", "s", of=("latency_sum_s",), per="count"),  # per call
    CollectiveField("latency_max_s", "s", of=("latency_max_s",), agg="max"),
    CollectiveField("bytes", "B", of=("bytes",)),
    CollectiveField("count", "calls", of=("count",)),
    #: Over the step, weighted by time: each row's bandwidth by its latency sum.
    CollectiveField("busbw", "B/s", of=("busbw", "latency_sum_s"), per="latency_sum_s"),
    CollectiveField("algbw", "B/s", of=("bytes",), per="latency_sum_s"),
)
COLLECTIVE_FIELD = {f.name: f for f in COLLECTIVE_FIELDS}
#: The collectives columns the fields read.
COLLECTIVE_READS = tuple(
    dict.fromkeys(c for f in COLLECTIVE_FIELDS for c in (*f.of, *((f.per,) if f.per else ())))
)


# -- keyed families of JSON columns ---------------------------------------------------------

#: prefix -> the JSON column its keys come from.
FAMILIES = {
    "phase": "phases",
    "part": "parts",
    "scalars": "scalars",
    "offload": "offload",
    "memory": "memory",
    "gpu": "gpu",
}
#: Units of the keyed families: the family's, or by field where fields differ.
FAMILY_UNITS = {"phase": "s", "part": "s", "memory": "B", "scalars": ""}
OFFLOAD_FIELDS = {"bandwidth": "B/s", "bytes": "B", "seconds": "s"}
#: memory.<name> -> the MemoryStats field it reads.
MEMORY_SCALARS = {
    "rss_peak": "rss_peak_bytes",
    "reserved": "reserved_bytes",
    "capacity": "capacity_bytes",
}
#: memory.<name>.<key> -> the MemoryStats map it reads; `memory.peak` and `memory.state`
#: alone are the highest phase peak and the model state held, all kinds.
MEMORY_MAPS = {"peak": "peak_by_phase", "state": "model_state", "theory": "model_state_theory"}
#: The numeric fields of events.GpuTelemetry, with their units.
GPU_FIELDS = {
    "sm_clock_mhz": "MHz",
    "sm_clock_max_mhz": "MHz",
    "mem_clock_mhz": "MHz",
    "sm_clock_ratio": "",
    "throttled_fraction": "",
    "temperature_c": "°C",
    "power_w": "W",
    "power_limit_w": "W",
    "xid_errors": "errors",
    "ecc_errors": "errors",
    "remapped_rows": "rows",
    "pcie_tx_bytes_per_s": "B/s",
    "pcie_rx_bytes_per_s": "B/s",
    "nvlink_tx_bytes_per_s": "B/s",
    "nvlink_rx_bytes_per_s": "B/s",
}
#: Derived from the GPU fields (0/1 `throttled`, power over its limit, XID plus ECC errors).
GPU_DERIVED = {"throttled": "", "power_ratio": "", "errors": "errors"}


# -- statistics and columns -----------------------------------------------------------------

#: Metrics whose rollups keep the ranks at both ends (outlier tables, /metrics' per-rank
#: series, the doctor's straggler finding).
OUTLIER_METRICS = frozenset(
    {
        *(metric.name for metric in STEP_METRICS if metric.outliers),
        "memory.peak",
        "memory.state",
        *(f"collective.{op}.busbw" for op in ev.COLLECTIVE_OPS),
        *(f"collective.{op}.latency_s" for op in ev.COLLECTIVE_OPS),
        *(f"part.{p}" for p in ev.STEP_PARTS),
    }
)
#: The steps columns the step metrics read, in the table's order.
METRIC_COLUMNS = tuple(dict.fromkeys(c for metric in STEP_METRICS for c in metric.columns))
#: The steps columns a rollup (or a rank's values) reads: a rank-step's keys, then what the
#: metrics and the families read.
ROLLUP_COLUMNS = ("rank", "seq", "step", *METRIC_COLUMNS, *FAMILIES.values())


def unit(metric: str) -> str:
    """The unit of a metric ("s", "B", "B/s", ... or "" for plain numbers)."""
    step = STEP_METRIC.get(metric)
    if step is not None:
        return step.unit
    head, _, rest = metric.partition(".")
    if head in FAMILY_UNITS:
        return FAMILY_UNITS[head]
    field = rest.rpartition(".")[2]
    if head == "collective":
        return COLLECTIVE_FIELD[field].unit if field in COLLECTIVE_FIELD else ""
    if head == "offload":
        return OFFLOAD_FIELDS.get(field, "")
    if head == "gpu":
        return GPU_FIELDS.get(rest, GPU_DERIVED.get(rest, ""))
    return ""


__all__ = [
    "COLLECTIVE_FIELD",
    "COLLECTIVE_FIELDS",
    "COLLECTIVE_READS",
    "FAMILIES",
    "FAMILY_UNITS",
    "GPU_DERIVED",
    "GPU_FIELDS",
    "MEMORY_MAPS",
    "MEMORY_SCALARS",
    "METRIC_COLUMNS",
    "N_BUCKETS",
    "OFFLOAD_FIELDS",
    "OUTLIER_METRICS",
    "ROLLUP_COLUMNS",
    "STATS",
    "STEP_METRIC",
    "STEP_METRICS",
    "CollectiveField",
    "StepMetric",
    "floats",
    "num",
    "unit",
]
