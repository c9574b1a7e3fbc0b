"""Compare: the same summary figures for several runs, side by side, from the rollups.

One definition, used by `/api/v1/compare` and the compare page alike: over a run's newest
`window` steps, each figure is the median over those steps of the per-step median over
ranks (p50), except where said otherwise below. The cost follows `window` x metrics per
run, whatever the world size.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from sqlalchemy import Connection, select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.read import rollups, vocabulary

from zerowatch import events as ev

_STATE_KINDS = [*ev.STATE_KINDS, *(f"host_{k}" for k in ev.STATE_KINDS)]
_RUN_FIELDS = ("run_id", "name", "project", "zero_stage", "offload_optimizer", "offload_param",
               "precision", "world_size", "param_count", "engine", "status")  # fmt: skip


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def summary(conn: Connection, row: Any, *, metrics: list[str], window: int) -> dict[str, Any]:
    """One run's compare entry (see `compare`)."""
    pk = int(row.id)
    theory = dict(row.theory or {})
    out: dict[str, Any] = {
        "run": {k: getattr(row, k) for k in _RUN_FIELDS},
        "steps_compared": 0,
        "window": [None, None],
        "model_state_bytes": {
            "measured": {},
            "theory": theory,
            "measured_total": None,
            "theory_total": sum(theory.values()) if theory else None,
        },
        "memory_peak_bytes": None,
        "comm_bytes_per_step": {"measured": {}, "theory": dict(row.theory_comm or {})},
        "step_time_s": None,
        "step_time_mean_s": None,
        "exposed_comm_s": None,
        "hidden_comm_s": None,
        "busy_s": None,
        "phases_s": {},
        "parts_s": {},
        "samples_per_s": None,
        "tokens_per_s": None,
        "metrics": {},
    }
    steps = rollups.newest_steps(conn, pk, "step_time_s", window)
    if not steps:
        return out
    names = [
        "step_time_s", "exposed_comm_s", "hidden_comm_s", "busy_s", "samples_per_s",
        "tokens_per_s", "memory.peak", "memory.state",
        *(f"phase.{p}" for p in ev.PHASES), *(f"part.{p}" for p in ev.STEP_PARTS),
        *(f"memory.state.{k}" for k in _STATE_KINDS),
        *(f"collective.{op}.bytes" for op in ev.COLLECTIVE_OPS), *metrics,
    ]  # fmt: skip
    got = rollups.read(conn, pk, list(dict.fromkeys(names)), steps_in=steps)

    def p50s(name: str) -> list[float]:
        return [st.p50 for st in got[name].values()]

    def means(name: str) -> list[float]:
        return [st.mean for st in got[name].values()]

    out["steps_compared"] = len(got["step_time_s"])
    out["window"] = [steps[0], steps[-1]]
    for name in ("step_time_s", "exposed_comm_s", "hidden_comm_s", "busy_s"):
        out[name] = _median(p50s(name))
    for name in ("samples_per_s", "tokens_per_s"):  # the job's: the sum over ranks
        out[name] = _median([st.mean * st.n for st in got[name].values()])
    out["phases_s"] = {p: _median(p50s(f"phase.{p}")) for p in ev.PHASES if got[f"phase.{p}"]}
    # Parts are stacked: means add up (over ranks and over steps) where medians do not, so
    # the parts' means sum to the mean step time, given beside them.
    out["step_time_mean_s"] = _mean(means("step_time_s"))
    out["parts_s"] = {p: _mean(means(f"part.{p}")) for p in ev.STEP_PARTS if got[f"part.{p}"]}
    newest = max(got["memory.state"], default=None)
    if newest is not None:
        measured = {
            k: got[f"memory.state.{k}"][newest].p50
            for k in _STATE_KINDS
            if newest in got[f"memory.state.{k}"]
        }
        out["model_state_bytes"]["measured"] = measured
        out["model_state_bytes"]["measured_total"] = got["memory.state"][newest].p50
    peaks = [st.max for st in got["memory.peak"].values()]
    out["memory_peak_bytes"] = max(peaks) if peaks else None
    out["comm_bytes_per_step"]["measured"] = {
        op: _median(p50s(f"collective.{op}.bytes"))
        for op in ev.COLLECTIVE_OPS
        if got[f"collective.{op}.bytes"]
    }
    for metric in metrics:
        out["metrics"][metric] = _median(p50s(metric))
    return out


def compare(
    *, db: Database, run_ids: list[str], metrics: list[str] | None = None, window: int = 100
) -> dict[str, Any]:
    """The same summary figures for several runs, side by side.

    Per run, over its newest `window` steps: model-state bytes per rank by kind and in
    total (p50 over ranks at the newest step) next to the theory; the highest memory peak
    of any rank in the window; bytes per step of each collective op (median of the p50s,
    nccl-tests size) next to the theory; step time, exposed and hidden communication, busy
    time and each phase (medians of the p50s); each exclusive part and the step time as
    means over ranks and steps (`parts_s`, `step_time_mean_s`: a stack of the parts meets
    the mean step time); the job's samples/s
    and tokens/s (medians of the per-step sums over ranks); and the median of the p50s of
    each extra metric in `metrics`.

    Returns:
        {"runs": [...] in the order asked, "missing": [run ids not found]}.

    Raises:
        UnknownMetric: a name in `metrics` is not in the vocabulary.
    """
    metrics = [vocabulary.check(x) for x in metrics or []]
    out, missing = [], []
    with db.read() as conn:
        for run_id in run_ids:
            row = conn.execute(select(m.runs).where(m.runs.c.run_id == run_id)).first()
            if row is None:
                missing.append(run_id)
                continue
            out.append(summary(conn, row, metrics=metrics, window=window))
    return {"runs": out, "missing": missing}


__all__ = ["compare", "summary"]
