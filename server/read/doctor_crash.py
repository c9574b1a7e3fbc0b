"""The doctor on crashes and on where a non-finite step began (docs/forensics.md).

Two reads whose cost follows what went wrong, not the run's length:

- `crashes`: the crashed ranks' last reports (rank_states.crash: the exception, its step
  and phase, the memory waterfall on out-of-memory), a row per crashed rank;
- `origins`: the forensics the ranks sent for the first flagged steps (steps.forensics),
  read by (run, step) for those steps and the step after each (where the forward tracer
  reports).

`crash_findings` turns the first into `crash` findings; `origin` condenses the second into
the `nonfinite` finding's evidence: the first step, the first rank and module where the
gradients went non-finite before the reduction, the ranks' local gradient norms (a rank
that departs from its peers named), the first module whose forward output was not finite
(which, where there is one, is the origin: `first_rank` and `first_module` name it, and
`grad_rank` / `grad_module` keep what the gradients said), and the batch ids the ranks
logged.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from sqlalchemy import Connection, select
from zerowatch.server import models as m
from zerowatch.server.read.doctor_finding import Finding

from zerowatch.plan import fmt_bytes

#: Flagged steps whose forensics are read at most.
MAX_FLAGGED = 10
#: A rank's local gradient norm this many times its peers' median departs from them.
DEPARTS = 10.0


def crashes(conn: Connection, pk: int) -> list[tuple[int, dict[str, Any]]]:
    """(rank, crash report) of every crashed rank, by rank."""
    rs = m.rank_states
    rows = conn.execute(
        select(rs.c.rank, rs.c.crash)
        .where(rs.c.run == pk, rs.c.end_status == "crashed")
        .order_by(rs.c.rank)
    ).all()
    return [(int(r.rank), dict(r.crash or {})) for r in rows]


def origins(conn: Connection, pk: int, flagged: list[int]) -> list[dict[str, Any]]:
    """The forensics of the first `MAX_FLAGGED` flagged steps and of the step after each:
    [{"step", "rank", **forensics}], by step then rank."""
    wanted = sorted(set(flagged[:MAX_FLAGGED]) | {s + 1 for s in flagged[:MAX_FLAGGED]})
    if not wanted:
        return []
    st = m.steps
    rows = conn.execute(
        select(st.c.step, st.c.rank, st.c.forensics)
        .where(st.c.run == pk, st.c.step.in_(wanted))
        .order_by(st.c.step, st.c.rank)
    ).all()
    return [{"step": int(r.step), "rank": int(r.rank), **r.forensics}
            for r in rows if r.forensics]  # fmt: skip


def origin(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the non-finite values began (module docstring); {} when nothing is known."""
    out: dict[str, Any] = {}
    grads = [r for r in rows if r.get("first_module")]
    if grads:
        first = min(grads, key=lambda r: (r["step"], r["rank"]))
        out.update(first_step=first["step"], first_rank=first["rank"],
                   first_module=first["first_module"],
                   nonfinite_params=first.get("nonfinite_params") or [])  # fmt: skip
        peers = [r for r in rows if r["step"] == first["step"]]
        norms = {r["rank"]: r.get("local_grad_norm") for r in peers}
        out["local_grad_norms"] = {str(k): v for k, v in sorted(norms.items())}
        out["departing_ranks"] = _departing(norms)
    forward = [r for r in rows if r.get("forward_module")]
    if forward:
        f = min(forward, key=lambda r: (r["step"], r["rank"]))
        out.update(forward_module=f["forward_module"], forward_rank=f["rank"],
                   forward_step=f["step"])  # fmt: skip
        # Born in a forward (from finite inputs and weights): the gradients' non-finite
        # modules are its consequence (a NaN loss spoils every gradient of its rank).
        if grads:
            out.update(grad_rank=out["first_rank"], grad_module=out["first_module"])
        out.update(first_rank=f["rank"], first_module=f["forward_module"])
    ids = {str(r["rank"]): r["batch_ids"] for r in rows
           if r.get("batch_ids") and r["step"] == out.get("first_step", r["step"])}  # fmt: skip
    if ids:
        out["batch_ids"] = ids
    return out


def _departing(norms: dict[int, float | None]) -> list[int]:
    """Ranks whose local gradient norm is not finite, or `DEPARTS` times their peers'."""
    bad = [r for r, v in norms.items() if v is None or not math.isfinite(v)]
    finite = {r: v for r, v in norms.items() if v is not None and math.isfinite(v)}
    for r, v in finite.items():
        others = [w for q, w in finite.items() if q != r]
        if others and statistics.median(others) > 0 and v > DEPARTS * statistics.median(others):
            bad.append(r)
    return sorted(bad)


def crash_findings(found: list[tuple[int, dict[str, Any]]]) -> list[Finding]:
    """A `crash` finding per crashed rank (the first rank's first, the others after)."""
    out = []
    for rank, c in found:
        step, phase = c.get("step"), c.get("phase")
        where = f"in {phase}" if phase else ""
        memory = c.get("memory")
        evidence: dict[str, Any] = {"type": c.get("type"), "message": c.get("message"),
                                    "stack": c.get("stack"), "step": step, "phase": phase}  # fmt: skip
        if memory is not None:
            evidence["memory"] = memory
        out.append(
            Finding(
                kind="crash",
                severity="critical",
                ranks=(rank,),
                steps=(int(step or 0), int(step or 0)),
                message=f"Rank {rank} crashed at step {step} {where}: "
                f"{c.get('type')}: {str(c.get('message') or '')[:300]}".rstrip(),
                suggestion=_suggestion(c),
                evidence=evidence,
                chart="memory" if memory is not None else "breakdown",
            )
        )
    return out


def _suggestion(c: dict[str, Any]) -> str:
    if not c.get("oom"):
        return "Read the stack in the evidence; the other ranks stopped waiting for this one."
    memory = c.get("memory") or {}
    fits = memory.get("fits") or {}
    parts = []
    if memory.get("failed_allocation_bytes"):
        parts.append(f"an allocation of {fmt_bytes(memory['failed_allocation_bytes'])} failed")
    if fits.get("max_micro_batch") is not None:
        parts.append(f"a micro-batch of {fits['max_micro_batch']} is predicted to fit")
    layout = fits.get("layout")
    if layout:
        parts.append(f"the cheapest layout that fits is stage {layout['stage']} with "
                     f"offload {layout['offload']}")  # fmt: skip
    lead = "; ".join(parts) + ". " if parts else ""
    return (f"Out of memory: {lead}Lower train_micro_batch_size_per_gpu (raise "
            "gradient_accumulation_steps to keep the batch), use activation checkpointing, "
            "or a higher ZeRO stage or offload (the waterfall in the evidence says where "
            "the memory went).")  # fmt: skip


__all__ = ["crash_findings", "crashes", "origin", "origins"]
