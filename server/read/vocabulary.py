"""The metric vocabulary: every name a series, a rollup, the compare view or the catalog
knows, its unit, and how one rank-step's value of it is read.

A name is one of: a step column (`step_time_s`, `exposed_comm_s`, `hidden_comm_s`,
`busy_s`, `grad_norm`, `loss`, `lr`, `loss_scale`, `samples_per_s`, `tokens_per_s`, `mfu`,
`samples`, `tokens`, and the 0/1 flags `skipped`, `nonfinite`, `clipped`), `phase.<phase>`,
`part.<part>` (the exclusive decomposition, events.STEP_PARTS), `collective.<op>.<field>`
(latency_s: mean latency per call; latency_max_s; bytes; count; busbw, algbw: bandwidth
over the step, weighted by time), `offload.<d2h|h2d>.<bandwidth|bytes|seconds>`,
`memory.peak` (the highest phase peak), `memory.peak.<phase>`, `memory.state` (model state
held, all kinds), `memory.state.<kind>`, `memory.theory.<kind>`, `memory.rss_peak`,
`memory.reserved`, `memory.capacity`, `scalars.<name>`.

`busy_s` is the step time less the communication compute did not hide: the time a rank
spends computing. Ranks of a synchronous job share their step time (the fast ones wait in
a collective for the slow one), so busy time is what tells a straggler apart.

Two readers use this vocabulary: the rollup compactor takes every value of a rank-step at
once (`rank_values`, plain Python over the stored row), and a per-rank series reads one
metric with SQL (`step_expr`, `collective_expr`). Both follow the same definitions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Float, cast, func
from zerowatch.server import models as m

from zerowatch import events as ev

STEP_COLUMNS = {
    "step_time_s": "s",
    "exposed_comm_s": "s",
    "hidden_comm_s": "s",
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


def _name(prefix: str, key: str) -> str:
    name = _NAMES.get((prefix, key))
    if name is None:
        name = f"{prefix}.{key}" if KEY_RE.fullmatch(key) else ""
        if len(_NAMES) < _MAX_NAMES:
            _NAMES[(prefix, key)] = name
    return name


def _put(out: dict[str, float], prefix: str, values: Mapping[str, Any]) -> None:
    """out[prefix.key] = value for each key the vocabulary knows and finite number."""
    names = _NAMES
    for k, v in values.items():
        name = names.get((prefix, k)) or _name(prefix, k)
        if not name:
            continue
        if type(v) is float:  # the common case: no call
            if v - v == 0.0:  # finite (inf - inf and nan - nan are nan)
                out[name] = v
        else:
            f = _num(v)
            if f is not None:
                out[name] = f


def rank_values(row: Mapping[str, Any], colls: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Every metric of one rank-step: `row` is its steps row (a mapping by column name),
    `colls` its collectives rows. Metrics without a finite value are left out.

    This runs for every rank-step the compactor rolls up: the common cases (finite floats,
    keys seen before) take no function call."""
    out: dict[str, float] = {}
    for name in _PLAIN:
        v = row[name]
        if type(v) is float:
            if v - v == 0.0:
                out[name] = v
        else:
            f = _num(v)
            if f is not None:
                out[name] = f
    out["busy_s"] = float(row["step_time_s"]) - float(row["exposed_comm_s"])
    out["skipped"] = 1.0 if row["skipped"] else 0.0
    out["nonfinite"] = 1.0 if row["nonfinite"] else 0.0
    out["clipped"] = 1.0 if row["clipped"] else 0.0
    for prefix, col in (("phase", "phases"), ("part", "parts"), ("scalars", "scalars")):
        d = row[col]
        if d:
            _put(out, prefix, d)
    for d, vals in (row["offload"] or {}).items():
        for fld, v in vals.items():
            f = _num(v)
            if f is not None and fld in OFFLOAD_FIELDS:
                out[f"offload.{d}.{fld}"] = f
    mem = row["memory"]
    if mem:
        for short, long in MEMORY_SCALARS.items():
            f = _num(mem.get(long))
            if f:
                out[f"memory.{short}"] = f
        for short, long in _NESTED_MEMORY.items():
            inner = mem.get(long)
            if not inner:
                continue
            before = len(out)
            mark = dict.fromkeys(out)
            _put(out, f"memory.{short}", inner)
            if len(out) > before and short in ("peak", "state"):
                vals = [v for k, v in out.items() if k not in mark]
                if short == "peak":
                    out["memory.peak"] = max(vals)
                else:
                    out["memory.state"] = sum(vals)
    per_op: dict[str, list[float]] = {}
    for c in colls:
        acc = per_op.setdefault(c["op"], [0.0, 0.0, 0.0, 0.0, 0.0])
        acc[0] += c["latency_sum_s"]
        acc[1] += c["count"]
        acc[2] += c["bytes"]
        acc[3] += c["busbw"] * c["latency_sum_s"]
        acc[4] = max(acc[4], c["latency_max_s"])
    for op, (lat, count, nbytes, busbw_lat, lat_max) in per_op.items():
        p = f"collective.{op}."
        out[p + "bytes"] = nbytes
        out[p + "count"] = count
        out[p + "latency_max_s"] = lat_max
        if count > 0:
            out[p + "latency_s"] = lat / count
        if lat > 0:
            out[p + "algbw"] = nbytes / lat
            out[p + "busbw"] = busbw_lat / lat
    return out


__all__ = [
    "COLLECTIVE_FIELDS",
    "DERIVED",
    "KEY_RE",
    "MEMORY_SCALARS",
    "OFFLOAD_FIELDS",
    "STEP_COLUMNS",
    "UnknownMetric",
    "check",
    "collective_expr",
    "collective_parts",
    "metric_unit",
    "rank_values",
    "step_expr",
]
