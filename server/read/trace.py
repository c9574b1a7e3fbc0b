"""Trace: a run's steps as Chrome-trace / Perfetto JSON (`zerowatch trace`, the API).

Per rank: a slice per step (from the stored step times) and, for the steps the agent
sampled, the raw phase / collective / offload spans. Reads rows of the ranks and steps it
shows, so its cost follows the (bounded) range it exports.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.read.runs import run_pk

_TIDS = {"step": 0, "phase": 1, "collective": 2, "offload": 3}
#: Spans one export carries at most (Settings.max_trace_spans): what the server holds and
#: sends for one request stays bounded (~400 bytes a span in memory, ~150 in the JSON).
MAX_SPANS = 250_000


def trace(
    *,
    db: Database,
    run_id: str,
    step_from: int | None = None,
    step_to: int | None = None,
    max_steps: int = 200,
    max_spans: int = MAX_SPANS,
) -> dict[str, Any] | None:
    """Chrome-trace / Perfetto JSON of a run's steps.

    One process (pid) per rank, named "rank N", with threads "steps" (one slice per step,
    from the stored step times), "phases", "collectives" and "offload" (the raw spans of
    the steps the agent sampled). Slices are complete events ("ph": "X"), times in
    microseconds since the earliest slice. Without a range: the newest `max_steps` steps;
    a range is cut to `max_steps` steps from its start. The sampled steps' spans stop at
    `max_spans` (rank by rank, step by step); `metadata.cut` then says how many were left
    out, and the API says so in a header.

    Returns:
        {"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}}, or None.
    """
    with db.read() as conn:
        pk = run_pk(conn, run_id)
        if pk is None:
            return None
        s = m.steps.c
        if step_from is None and step_to is None:
            last = conn.execute(select(func.max(s.step)).where(s.run == pk)).scalar()
            hi = int(last) if last is not None else 0
            lo = max(0, hi - max_steps + 1)
        else:
            lo = step_from if step_from is not None else 0
            hi = step_to if step_to is not None else lo + max_steps - 1
        hi = min(hi, lo + max_steps - 1)
        step_rows = conn.execute(
            select(s.rank, s.step, s.time, s.step_time_s, s.parts, s.hidden_comm_s)
            .where(s.run == pk, s.step >= lo, s.step <= hi)
            .order_by(s.rank, s.step)
        ).all()
        sp = m.spans.c
        span_rows = []
        budget, left_out = max_spans, 0
        result = conn.execution_options(stream_results=True, yield_per=256).execute(
            select(sp.rank, sp.step, sp.spans)
            .where(sp.run == pk, sp.step >= lo, sp.step <= hi)
            .order_by(sp.rank, sp.step)
        )
        for row in result:
            n = len(row.spans or ())
            if n > budget:
                left_out += n
                budget = 0
                continue
            budget -= n
            span_rows.append(row)
    slices: list[tuple[int, int, str, str, float, float, dict[str, Any]]] = []
    for r in step_rows:
        slices.append(
            (
                r.rank,
                0,
                f"step {r.step}",
                "step",
                r.time - r.step_time_s,
                r.time,
                # The exclusive parts (they add up to the step) and what compute hid, so a
                # step's slice in the viewer says where its time went (docs/timing.md).
                {
                    "step": r.step,
                    "step_time_s": r.step_time_s,
                    "parts_s": dict(r.parts or {}),
                    "hidden_comm_s": r.hidden_comm_s,
                },
            )
        )
    for r in span_rows:
        for span in r.spans or []:
            cat = str(span.get("cat", "phase"))
            args = dict(span.get("args") or {})
            args["step"] = r.step
            slices.append(
                (
                    r.rank,
                    _TIDS.get(cat, 1),
                    str(span.get("name", "?")),
                    cat,
                    float(span["start"]),
                    float(span["end"]),
                    args,
                )
            )
    t0 = min((x[4] for x in slices), default=0.0)
    events: list[dict[str, Any]] = []
    for rank in sorted({x[0] for x in slices}):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
        for tname, tid in _TIDS.items():
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": tname + "s" if tname != "offload" else tname},
                }
            )
    for rank, tid, name, cat, start, end, args in slices:
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat,
                "pid": rank,
                "tid": tid,
                "ts": round((start - t0) * 1e6, 3),
                "dur": round(max(end - start, 0.0) * 1e6, 3),
                "args": args,
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {
            "run_id": run_id,
            "steps": [lo, hi],
            "t0_unix_s": t0,
            "sampled_steps": sorted({int(r.step) for r in span_rows}),
            "cut": {"spans_left_out": left_out, "max_spans": max_spans} if left_out else None,
            # Phase, collective and offload spans are what the agent sends for every
            # `spans_every`-th step (10 by default); the other steps are step slices only.
            "note": "phase, collective and offload detail is kept for the steps in "
            "sampled_steps (every 10th step by default: the agent's spans_every); the "
            "other steps show their step time only",
        },
    }


__all__ = ["trace"]
