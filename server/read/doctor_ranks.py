"""The doctor on ranks that hold the others up: a straggler (a rank, or a node's ranks,
busy longer than the median rank, with the part of the step the excess is in and what its
GPU says) and input stalls (time between steps outside the engine: the data loader)."""

from __future__ import annotations

import statistics
from typing import Any

from zerowatch.server.read import doctor_figures
from zerowatch.server.read.doctor_evidence import RANK_PARTS, Evidence
from zerowatch.server.read.doctor_finding import (
    Finding,
    host_of,
    pct,
)
from zerowatch.server.read.doctor_settings import DoctorSettings

from zerowatch import events as ev
from zerowatch.plan import fmt_seconds


def straggler(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """A rank (or a node's ranks) whose busy time stands above the median rank's, and the
    part of the step the excess is in (the rank's own phases against the median rank's)."""
    if int(e.run["world_size"]) < 2 or not e.busy_outliers:
        return []
    median = e.busy_outliers[0]["median"]
    if not median:
        return []
    slow = [o for o in e.busy_outliers if o["mean"] / median > s.straggler_ratio]
    if not slow:
        return []
    worst = slow[0]
    rank = int(worst["rank"])
    # Persistently slow, not slow on average because of a few steps: the median over the
    # window's steps of the rank's busy time against that step's median rank.
    busy = e.perf.get("busy_s") or {}
    per_step = [v / busy[st].p50 for st, v in e.rank_busy.get(rank, {}).items()
                if st in busy and busy[st].p50 > 0]  # fmt: skip
    ratio = statistics.median(per_step) if per_step else worst["mean"] / median
    if ratio <= s.straggler_ratio:
        return []
    excess: dict[str, float] = {}
    by_metric: dict[str, float] = {}
    for name, part in RANK_PARTS.items():
        mine, typical = e.rank_means.get(rank, {}).get(name), e.median(name)
        if mine is None or typical is None:
            continue
        by_metric[name] = mine - typical
        excess[part] = excess.get(part, 0.0) + mine - typical
    part = max(excess, key=lambda k: excess[k]) if excess else "compute"
    phase = max((n for n in by_metric if RANK_PARTS[n] == part), key=lambda n: by_metric[n],
                default=None)  # fmt: skip
    # The rank's own phase that grew most, against its busy excess: a rank slower in its
    # own work explains most of it; one that only waits less in communication (ranks out
    # of phase over many collectives) does not, and is reported as info.
    busy_excess = worst["mean"] - median
    own = max((v for n, v in by_metric.items() if RANK_PARTS[n] == "compute"), default=0.0)
    explained = own / busy_excess if busy_excess > 0 else 0.0
    hosts = {e.hosts.get(int(o["rank"])) for o in slow}
    node = (len(slow) >= 2 and len(hosts) == 1 and None not in hosts
            and len(slow) < int(e.run["world_size"]))  # fmt: skip
    ranks = tuple(int(o["rank"]) for o in slow) if node else (rank,)
    # A node's ranks lead with the host; one rank's host follows its figure.
    lead = f"host {next(iter(hosts))} (ranks {', '.join(map(str, ranks))}): " if node else ""
    host = "" if node else host_of(e, rank).replace(" on ", ", on ", 1)
    detail = ""
    if phase is not None:
        detail = f" ({phase.removeprefix('phase.')} {fmt_seconds(by_metric[phase])} a step above)"
    suggestion = {
        "compute": "Look at that rank's device and host: clocks and thermal throttling "
        "(nvidia-smi -q -d PERFORMANCE), another process on the device, a slower device "
        "model, or longer samples in its shard. Replace or drain the node if it stays slow.",
        "communication": "Its links are slower than the others': check the node's NIC / "
        "NVLink (nccl-tests between it and a healthy node, ibstat, link errors).",
    }[part]
    gpu = e.rank_gpu.get(rank)
    gpu_says, gpu_suggestion = _gpu_sentence(gpu)
    if gpu_suggestion and part == "compute":
        suggestion = gpu_suggestion
    figure = doctor_figures.straggler(rank, ratio, e.window, s.straggler_ratio)
    return [
        Finding(
            kind="straggler",
            severity="info"
            if part == "communication" or explained < 0.5
            else "critical"
            if ratio > s.straggler_critical_ratio
            else "warning",
            ranks=ranks,
            steps=e.window,
            message=f"{lead}{figure.cite()}{host}; its mean busy time where it stood out "
            f"{fmt_seconds(worst['mean'])} against the median rank's {fmt_seconds(median)}; "
            f"the excess is in {part}{detail}. "
            + (
                "Every other rank waits for it in each collective."
                if explained >= 0.5
                else f"Its own phases explain only {pct(max(explained, 0.0))} of it: the "
                "ranks rather wait for each other unevenly in communication."
            )
            + gpu_says,
            suggestion=suggestion,
            evidence={
                "part": part,
                "rank": rank,
                "ratio_to_median": ratio,
                "busy_s": worst["mean"],
                "median_busy_s": median,
                "excess_s": excess,
                "explained_share": explained,
                "by_metric_s": by_metric,
                "outliers": e.busy_outliers[:4],
                "gpu": gpu,
            },
            chart="ranks",
        )
    ]


def gpu_reasons_text(reasons: dict[str, float]) -> str:
    """The slowing reasons of a GPU health summary as words: "power cap, thermal, hardware"."""
    return ", ".join(ev.GPU_REASON_LABELS.get(r, r) for r in reasons)


def _gpu_sentence(gpu: dict[str, Any] | None) -> tuple[str, str | None]:
    """What the slow rank's GPU telemetry says (a sentence to append to the finding), and
    the suggestion it makes (None: keep the generic one)."""
    if gpu is None:
        return "", None
    says, suggestion = "", None
    errors = gpu["xid_errors"] + gpu["ecc_errors"]
    if gpu["throttled_share"] > 0:
        reasons = gpu_reasons_text(gpu["reasons"]) or "clock event reasons"
        clock = gpu["sm_clock_ratio"]
        says = (
            f" Its GPU was throttled ({reasons}) in {pct(gpu['throttled_share'])} of those "
            "steps" + (f", its SM clock at {pct(clock)} of its maximum" if clock else "") + "."
        )
        suggestion = (
            f"Its GPU holds its clocks down ({reasons}): check that node's power limit and "
            "power delivery, its cooling and inlet temperature (nvidia-smi -q -d "
            "PERFORMANCE,POWER,TEMPERATURE) against a healthy node's. Replace or drain the "
            "node if it stays throttled."
        )
    if errors:
        says += (
            f" Its GPU reported {gpu['xid_errors']} critical XID event(s) and "
            f"{gpu['ecc_errors']} uncorrected ECC error(s) during the run."
        )
        suggestion = (
            "Its GPU is failing (XID events, uncorrected ECC errors): drain the node, read "
            "its kernel log (dmesg | grep -i xid) and nvidia-smi -q -d ECC,ROW_REMAPPER, and "
            "resume from a checkpoint taken before the errors."
        )
    if not says:
        says = " Its GPU ran unthrottled and without errors in those steps."
        suggestion = (
            "Its GPU ran at its clocks without throttling or errors: look at another "
            "process on the device or host, a slower device model, the rank's data loading, "
            "or longer samples in its shard."
        )
    return says, suggestion


def input_stall(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Time between steps outside the engine (the data loader), on every rank sampled
    (input_stall) or on one rank the others wait for (a straggler in "input")."""
    figure = e.step_time
    step = figure.value
    gaps = {r: g for r, g in e.gaps.items() if g is not None}
    if not step or not gaps:
        return []
    shares = {r: max(g, 0.0) / (max(g, 0.0) + step) for r, g in gaps.items()}
    low, high = min(shares.values()), max(shares.values())
    ev_common = {"gap_s": gaps, "step_time_s": step, "share_by_rank": shares}
    suggestion = ("Feed the GPUs ahead of time: DataLoader(num_workers=4+, pin_memory=True, "
                  "persistent_workers=True, prefetch_factor=2+), pre-tokenize, move logging "
                  "and host syncs (.item(), printing) out of the step loop.")  # fmt: skip
    if low >= s.input_stall_share:
        gap = statistics.median(gaps.values())
        return [
            Finding(
                kind="input_stall",
                severity="critical" if low >= s.input_stall_critical_share else "warning",
                steps=e.window,
                message=f"Every rank sampled waits {fmt_seconds(gap)} between steps outside "
                f"the engine ({pct(low)} or more of the wall time, against the "
                f"{figure.cite()}).",
                suggestion=suggestion,
                evidence=ev_common,
            )
        ]
    worst = max(shares, key=lambda r: shares[r])
    if high >= s.input_stall_share and gaps[worst] > 2 * max(min(gaps.values()), 1e-3):
        return [
            Finding(
                kind="straggler",
                severity="critical" if high >= s.input_stall_critical_share else "warning",
                ranks=(worst,),
                steps=e.window,
                message=f"rank {worst}{host_of(e, worst)} starts its steps "
                f"{fmt_seconds(gaps[worst])} late (its input): the others wait for it in "
                "the first collective of each step.",
                suggestion="That rank's data loading is slow: " + suggestion,
                evidence={"part": "input", **ev_common},
                chart="ranks",
            )
        ]
    return []


__all__ = ["gpu_reasons_text", "input_stall", "straggler"]
