"""The metric vocabulary: every name a series, a rollup, the compare view or the catalog
knows, and how one rank-step's value of it is read, for many rank-steps at once (numpy) and
for one per-rank series (SQL), both from the definitions of metric_table.py (names, units,
expressions, the collective fields' aggregates).

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

Two readers use this vocabulary, and both follow the same definitions: `rank_table` takes
every metric of many rank-steps at once, as numpy columns over the rank-steps (the
rollups, the fresh-steps cache; `rank_values_of`, the same as one dict per
rank-step, for readers of a few rows: /metrics' outlier ranks, the doctor's named ranks,
the rank and node pages), and a per-rank series reads one metric with SQL (`step_expr`,
`collective_expr`, read/series.py `rank_rows`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
from sqlalchemy import Float, cast, func
from zerowatch.server import models as m
from zerowatch.server.read.metric_table import (
    COLLECTIVE_FIELD,
    COLLECTIVE_FIELDS,
    GPU_DERIVED,
    GPU_FIELDS,
    MEMORY_MAPS,
    MEMORY_SCALARS,
    OFFLOAD_FIELDS,
    STEP_METRIC,
    STEP_METRICS,
    floats,
    num,
)
from zerowatch.server.read.metric_table import unit as metric_unit

from zerowatch import events as ev

KEY = r"[A-Za-z0-9_./:\-]{1,100}"
KEY_RE = re.compile(KEY)


class UnknownMetric(ValueError):
    """The metric name is not one the vocabulary knows."""


def _key(name: str, metric: str) -> str:
    if not KEY_RE.fullmatch(name):
        raise UnknownMetric(f"metric {metric!r}: key {name!r} must match {KEY}")
    return name


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
    if op not in ev.COLLECTIVE_OPS or fld not in COLLECTIVE_FIELD or metric.count(".") != 2:
        raise UnknownMetric(
            f"unknown metric {metric!r}: expected collective.<op>.<field> with op in "
            f"{', '.join(ev.COLLECTIVE_OPS)} and field in {', '.join(COLLECTIVE_FIELD)}"
        )
    return op, fld


def step_expr(metric: str) -> Any:
    """The SQL expression of a steps-table metric, or None for a collective metric."""
    s = m.steps.c
    step = STEP_METRIC.get(metric)
    if step is not None:
        return step.expr(s)
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
        if sub in MEMORY_MAPS and name:
            return s.memory[(MEMORY_MAPS[sub], _key(name, metric))].as_float()
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
    """(op, SQL aggregate over one rank-step's rows) of a collective metric (its field's
    definition: metric_table.COLLECTIVE_FIELDS)."""
    op, fld = collective_parts(metric)
    return op, COLLECTIVE_FIELD[fld].expr(m.collectives.c)


# -- one rank-step, every metric at once ---------------------------------------------------

#: (prefix, key) -> the metric name, or "" for a key the vocabulary refuses: a rank-step
#: holds some 50 keyed values and a run a few dozen distinct keys, so each key is checked
#: and named once, not once per rank-step (bounded: user scalars could be many).
_NAMES: dict[tuple[str, str], str] = {}
_MAX_NAMES = 100_000


def _name(prefix: str, key: str) -> str:
    name = _NAMES.get((prefix, key))
    if name is None:
        name = f"{prefix}.{key}" if KEY_RE.fullmatch(key) else ""
        if len(_NAMES) < _MAX_NAMES:
            _NAMES[(prefix, key)] = name
    return name


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
                flat = floats(list(chain.from_iterable(map(dict.values, dicts))))
            else:
                flat = floats([v for i in rows for v in dicts[i].values()])
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
    rank-step). The roll-up worker calls it with a step's thousands of rows: each column is converted to an
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
    for metric in STEP_METRICS:
        t.cols[metric.name] = metric.rank(*map(column, metric.columns))
    for prefix, name in (("phase", "phases"), ("part", "parts"), ("scalars", "scalars")):
        t.keyed(prefix, column(name))
    for i, off in enumerate(column("offload")):
        for d, vals in (off or {}).items():
            for fld, v in vals.items():
                f = num(v)
                if f is not None and fld in OFFLOAD_FIELDS:
                    t.col(f"offload.{d}.{fld}")[i] = f
    # A dict (a stored row), or the agent's MemoryStats (the ingest writer's rows).
    mems = [(m if type(m) is dict else vars(m)) if m else {} for m in column("memory")]
    if any(mems):
        for short, long in MEMORY_SCALARS.items():
            a = floats([m.get(long) for m in mems])
            a[a == 0.0] = np.nan  # a zero reading is no reading
            t.cols[f"memory.{short}"] = a
        for short, long in MEMORY_MAPS.items():
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
    if coll is not None:
        _collective_columns(t, coll, at)
    return {name: c for name, c in t.cols.items() if not np.isnan(c).all()}


#: The products of collectives columns summed over a rank-step's rows of an op: the summed
#: fields' and the sums they are divided by.
_SUMMED = tuple(
    dict.fromkeys(
        [f.of for f in COLLECTIVE_FIELDS if f.agg == "sum"]
        + [(f.per,) for f in COLLECTIVE_FIELDS if f.per is not None]
    )
)


def _collective_columns(t: _Table, coll: Callable[[str], Sequence[Any]], at: np.ndarray) -> None:
    """collective.<op>.<field> columns of every collectives row of every rank-step at once
    (`at[j]`: the rank-step of row j), each field as metric_table.COLLECTIVE_FIELDS defines
    it: per op a sum (or max) over each rank-step's rows, divided by another sum."""
    n = t.n
    ops = coll("op")
    op_of = np.array(ops, dtype=object)
    cols: dict[str, np.ndarray] = {}

    def column(name: str) -> np.ndarray:
        if name not in cols:
            cols[name] = np.array(coll(name), dtype=float)
        return cols[name]

    def product(of: tuple[str, ...]) -> np.ndarray:
        key = "*".join(of)
        if key not in cols:
            cols[key] = np.prod([column(c) for c in of], axis=0)
        return cols[key]

    for op in dict.fromkeys(ops):
        sel = np.flatnonzero(op_of == op)
        idx = at[sel]
        has = np.bincount(idx, minlength=n) > 0
        # Each sum over the op's rows once, whichever fields divide or are divided by it.
        sums = {of: np.bincount(idx, weights=product(of)[sel], minlength=n) for of in _SUMMED}
        p = f"collective.{op}."
        for f in COLLECTIVE_FIELDS:
            value: np.ndarray
            if f.agg == "max":
                value = np.zeros(n)
                np.maximum.at(value, idx, product(f.of)[sel])
            else:
                value = sums[f.of]
            ok = has
            if f.per is not None:
                den = sums[(f.per,)]
                with np.errstate(divide="ignore", invalid="ignore"):
                    value = value / den
                ok = has & (den > 0)
            t.cols[p + f.name] = np.where(ok, value, np.nan)


def _gpu_columns(t: _Table, values: Sequence[Any]) -> None:
    """gpu.<field> columns from each rank-step's GpuTelemetry (a stored dict, or the
    agent's dataclass on the ingest writer's rows), and the derived ones."""
    gpus = [(g if type(g) is dict else vars(g)) if g else None for g in values]
    if not any(gpus):
        return
    for fld in GPU_FIELDS:
        t.cols[f"gpu.{fld}"] = floats([g.get(fld) if g else None for g in gpus])
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
    "KEY_RE",
    "UnknownMetric",
    "check",
    "collective_expr",
    "collective_parts",
    "metric_unit",
    "rank_table",
    "rank_values_of",
    "step_expr",
]
