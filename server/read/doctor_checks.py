"""The doctor's checks: one function per kind of finding, each a pure function of a run's
evidence (doctor_evidence.Evidence) and the thresholds (DoctorSettings), listed in `CHECKS`.

They live by what they look at: doctor_ranks (straggler, input_stall), doctor_comm
(exposed_communication, latency_bound_collectives), doctor_memory (memory_headroom,
offload_bandwidth), doctor_training (loss_scale, grad_norm_spike, nonfinite) and
doctor_stage (stage_choice); doctor_measured is the run as the calibrated planner sees it,
doctor_finding the `Finding` they return and the words they share.

Every check returns a list of `Finding`s (empty: nothing to say). `run_checks` runs them all
and relates them where one explains another: communication exposed because the collectives
are latency-bound is reported once, as latency_bound_collectives (the exposed share stays
as an info finding pointing at it); a stage_choice beside it stays info too (a larger
bucket is its own remedy, and another layout is priced at the small calls as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from zerowatch.server.read.doctor_comm import exposed_communication, latency_bound_collectives
from zerowatch.server.read.doctor_evidence import Evidence
from zerowatch.server.read.doctor_finding import SEVERITIES, Finding
from zerowatch.server.read.doctor_measured import measured
from zerowatch.server.read.doctor_memory import memory_headroom, offload_bandwidth
from zerowatch.server.read.doctor_ranks import input_stall, straggler
from zerowatch.server.read.doctor_settings import DoctorSettings
from zerowatch.server.read.doctor_stage import stage_choice
from zerowatch.server.read.doctor_training import grad_norm_spike, loss_scale, nonfinite

CHECKS: tuple[Callable[[Evidence, DoctorSettings], list[Finding]], ...] = (
    nonfinite, loss_scale, straggler, input_stall, memory_headroom, latency_bound_collectives,
    exposed_communication, offload_bandwidth, grad_norm_spike, stage_choice,
)  # fmt: skip


def _after_latency_bound(f: Finding) -> Finding:
    """A finding that latency_bound_collectives explains or comes before, as info."""
    if f.kind == "exposed_communication":
        return replace(f, severity="info",
                       message=f.message + " Much of it is the latency-bound collectives below.")  # fmt: skip
    if f.kind == "stage_choice" and f.severity != "info":
        bucket = set((f.prediction or {}).get("config", {}).get("zero_optimization", {})) == {
            "reduce_bucket_size"}  # fmt: skip
        return replace(f, severity="info", message=f.message + (
            " latency_bound_collectives suggests a larger reduce_bucket_size too." if bucket else
            " The latency-bound collectives come first: this prediction prices their many "
            "small calls as they are."))  # fmt: skip
    return f


def run_checks(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Every check's findings, related where one explains another (module docstring)."""
    found = [f for check in CHECKS for f in check(e, s)]
    if any(f.kind == "latency_bound_collectives" for f in found):
        found = [_after_latency_bound(f) for f in found]
    return found


__all__ = ["CHECKS", "SEVERITIES", "Finding", "measured", "run_checks"]
