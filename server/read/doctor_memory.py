"""The doctor on memory and offload: peak memory against the device's capacity (and the
allocator's fragmentation), host<->device copies slower than before or than the link."""

from __future__ import annotations

import statistics

from zerowatch.server.read.doctor_evidence import Evidence
from zerowatch.server.read.doctor_finding import (
    Finding,
    ordered,
    pct,
    typical,
)
from zerowatch.server.read.doctor_settings import DoctorSettings

from zerowatch.plan import fmt_bytes


def memory_headroom(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Peak memory against the device's capacity, and reserved against allocated."""
    peak, cap = e.median("memory.peak", "max"), e.median("memory.capacity", "min")
    if not peak or not cap:
        return []
    share = peak / cap
    rank = typical(e.perf.get("memory.peak"), "max_rank")
    reserved = e.median("memory.reserved", "max")
    evidence = {"peak_bytes": peak, "capacity_bytes": cap, "share": share,
                "reserved_bytes": reserved, "model_state_bytes": e.median("memory.state", "max")}  # fmt: skip
    if share >= s.memory_headroom_share:
        return [
            Finding(
                kind="memory_headroom",
                severity="critical" if share >= s.memory_critical_share else "warning",
                ranks=(rank,) if rank is not None else (),
                steps=e.window,
                message=f"The fullest rank peaks at {fmt_bytes(peak)}, {pct(share)} of "
                f"{fmt_bytes(cap)}: one longer batch away from out-of-memory.",
                suggestion="Free memory: activation checkpointing, a smaller micro-batch with "
                "more gradient accumulation, a higher ZeRO stage or offload (see stage_choice "
                "for the predicted cost), smaller buckets.",
                evidence=evidence,
                chart="memory",
            )
        ]
    if reserved and reserved / peak >= s.fragmentation_ratio:
        return [
            Finding(
                kind="memory_headroom",
                severity="info",
                ranks=(rank,) if rank is not None else (),
                steps=e.window,
                message=f"The allocator holds {fmt_bytes(reserved)} for a peak of "
                f"{fmt_bytes(peak)} allocated ({reserved / peak:.1f}x): fragmentation.",
                suggestion="Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
                evidence=evidence,
                chart="memory",
            )
        ]
    return []


def offload_bandwidth(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Host<->device copies far below what the run reached before, or the link allows."""
    out = []
    for d in ("d2h", "h2d"):
        series_ = ordered(e.signals.get(f"offload.{d}.bandwidth"))
        recent = [v for st, v in series_ if st >= e.window[0]]
        before = sorted(v for st, v in series_ if st < e.window[0])
        if not recent:
            continue
        now = statistics.median(recent)
        ref = before[int(0.9 * (len(before) - 1))] if len(before) >= 5 else None
        evidence = {"direction": d, "recent_bytes_per_s": now, "before_p90_bytes_per_s": ref,
                    "link_bytes_per_s": s.offload_link_bytes_per_s or None}  # fmt: skip
        if ref and now < s.offload_bandwidth_ratio * ref:
            out.append(Finding(
                kind="offload_bandwidth", severity="warning", steps=e.window,
                message=f"Offload copies {d} run at {fmt_bytes(now)}/s, {pct(now / ref)} of "
                f"the {fmt_bytes(ref)}/s this run reached before.",
                suggestion="Pin the host buffers (offload_optimizer.pin_memory: true), check "
                "that nothing else shares the link (another job, NUMA placement: bind each "
                "rank to the CPU socket near its GPU).",
                evidence=evidence, chart="offload",
            ))  # fmt: skip
        elif s.offload_link_bytes_per_s and now < 0.25 * s.offload_link_bytes_per_s:
            out.append(Finding(
                kind="offload_bandwidth", severity="info", steps=e.window,
                message=f"Offload copies {d} run at {fmt_bytes(now)}/s, "
                f"{pct(now / s.offload_link_bytes_per_s)} of the link.",
                suggestion="Pin the host buffers (offload_optimizer.pin_memory: true).",
                evidence=evidence, chart="offload",
            ))  # fmt: skip
    return out


__all__ = ["memory_headroom", "offload_bandwidth"]
