"""The doctor: what is wrong with a run and what to change, from the read model.

`findings(db=, run_id=)` gathers a run's *evidence* in a handful of reads whose cost follows
steps, not ranks, then hands it to the checks (doctor_checks.py, one function per kind):

1. the rollups (rollups.read) of the newest `window_steps` steps (after `warmup_steps`) for
   every performance metric the run has: step time, busy time, exposed communication,
   phases, parts, collectives, offload, memory: one row per (metric, step);
2. the rollups of a few training signals (loss scale, skipped, non-finite, grad norm,
   offload bandwidth) over the newest `signal_steps` steps, and the run's totals;
3. the ranks that stand out in busy time (series.outliers over the rollups' outlier lists)
   and their hosts;
4. per-rank rows for a few named ranks only: the worst busy rank's own phases, and the gap
   between consecutive steps (time outside the engine: the data loader) of rank 0, the rank
   that waits least in communication (the one the others wait for) and the one that waits
   most.

A 4,096-rank run costs what a 2-rank run does, bar the ranks' names. Each finding is
{"kind", "severity", "ranks", "steps": [first, last], "message", "suggestion", "evidence",
"prediction"}; the list is most severe first. Beside them, the answer's "throughput" holds the
job's tokens/s and MFU over the window (None where unknown), and "figures" the run's named
figures (doctor_figures.py: step time, exposed share, straggler), each {"label", "stat",
"value", "text", "rank"}: the numbers the run page's tiles show, stated under the same names
in the findings' messages.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from sqlalchemy import select
from zerowatch.server import models as m
from zerowatch.server.db import Database
from zerowatch.server.heartbeats import read_heartbeats
from zerowatch.server.read import doctor_crash, doctor_figures, forensics, runs
from zerowatch.server.read.doctor_checks import SEVERITIES, Finding, run_checks
from zerowatch.server.read.doctor_evidence import RECENT_STEPS, Evidence, gather
from zerowatch.server.read.doctor_settings import DoctorSettings


def order(found: list[Finding]) -> list[Finding]:
    """Most severe first; within a severity, in the order the checks ran."""
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))


def figures(e: Evidence, found: list[Finding], s: DoctorSettings) -> dict[str, Any]:
    """The run's named figures (doctor_figures.py) as the answer carries them: the straggler
    is the straggler finding's (its busy time, not its input), or none."""
    lagging = next((f for f in found if f.kind == "straggler"
                    and f.evidence.get("part") != "input"), None)  # fmt: skip
    rank = None if lagging is None else lagging.evidence.get("rank")
    ratio = None if lagging is None else lagging.evidence.get("ratio_to_median")
    named = (e.step_time, e.exposed_share,
             doctor_figures.straggler(rank, ratio, e.window, s.straggler_ratio))  # fmt: skip
    return {f.key: f.to_dict() for f in named}


def findings(
    *,
    db: Database,
    run_id: str,
    settings: DoctorSettings | None = None,
    recent_steps: int = RECENT_STEPS,
) -> dict[str, Any] | None:
    """The doctor's findings for a run: {"run_id", "window": [first, last] steps read,
    "throughput", "figures", "findings": [...]} most severe first, or None for an unknown
    run. `recent_steps`: the window of the run's recent figures (the server's setting)."""
    settings = settings or DoctorSettings()
    with db.read() as conn:
        row = conn.execute(select(m.runs).where(m.runs.c.run_id == run_id)).first()
        if row is None:
            return None
        run = runs.run_dict(row, now=0.0, stalled_after_s=float("inf"))
        evidence = gather(conn, int(row.id), run, settings, recent_steps=recent_steps)
        crashed = doctor_crash.crashes(conn, int(row.id)) if row.status == "crashed" else []
        if evidence is not None:
            flagged = [st for st, v in sorted((evidence.signals.get("nonfinite") or {}).items())
                       if v.get("max") > 0]  # fmt: skip
            rows = doctor_crash.origins(conn, int(row.id), flagged)
            evidence = dataclasses.replace(evidence, origin=doctor_crash.origin(rows))
        # (A failed run's last heartbeats say which collectives the ranks were in.)
        beats = read_heartbeats(conn, int(row.id)) if row.status != "finished" else []
    # Hangs and desyncs come from the ranks' heartbeats (read/forensics.py), steps or not.
    stuck = forensics.findings(beats, world_size=int(row.world_size), now=time.time())
    stuck = doctor_crash.crash_findings(crashed) + stuck
    if evidence is None:
        return {"run_id": run_id, "window": None, "findings": [f.to_dict() for f in stuck]}
    found = order(stuck + run_checks(evidence, settings))
    return {
        "run_id": run_id,
        "window": list(evidence.window),
        "throughput": {"tokens_per_s": evidence.tokens_per_s, "mfu": evidence.mfu},
        "figures": figures(evidence, found, settings),
        "findings": [f.to_dict() for f in found],
    }


__all__ = ["DoctorSettings", "Finding", "figures", "findings", "order"]
