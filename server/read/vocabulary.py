"""The metric vocabulary: every name a series, a rollup, the compare view or the catalog
knows, its unit, and how one rank-step's value of it is read.

A name is one of: a step column (`step_time_s`, `exposed_comm_s`, `hidden_comm_s`,
`thread_cpu_s` and `other_cpu_s` (the step's CPU time on the training thread and on the
process's other threads: CPU runs only), `busy_s`, `grad_norm`, `loss`, `lr`, `loss_scale`,
`samples_per_s`, `tokens_per_s`, `mfu`, `samples`, `tokens`, and the 0/1 flags `skipped`,
`nonfinite`, `clipped`), `phase.<phase>`, `part.<part>` (the exclusive decomposition,
events.STEP_PARTS), `collective.<op>.<field>`
(latency_s: mean latency per call; latency_max_s; bytes; count; busbw, algbw: bandwidth
over the step, weighted by time), `offload.<d2h|h2d>.<bandwidth|bytes|seconds>`,
`memory.peak` (the highest phase peak), `memory.peak.<phase>`, `memory.state` (model state
held, all kinds), `memory.state.<kind>`, `memory.theory.<kind>`, `memory.rss_peak`,
`memory.reserved`, `memory.capacity`, `scalars.<name>`, and the rank's GPU during the step
(NVML, events.GpuTelemetry; docs/gpu.md) `gpu.<field>` for each of GPU_FIELDS, with
`gpu.throttled` (0/1: some sample of the step was throttled), `gpu.power_ratio` (power
over its limit), `gpu.errors` (XID plus uncorrected ECC errors since the agent attached)
and `gpu.reason.<reason>` (0/1: the step's samples saw that slowing reason,
events.GPU_REASON_LABELS; only reasons some rank-step saw).

`busy_s` is the step time less the communication compute did not hide: the time a rank
spends computing. Ranks of a synchronous job share their step time (the fast ones wait in
a collective for the slow one), so busy time is what tells a straggler apart.

Two readers use this vocabulary, and both follow the same definitions: `rank_table` takes
every metric of many rank-steps at once, as numpy columns over the rank-steps (the
compactor's rollups, the fresh-steps cache; `rank_values_of`, the same as one dict per
rank-step, for readers of a few rows: /metrics' outlier ranks, the doctor's named ranks,
the rank and node pages), and a per-rank series reads one metric with SQL (`step_expr`,
`collective_expr`, read/series.py `rank_rows`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
from sqlalchemy import Float, cast, func
from zerowatch.server import models as m

from zerowatch import events as ev

STEP_COLUMNS = {
    "step_time_s": "s",
    "exposed_comm_s": "s",
    "hidden_comm_s": "s",
    "thread_cpu_s": "s",
    "other_cpu_s": "s",
    "grad_norm": "",
    "loss": "",
    "lr": "",
    "loss_scale": "",
    "samples_per_s": "samples/s",
    "tokens_per_s": "tokens/s",
    "mfu": "",
    "samples": "samples",
    "tokens": "tokens",
}
#: Derived from the step columns: computed, not stored.
DERIVED = {"busy_s": "s", "skipped": "", "nonfinite": "", "clipped": ""}
COLLECTIVE_FIELDS = {
    "latency_s": "s",
    "latency_max_s": "s",
    "bytes": "B",
    "count": "calls",
    "busbw": "B/s",
    "algbw": "B/s",
}
OFFLOAD_FIELDS = {"bandwidth": "B/s", "bytes": "B", "seconds": "s"}
MEMORY_SCALARS = {
    "rss_peak": "rss_peak_bytes",
    "reserved": "reserved_bytes",
    "capacity": "capacity_bytes",
}
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
#: Derived from the GPU fields: computed, not stored.
GPU_DERIVED = {"throttled": "", "power_ratio": "", "errors": "errors"}
_NESTED_MEMORY = {"peak": "peak_by_phase", "state": "model_state", "theory": "model_state_theory"}

KEY = r"[A-Za-z0-9_./:\-]{1,100}"
KEY_RE = re.compile(KEY)


class UnknownMetric(ValueError):
    """The metric name is not one the vocabulary knows."""


def _key(name: str, metric: str) -> str:
    if not KEY_RE.fullmatch(name):
        raise UnknownMetric(f"metric {metric!r}: key {name!r} must match {KEY}")
    return name


def metric_unit(metric: str) -> str:
    """The unit of a metric ("s", "B", "B/s", ... or "" for plain numbers)."""
    if metric in STEP_COLUMNS:
        return STEP_COLUMNS[metric]
    if metric in DERIVED:
        return DERIVED[metric]
    head, _, rest = metric.partition(".")
    if head in ("phase", "part"):
        return "s"
    if head == "collective":
        return COLLECTIVE_FIELDS.get(rest.rpartition(".")[2], "")
    if head == "offload":
        return OFFLOAD_FIELDS.get(rest.rpartition(".")[2], "")
    if head == "memory":
        return "B"
    if head == "gpu":
        return GPU_FIELDS.get(rest, GPU_DERIVED.get(rest, ""))
    return ""


def check(metric: str) -> str:
    """Return `metric` if it is a known name, else raise UnknownMetric naming the problem."""
    if metric.startswith("collective."):
        collective_parts(metric)
    elif metric not in ("memory.peak", "memory.state"):  # rollups of several keys
        step_expr(metric)
    return metric


def collective_parts(metric: str) -> tuple[str, str]:
    """(op, field) of a `collective.<op>.<field>` name."""
    _, op, fld = [*metric.split("."), "", ""][:3]
    if op not in ev.COLLECTIVE_OPS or fld not in COLLECTIVE_FIELDS or metric.count(".") != 2:
        raise UnknownMetric(
            f"unknown metric {metric!r}: expected collective.<op>.<field> with op in "
            f"{', '.join(ev.COLLECTIVE_OPS)} and field in {', '.join(COLLECTIVE_FIELDS)}"
        )
    return op, fld


def step_expr(metric: str) -> Any:
    """The SQL expression of a steps-table metric, or None for a collective metric."""
    s = m.steps.c
    if metric in STEP_COLUMNS:
        return s[metric]
    if metric == "busy_s":
        return s.step_time_s - s.exposed_comm_s
    if metric in ("skipped", "nonfinite", "clipped"):
        return cast(s[metric], Float)
    head, _, rest = metric.partition(".")
    if head == "phase" and rest:
        return s.phases[_key(rest, metric)].as_float()
    if head == "part" and rest:
        return s.parts[_key(rest, metric)].as_float()
    if head == "scalars" and rest:
        return s.scalars[_key(rest, metric)].as_float()
    if head == "offload":
        direction, _, fld = rest.partition(".")
        if direction in ("d2h", "h2d") and fld in OFFLOAD_FIELDS:
            return s.offload[(direction, fld)].as_float()
    if head == "memory":
        sub, _, name = rest.partition(".")
        if sub in MEMORY_SCALARS and not name:
            return s.memory[MEMORY_SCALARS[sub]].as_float()
        if sub in _NESTED_MEMORY and name:
            return s.memory[(_NESTED_MEMORY[sub], _key(name, metric))].as_float()
        if sub in ("peak", "state") and not name:
            raise UnknownMetric(
                f"metric {metric!r} is a rollup of several keys: read it from the rollups "
                f"(the default rank selection), or per rank as memory.{sub}.<key>"
            )
    if head == "gpu" and rest in GPU_FIELDS:
        return s.gpu[rest].as_float()
    if head == "gpu" and rest.startswith("reason.") and rest[7:] in ev.GPU_REASON_LABELS:
        bit = next(b for b, n in ev.GPU_THROTTLE_REASONS.items() if n == rest[7:])
        return cast(
            func.coalesce(s.gpu["throttle_reasons"].as_integer(), 0).op("&")(bit) > 0, Float
        )
    if head == "gpu" and rest in GPU_DERIVED:
        g = s.gpu
        return {
            "throttled": cast(g["throttled_fraction"].as_float() > 0, Float),
            "power_ratio": g["power_w"].as_float() / func.nullif(g["power_limit_w"].as_float(), 0),
            "errors": g["xid_errors"].as_float() + g["ecc_errors"].as_float(),
        }[rest]
    if head == "collective":
        return None
    raise UnknownMetric(
        f"unknown metric {metric!r}; see GET /api/v1/runs/{{run_id}}/metrics-catalog"
    )


def collective_expr(metric: str) -> tuple[str, Any]:
    """(op, SQL aggregate over one rank-step's rows) of a collective metric."""
    op, fld = collective_parts(metric)
    c = m.collectives.c
    lat = func.sum(c.latency_sum_s)
    agg = {
        "latency_s": lat / func.nullif(func.sum(c["count"]), 0),
        "latency_max_s": func.max(c.latency_max_s),
        "bytes": func.sum(c.bytes),
        "count": func.sum(c["count"]),
        "algbw": func.sum(c.bytes) * 1.0 / func.nullif(lat, 0),
        "busbw": func.sum(c.busbw * c.latency_sum_s) / func.nullif(lat, 0),
    }[fld]
    return op, agg


# -- one rank-step, every metric at once ---------------------------------------------------

_PLAIN = ("step_time_s", "exposed_comm_s", "hidden_comm_s", *tuple(STEP_COLUMNS)[3:])


def _num(v: Any) -> float | None:
    if type(v) is float:  # the common case first: one type check
        return v if math.isfinite(v) else None
    if v is None or isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


#: (prefix, key) -> the metric name, or "" for a key the vocabulary refuses: a rank-step
#: holds some 50 keyed values and a run a few dozen distinct keys, so each key is checked
#: and named once, not once per rank-step (bounded: user scalars could be many).
_NAMES: dict[tuple[str, str], str] = {}
_MAX_NAMES = 100_000
_NUMBERS = frozenset({float, int, type(None)})


def _name(prefix: str, key: str) -> str:
    name = _NAMES.get((prefix, key))
    if name is None:
        name = f"{prefix}.{key}" if KEY_RE.fullmatch(key) else ""
        if len(_NAMES) < _MAX_NAMES:
            _NAMES[(prefix, key)] = name
    return name


def _floats(values: Sequence[Any]) -> np.ndarray:
    """`values` as float64, NaN where `_num` has no value (None, bools, text, non-finite)."""
    if set(map(type, values)) <= _NUMBERS:
        try:
            a = np.array(values, dtype=float)
        except OverflowError:  # an integer beyond a float
            a = np.array([_num(v) for v in values], dtype=float)
    else:
        a = np.array([_num(v) for v in values], dtype=float)
    bad = ~np.isfinite(a)
    if bad.any():
        a[bad] = np.nan
    return a


class _Table:
    """Metric columns over n rank-steps, NaN where a rank-step has no value."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cols: dict[str, np.ndarray] = {}

    def col(self, name: str) -> np.ndarray:
        c = self.cols.get(name)
        if c is None:
            c = self.cols[name] = np.full(self.n, np.nan)
        return c

    def keyed(self, prefix: str, dicts: Sequence[Any]) -> list[str]:
        """prefix.key columns from one {key: number} per rank-step (None or {} for none);
        returns the names written. Rank-steps whose dicts have the same keys in the same
        order (the usual case) are converted together."""
        shapes: dict[tuple[str, ...], list[int]] = {}
        key_tuples = list(map(tuple, [d or () for d in dicts]))  # in C, not a Python loop
        if (
            key_tuples
            and key_tuples[0]
            and key_tuples.count(key_tuples[0]) == len(dicts)
            and set(map(type, dicts)) == {dict}
        ):
            shapes[key_tuples[0]] = list(range(len(dicts)))  # every rank-step alike
        else:
            for i, keys in enumerate(key_tuples):
                if keys:
                    shapes.setdefault(keys, []).append(i)
        written: dict[str, None] = {}
        for keys, rows in shapes.items():
            names = [_name(prefix, k) for k in keys]
            if len(rows) == len(dicts):
                flat = _floats(list(chain.from_iterable(map(dict.values, dicts))))
            else:
                flat = _floats([v for i in rows for v in dicts[i].values()])
            block = flat.reshape(len(rows), len(keys))
            idx = np.array(rows)
            for j, name in enumerate(names):
                if name:
                    self.col(name)[idx] = block[:, j]
                    written[name] = None
        return list(written)


def rank_table(
    rows: Sequence[Any],
    colls: Sequence[Iterable[Any]],
    *,
    row_index: Mapping[str, int] | None = None,
    coll_index: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Every metric of several rank-steps at once: {metric: float64 array}, one entry per
    rank-step, NaN where it has no finite value. `rows[i]` is a steps row (a mapping by
    column name, JSON columns decoded), `colls[i]` its collectives rows. With `row_index`
    / `coll_index` ({column: position}) the rows are tuples instead (the ingest writer's,
    read/rollups/fresh.py).

    The one definition of a rank-step's metrics (`rank_values_of` is this as one dict per
    rank-step). The compactor calls it with a step's thousands of rows: each column is converted to an
    array once, and the keyed maps (phases, parts, memory) of rank-steps with the same keys
    in one block, instead of one Python operation per value."""
    flat = [c for cs in colls for c in cs]
    at = np.array([i for i, cs in enumerate(colls) for _ in cs], dtype=np.int64)
    return rank_table_of_columns(
        len(rows), _columns(rows, row_index), at, _columns(flat, coll_index) if flat else None
    )


def rank_table_of_columns(
    n: int,
    column: Callable[[str], Sequence[Any]],
    at: np.ndarray,
    coll: Callable[[str], Sequence[Any]] | None,
) -> dict[str, np.ndarray]:
    """`rank_table` of n rank-steps given by columns: `column(name)` a steps column over the
    rank-steps (JSON columns decoded), `coll(name)` a collectives column over their rows
    (None: no rows), `at[j]` the rank-step of collectives row j."""
    t = _Table(n)
    for name in _PLAIN:
        t.cols[name] = _floats(column(name))
    busy = np.array(column("step_time_s"), dtype=float) - np.array(
        column("exposed_comm_s"), dtype=float
    )
    busy[~np.isfinite(busy)] = np.nan
    t.cols["busy_s"] = busy
    for flag in ("skipped", "nonfinite", "clipped"):
        t.cols[flag] = np.array([1.0 if v else 0.0 for v in column(flag)])
    for prefix, name in (("phase", "phases"), ("part", "parts"), ("scalars", "scalars")):
        t.keyed(prefix, column(name))
    for i, off in enumerate(column("offload")):
        for d, vals in (off or {}).items():
            for fld, v in vals.items():
                f = _num(v)
                if f is not None and fld in OFFLOAD_FIELDS:
                    t.col(f"offload.{d}.{fld}")[i] = f
    # A dict (a stored row), or the agent's MemoryStats (the ingest writer's rows).
    mems = [(m if type(m) is dict else vars(m)) if m else {} for m in column("memory")]
    if any(mems):
        for short, long in MEMORY_SCALARS.items():
            a = _floats([m.get(long) for m in mems])
            a[a == 0.0] = np.nan  # a zero reading is no reading
            t.cols[f"memory.{short}"] = a
        for short, long in _NESTED_MEMORY.items():
            names = t.keyed(f"memory.{short}", [m.get(long) for m in mems])
            if names and short == "peak":
                t.cols["memory.peak"] = np.fmax.reduce([t.cols[x] for x in names])
            if names and short == "state":
                block = np.array([t.cols[x] for x in names])
                have = (~np.isnan(block)).any(axis=0)
                total = np.nansum(block, axis=0)
                total[~have] = np.nan
                t.cols["memory.state"] = total
    _gpu_columns(t, column("gpu"))
    # Every collectives row of every rank-step at once; `at` is the rank-step of each.
    if coll is not None:
        ops = coll("op")
        lat_all = np.array(coll("latency_sum_s"), dtype=float)
        count_all = np.array(coll("count"), dtype=float)
        bytes_all = np.array(coll("bytes"), dtype=float)
        busbw_lat_all = np.array(coll("busbw"), dtype=float) * lat_all
        max_all = np.array(coll("latency_max_s"), dtype=float)
        op_of = np.array(ops, dtype=object)
        for op in dict.fromkeys(ops):
            sel = np.flatnonzero(op_of == op)
            idx = at[sel]
            lat = np.bincount(idx, weights=lat_all[sel], minlength=n)
            count = np.bincount(idx, weights=count_all[sel], minlength=n)
            nbytes = np.bincount(idx, weights=bytes_all[sel], minlength=n)
            busbw_lat = np.bincount(idx, weights=busbw_lat_all[sel], minlength=n)
            lat_max = np.zeros(n)
            np.maximum.at(lat_max, idx, max_all[sel])
            has = np.bincount(idx, minlength=n) > 0
            p = f"collective.{op}."
            with np.errstate(divide="ignore", invalid="ignore"):
                for name, value, ok in (
                    ("bytes", nbytes, has),
                    ("count", count, has),
                    ("latency_max_s", lat_max, has),
                    ("latency_s", lat / count, has & (count > 0)),
                    ("algbw", nbytes / lat, has & (lat > 0)),
                    ("busbw", busbw_lat / lat, has & (lat > 0)),
                ):
                    t.cols[p + name] = np.where(ok, value, np.nan)
    return {name: c for name, c in t.cols.items() if not np.isnan(c).all()}


def _gpu_columns(t: _Table, values: Sequence[Any]) -> None:
    """gpu.<field> columns from each rank-step's GpuTelemetry (a stored dict, or the
    agent's dataclass on the ingest writer's rows), and the derived ones."""
    gpus = [(g if type(g) is dict else vars(g)) if g else None for g in values]
    if not any(gpus):
        return
    for fld in GPU_FIELDS:
        t.cols[f"gpu.{fld}"] = _floats([g.get(fld) if g else None for g in gpus])
    throttled = t.cols["gpu.throttled_fraction"]
    t.cols["gpu.throttled"] = np.where(np.isnan(throttled), np.nan, (throttled > 0) * 1.0)
    limit = t.cols["gpu.power_limit_w"]
    with np.errstate(divide="ignore", invalid="ignore"):
        t.cols["gpu.power_ratio"] = np.where(limit > 0, t.cols["gpu.power_w"] / limit, np.nan)
    xid, ecc = t.cols["gpu.xid_errors"], t.cols["gpu.ecc_errors"]
    errors = np.nansum([xid, ecc], axis=0)
    errors[np.isnan(xid) & np.isnan(ecc)] = np.nan
    t.cols["gpu.errors"] = errors
    masks = [g.get("throttle_reasons") if g else None for g in gpus]
    known = np.array([type(x) is int for x in masks])
    ints = np.array([x if type(x) is int else 0 for x in masks], dtype=np.int64)
    for bit, name in ev.GPU_THROTTLE_REASONS.items():
        if name in ev.GPU_REASON_LABELS and (ints & bit).any():
            t.cols[f"gpu.reason.{name}"] = np.where(known, ((ints & bit) > 0) * 1.0, np.nan)


def _columns(
    rows: Sequence[Any], index: Mapping[str, int] | None
) -> Callable[[str], Sequence[Any]]:
    """name -> that column's values over `rows`: mappings by column name (`index` None), or
    tuples with `index` {column: position}, transposed once (in C)."""
    if index is None:
        return lambda name: [r[name] for r in rows]
    if not rows:
        return lambda name: ()
    by_position = list(zip(*rows, strict=True))
    return lambda name: by_position[index[name]]


def rank_values_of(
    rows: Sequence[Mapping[str, Any]], colls: Sequence[Iterable[Mapping[str, Any]]]
) -> list[dict[str, float]]:
    """Every metric of each rank-step, as one {metric: value} per rank-step (one
    `rank_table`): `rows[i]` its steps row (a mapping by column name), `colls[i]` its
    collectives rows. Metrics without a finite value are left out."""
    table = rank_table(rows, colls)
    out: list[dict[str, float]] = [{} for _ in rows]
    for name, col in table.items():
        for i, v in enumerate(col.tolist()):
            if v == v:  # not NaN
                out[i][name] = v
    return out


__all__ = [
    "COLLECTIVE_FIELDS",
    "DERIVED",
    "GPU_DERIVED",
    "GPU_FIELDS",
    "KEY_RE",
    "MEMORY_SCALARS",
    "OFFLOAD_FIELDS",
    "STEP_COLUMNS",
    "UnknownMetric",
    "check",
    "collective_expr",
    "collective_parts",
    "metric_unit",
    "rank_table",
    "rank_values_of",
    "step_expr",
]
