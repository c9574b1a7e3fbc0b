"""The doctor's checks: one function per kind of finding, each a pure function of a run's
evidence (doctor_evidence.Evidence) and the thresholds (DoctorSettings).

Every check returns a list of `Finding`s (empty: nothing to say). `run_checks` runs them all
and relates them where one explains another: communication exposed because the collectives
are latency-bound is reported once, as latency_bound_collectives (the exposed share stays
as an info finding pointing at it); a stage_choice beside it stays info too (a larger
bucket is its own remedy, and another layout is priced at the small calls as they are).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from zerowatch.server.read import doctor_figures
from zerowatch.server.read.doctor_evidence import RANK_PARTS, Evidence
from zerowatch.server.read.doctor_settings import DoctorSettings
from zerowatch.server.read.rollups import Stats

from zerowatch import events as ev
from zerowatch import predict, theory
from zerowatch.plan import fmt_bytes, fmt_seconds

SEVERITIES = ("critical", "warning", "info")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One thing the doctor found (see the module docstring for the JSON shape)."""

    kind: str
    severity: str
    message: str
    suggestion: str
    steps: tuple[int, int]
    ranks: tuple[int, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)
    prediction: dict[str, Any] | None = None
    #: The run page's chart that shows the evidence (its element id is chart-<chart>).
    chart: str = "breakdown"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "ranks": list(self.ranks),
            "steps": list(self.steps),
            "message": self.message,
            "suggestion": self.suggestion,
            "evidence": self.evidence,
            "prediction": self.prediction,
            "chart": self.chart,
        }


# -- helpers ---------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _share(x: float) -> str:
    """A share as a percentage, "under 1%" rather than "0%"."""
    return _pct(x) if x >= 0.01 else "under 1%"


def _ordered(per: dict[int, Stats] | None, stat: str = "p50") -> list[tuple[int, float]]:
    return sorted((step, st.get(stat)) for step, st in (per or {}).items())


def _typical(per: dict[int, Stats] | None, attr: str) -> int | None:
    got = Counter(int(getattr(st, attr)) for st in (per or {}).values())
    return got.most_common(1)[0][0] if got else None


def _sentence(text: str) -> str:
    """`text` with its first letter capitalised (the rest as it is) and a full stop."""
    return text[:1].upper() + text[1:] + "."


def _host(e: Evidence, rank: int) -> str:
    h = e.hosts.get(rank)
    return f" on {h}" if h else ""


# -- straggler and input ---------------------------------------------------------------------


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
    host = "" if node else _host(e, rank).replace(" on ", ", on ", 1)
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
                else f"Its own phases explain only {_pct(max(explained, 0.0))} of it: the "
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
            f" Its GPU was throttled ({reasons}) in {_pct(gpu['throttled_share'])} of those "
            "steps" + (f", its SM clock at {_pct(clock)} of its maximum" if clock else "") + "."
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
                f"the engine ({_pct(low)} or more of the wall time, against the "
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
                message=f"rank {worst}{_host(e, worst)} starts its steps "
                f"{fmt_seconds(gaps[worst])} late (its input): the others wait for it in "
                "the first collective of each step.",
                suggestion="That rank's data loading is slow: " + suggestion,
                evidence={"part": "input", **ev_common},
                chart="ranks",
            )
        ]
    return []


# -- communication ---------------------------------------------------------------------------


def _op_stats(e: Evidence) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for op in ev.COLLECTIVE_OPS:
        got = {f: e.median(f"collective.{op}.{f}") for f in ("count", "bytes", "busbw",
                                                              "latency_s")}  # fmt: skip
        if got["count"] and got["busbw"] is not None and got["latency_s"] is not None:
            out[op] = {k: float(v or 0.0) for k, v in got.items()}
            out[op]["seconds"] = out[op]["count"] * out[op]["latency_s"]
            out[op]["message_bytes"] = out[op]["bytes"] / out[op]["count"]
    return out


def measured(e: Evidence) -> predict.Measured | None:
    """The run as the calibrated planner sees it (None: not enough to calibrate on)."""
    run = e.run
    # The run's step time as every surface states it (the planner's "now"); the parts
    # below are the doctor's window's medians.
    step, exposed = e.step_time.value, e.median("exposed_comm_s")
    psi = int(run.get("param_count") or 0)
    if not step or exposed is None or psi <= 0 or run.get("precision") not in theory.PARAM_BYTES:
        return None
    ops = _op_stats(e)
    stage = int(run.get("zero_stage") or 0)
    opt = e.median("part.optimizer_step")
    if opt is None:
        opt = e.median("phase.optimizer_step") or 0.0
        if stage in (1, 2):
            opt -= e.median("phase.param_gather") or 0.0
        if stage >= 1 and "all_reduce" in ops:
            opt -= ops["all_reduce"]["seconds"]
        opt = max(opt, 0.0)
    state = sum(v for n in e.names("memory.state.") if not n.split(".")[-1].startswith("host_")
                and (v := e.median(n, "max")) is not None)  # fmt: skip
    offload_bw = [v for d in ("d2h", "h2d") if (v := e.median(f"offload.{d}.bandwidth"))]
    config = run.get("config") or {}
    return predict.Measured(
        num_params=psi, world_size=int(run["world_size"]), stage=stage,
        precision=str(run["precision"]),
        offload_optimizer=run.get("offload_optimizer") not in (None, "", "none"),
        offload_param=run.get("offload_param") not in (None, "", "none"),
        gradient_accumulation_steps=int(config.get("gradient_accumulation_steps") or 1),
        device=str((run.get("engine_info") or {}).get("device") or "cuda"),
        step_time_s=step, exposed_comm_s=exposed, optimizer_s=opt,
        comm_s={op: v["seconds"] for op, v in ops.items()},
        busbw={op: v["busbw"] for op, v in ops.items()},
        calls={op: v["count"] for op, v in ops.items()},
        comm_bytes={op: v["bytes"] for op, v in ops.items()},
        model_state_bytes=state, peak_bytes=e.median("memory.peak", "max"),
        capacity_bytes=e.median("memory.capacity", "min"),
        offload_bytes_per_s=statistics.median(offload_bw) if offload_bw else None,
        zero_config=dict(config.get("zero_optimization") or {}),
        thread_cpu_s=e.median("thread_cpu_s"), other_cpu_s=e.median("other_cpu_s"),
        comm_phase_host_s=_comm_phase_host_s(e, exposed),
        counted_calls=predict.CountedCalls.from_engine_info(run.get("engine_info")),
    )  # fmt: skip


def _comm_phase_host_s(e: Evidence, exposed: float) -> float | None:
    """The communication phases' time (exclusive parts) not spent waiting on a collective:
    the training thread's own work around them (stage 3: its parameter management). None
    without the parts (older agents)."""
    gather, reduce = e.median("part.exposed_param_gather"), e.median("part.exposed_grad_reduce")
    if gather is None and reduce is None:
        return None
    return (gather or 0.0) + (reduce or 0.0) - exposed


def _comm_tips(e: Evidence, op: str | None) -> list[str]:
    """The knobs that act on `op`, the collective that carries most of the communication
    time the run measured, at the run's stage: a parameter gather (stage 3) is moved by the
    prefetch and the persistence threshold, and a lower stage gathers none; a gradient
    reduction (reduce-scatter; the all-reduce of stage 0 and of stage 3's parameters kept
    whole) by the reduce bucket and overlap_comm; the gather of the updated parameters after
    the step (stages 1-2) by its bucket; overlap_comm where the reduction can run beside
    backward (not stage 3's all-reduce, issued after it). Nothing op-specific for the rest (a broadcast, the
    gradient norm's all-reduce), and none for an op the run did not make."""
    stage = int(e.run.get("zero_stage") or 0)
    zero = (e.run.get("config") or {}).get("zero_optimization") or {}
    bundled = predict.CountedCalls.from_engine_info(e.run.get("engine_info")) is not None
    overlap = None if zero.get("overlap_comm") else "set zero_optimization.overlap_comm: true"
    if op == "all_gather" and stage == 3:
        return ["raise stage3_prefetch_bucket_size so parameters arrive before they are needed",
                "raise stage3_param_persistence_threshold so that small parameters stay whole "
                "(never gathered)",
                "a lower stage moves less (stage 3 gathers parameters twice a step)"]  # fmt: skip
    if op == "all_gather" and stage in (1, 2):
        key = "reduce_bucket_size" if bundled else "allgather_bucket_size"
        return [f"raise zero_optimization.{key} so that fewer, larger all-gathers bring back "
                "the updated parameters after the step"]  # fmt: skip
    bucket = f"raise zero_optimization.reduce_bucket_size so that fewer, larger {op} calls "
    if op == "reduce_scatter" or (op == "all_reduce" and stage == 0):
        return [t for t in (overlap, bucket + "carry the gradients") if t]
    if op == "all_reduce" and stage == 3:
        # Issued at the end of backward, after the units' reduce-scatters: nothing left to
        # overlap it with.
        return [bucket + "carry the gradients of the parameters stage 3 keeps whole (under "
                "stage3_param_persistence_threshold: they are never gathered)"]  # fmt: skip
    return []


def exposed_communication(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Communication compute did not hide, as a share of the step, on the rank that waits
    least (waiting for a slower rank is that rank's finding); the advice is the knobs of the
    op that carries most of the run's communication time (`_comm_tips`)."""
    step, exposed = e.median("step_time_s"), e.median("exposed_comm_s", "min")
    if not step or exposed is None:
        return []
    share = exposed / step
    if share < s.exposed_comm_info_share:
        return []
    ops = _op_stats(e)
    top = sorted(ops, key=lambda op: -ops[op]["seconds"])
    tips = [*_comm_tips(e, top[0] if top else None),
            "a larger micro-batch or gradient accumulation spreads the same communication "
            "over more compute"]  # fmt: skip
    return [
        Finding(
            kind="exposed_communication",
            severity="warning" if share >= s.exposed_comm_share else "info",
            steps=e.window,
            message=f"On the rank that waits least, {_pct(share)} of the step is "
            f"communication that compute does not hide ({fmt_seconds(exposed)} a step; "
            f"medians over steps {e.window[0]:,}–{e.window[1]:,})"
            + (f", most of it in {top[0]}" if top else "")
            + f"; the run's {e.exposed_share.cite()}.",
            suggestion=_sentence("; ".join(tips)),
            evidence={
                "share": share,
                "exposed_s": exposed,
                "step_time_s": step,
                "hidden_s": e.median("hidden_comm_s"),
                "op": top[0] if top else None,
                "seconds_by_op": {op: ops[op]["seconds"] for op in top},
            },
            chart="collectives",
        )
    ]


_BUCKET_KEYS = {"reduce_scatter": "reduce_bucket_size", "all_reduce": "reduce_bucket_size",
                "all_gather": "allgather_bucket_size"}  # fmt: skip


def _rehearsed_link(e: Evidence) -> dict[str, Any] | None:
    """The bus bandwidth the bundled engine measured on the job's process group with one
    large message at initialization (engine/rehearsal.py `link_bandwidth`), or None."""
    calls = (e.run.get("engine_info") or {}).get("collective_calls")
    link = calls.get("link") if isinstance(calls, dict) else None
    if not isinstance(link, dict):
        return None
    got: dict[str, Any] = {"op": str(link.get("op") or "reduce_scatter")}
    for key in ("message_bytes", "busbw"):
        v = link.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            return None
        got[key] = float(v)
    return got


def _references(
    e: Evidence, s: DoctorSettings, ops: dict[str, dict[str, float]]
) -> dict[str, dict[str, Any]]:
    """{op: what its bus bandwidth is judged against} for the ops with at least
    `latency_bound_min_calls` calls: the link's bandwidth at messages
    `latency_bound_size_factor` times larger than the op's. Where the run's own collectives
    come in such different sizes, the best op of larger messages ("run"; an op without one
    is not judged); where they do not (every collective small), the engine's probe of the
    link at initialization ("rehearsal"), else `link_busbw_bytes_per_s` ("settings")."""
    busy = [op for op, st in ops.items() if st["count"] >= s.latency_bound_min_calls]
    own: dict[str, dict[str, Any]] = {}
    for op in busy:
        large = s.latency_bound_size_factor * ops[op]["message_bytes"]
        larger = [(o, v) for o, v in ops.items()
                  if o != op and v["busbw"] > 0 and v["message_bytes"] >= large]  # fmt: skip
        if larger:
            ref_op, ref = max(larger, key=lambda kv: kv[1]["busbw"])
            own[op] = {"reference": "run", "reference_op": ref_op,
                       "reference_message_bytes": ref["message_bytes"],
                       "reference_busbw": ref["busbw"]}  # fmt: skip
    if own:
        return own
    link = _rehearsed_link(e)
    out: dict[str, dict[str, Any]] = {}
    for op in busy:
        large = s.latency_bound_size_factor * ops[op]["message_bytes"]
        if link is not None and link["message_bytes"] >= large:
            out[op] = {"reference": "rehearsal", "reference_op": link["op"],
                       "reference_message_bytes": link["message_bytes"],
                       "reference_busbw": link["busbw"]}  # fmt: skip
        elif s.link_busbw_bytes_per_s > 0:
            out[op] = {"reference": "settings", "reference_op": None,
                       "reference_message_bytes": None,
                       "reference_busbw": s.link_busbw_bytes_per_s}  # fmt: skip
    return out


def _reference_words(ref: dict[str, Any]) -> str:
    """Where the reference bandwidth comes from, for the finding's message."""
    size, bw = ref["reference_message_bytes"], fmt_bytes(ref["reference_busbw"])
    if ref["reference"] == "run":
        return f"what {ref['reference_op']}'s {fmt_bytes(size)} messages reach on this run ({bw}/s)"
    if ref["reference"] == "rehearsal":
        return (f"what the link reached with one {fmt_bytes(size)} {ref['reference_op']} when "
                f"the engine started ({bw}/s)")  # fmt: skip
    return f"the link's bandwidth (link_busbw_bytes_per_s: {bw}/s)"


def latency_bound_collectives(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Many small collectives whose bus bandwidth sits far below what the link reaches with
    large messages (`_references`): buckets too small."""
    ops = _op_stats(e)
    m = measured(e)
    out = []
    for op, ref in _references(e, s, ops).items():
        st = ops[op]
        if st["busbw"] >= s.latency_bound_ratio * ref["reference_busbw"]:
            continue
        stage = int(e.run.get("zero_stage") or 0)
        key = _BUCKET_KEYS[op]
        if op == "all_gather" and stage == 3:
            key = "stage3_prefetch_bucket_size"
        if m is not None and m.counted_calls is not None:
            # The bundled engine (it counted its calls) gathers per reduce bucket and per
            # stage-3 unit, both cut by reduce_bucket_size: the key that makes its messages
            # larger, and the one its counts price (allgather_bucket_size and the prefetch
            # size change no call there).
            key = "reduce_bucket_size"
        p = theory.PARAM_BYTES.get(str(e.run.get("precision")), 4)
        now = ((e.run.get("config") or {}).get("zero_optimization") or {}).get(key)
        # Messages as large as the reference's (8 times the op's where the reference is
        # only a figure), at least 8 times the run's bucket; a bucket past the model's
        # size is one bucket, no larger.
        target = ref["reference_message_bytes"] or 8 * st["message_bytes"]
        new = math.ceil(target / p)
        if isinstance(now, int | float) and now > 0:
            new = max(new, int(now) * 8)
        psi = int(e.run.get("param_count") or 0)
        if isinstance(now, int | float) and now < psi < new:
            new = psi
        if m is not None and m.counted_calls is not None and key == "reduce_bucket_size":
            # The engine's own counts: a bucket that makes no fewer calls of the op (its
            # units or buckets are as large as they get) is no remedy.
            calls_now = m.counted_calls.at(m.stage) or {}
            calls_new = m.counted_calls.at(m.stage, new) or {}
            if op in calls_now and op in calls_new and calls_new[op] >= calls_now[op]:
                continue
        prediction = None
        if m is not None:
            # Priced with the reference as β where it is not one of the run's own ops.
            link = None if ref["reference"] == "run" else ref["reference_busbw"]
            got = predict.predict(
                replace(m, link_busbw=link),
                predict.Change(
                    stage=m.stage,
                    offload_optimizer=m.offload_optimizer,
                    offload_param=m.offload_param,
                    bucket=(key, new),
                    bucket_op=op,
                ),
            )
            prediction = got.to_dict(m)
        out.append(
            Finding(
                kind="latency_bound_collectives",
                severity="warning",
                steps=e.window,
                message=f"{op}: {st['count']:.0f} calls a step of {fmt_bytes(st['message_bytes'])} "
                f"each reach {fmt_bytes(st['busbw'])}/s of bus bandwidth, "
                f"{_share(st['busbw'] / ref['reference_busbw'])} of {_reference_words(ref)}: "
                "each call pays the fixed latency.",
                suggestion=f"Raise zero_optimization.{key}"
                + (f" (now {now:,.0f} elements)" if isinstance(now, int | float) else "")
                + f" to about {new:,} elements so that fewer, larger messages carry the same "
                "bytes.",
                evidence={
                    "op": op,
                    "calls_per_step": st["count"],
                    "message_bytes": st["message_bytes"],
                    "busbw": st["busbw"],
                    **ref,
                    "seconds_per_step": st["seconds"],
                },
                prediction=prediction,
                chart="bandwidth",
            )
        )
    return out


# -- memory and offload ------------------------------------------------------------------------


def memory_headroom(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Peak memory against the device's capacity, and reserved against allocated."""
    peak, cap = e.median("memory.peak", "max"), e.median("memory.capacity", "min")
    if not peak or not cap:
        return []
    share = peak / cap
    rank = _typical(e.perf.get("memory.peak"), "max_rank")
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
                message=f"The fullest rank peaks at {fmt_bytes(peak)}, {_pct(share)} of "
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
        series_ = _ordered(e.signals.get(f"offload.{d}.bandwidth"))
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
                message=f"Offload copies {d} run at {fmt_bytes(now)}/s, {_pct(now / ref)} of "
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
                f"{_pct(now / s.offload_link_bytes_per_s)} of the link.",
                suggestion="Pin the host buffers (offload_optimizer.pin_memory: true).",
                evidence=evidence, chart="offload",
            ))  # fmt: skip
    return out


# -- training signals ----------------------------------------------------------------------------


def loss_scale(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """fp16's dynamic loss scale collapsing, and skipped steps."""
    scale = _ordered(e.signals.get("loss_scale"))
    skipped = _ordered(e.signals.get("skipped"), "max")
    in_window = [v for st, v in skipped if st >= e.window[0]]
    skip_share = sum(1 for v in in_window if v > 0) / len(in_window) if in_window else 0.0
    if not scale and not skip_share:
        return []
    latest = scale[-1][1] if scale else None
    top = max(v for _, v in scale) if scale else None
    problems, severity = [], None
    if latest is not None and latest <= s.loss_scale_floor:
        problems.append(f"the loss scale has collapsed to {latest:g}")
        severity = "critical"
    elif latest and top and top / latest > s.loss_scale_drop_factor:
        problems.append(f"the loss scale fell {top / latest:,.0f}-fold (from {top:g} to "
                        f"{latest:g})")  # fmt: skip
        severity = "warning"
    if skip_share > s.skipped_share:
        problems.append(f"{_pct(skip_share)} of the recent steps were skipped (gradient "
                        "overflow: no update)")  # fmt: skip
        severity = "critical" if skip_share >= 0.5 or severity == "critical" else "warning"
    if severity is None:
        return []
    steps = [st for st, v in skipped if v > 0]
    return [
        Finding(
            kind="loss_scale",
            severity=severity,
            steps=(steps[0], steps[-1]) if steps else e.signal_window,
            message="fp16: " + "; ".join(problems) + ".",
            suggestion='Train in bf16 where the hardware has it ("bf16": {"enabled": '
            "true}); otherwise find what overflows (attention logits, a loss without "
            "reduction, a learning rate too high for the warm-up) and clip gradients.",
            evidence={
                "loss_scale": latest,
                "max_loss_scale": top,
                "skipped_share": skip_share,
                "skipped_steps_total": e.totals.get("skipped_steps", (0.0, []))[0],
            },
            chart="training",
        )
    ]


def grad_norm_spike(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Steps whose gradient norm is far above the median of the steps before them."""
    norms = _ordered(e.signals.get("grad_norm"), "max")
    n0 = int(s.grad_norm_baseline_steps)
    spikes = []
    for i in range(n0, len(norms)):
        base = statistics.median(v for _, v in norms[max(0, i - 10 * n0) : i])
        if base > 0 and norms[i][1] > s.grad_norm_spike_ratio * base:
            spikes.append((norms[i][0], norms[i][1] / base))
    if not spikes:
        return []
    worst = max(spikes, key=lambda x: x[1])
    return [
        Finding(
            kind="grad_norm_spike",
            severity="warning",
            steps=(spikes[0][0], spikes[-1][0]),
            message=f"{len(spikes)} step(s) with a gradient norm over "
            f"{s.grad_norm_spike_ratio:g}x the median before them; the worst, step {worst[0]}, "
            f"{worst[1]:.0f}x.",
            suggestion="Check the batches of those steps (bad or duplicated samples); clip "
            "gradients (gradient_clipping: 1.0), lower the learning rate or lengthen warm-up.",
            evidence={"spikes": [{"step": st, "ratio": r} for st, r in spikes[-10:]]},
            chart="training",
        )
    ]


def nonfinite(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Steps with a NaN/inf loss or gradient that were not skipped by the fp16 loss scaler
    (a skipped overflow step is the loss_scale finding's)."""
    bad = _ordered(e.signals.get("nonfinite"), "max")
    skipped = dict(_ordered(e.signals.get("skipped"), "max"))
    steps = [st for st, v in bad if v > 0 and not skipped.get(st)]
    origin = e.origin
    how = "that was not skipped: the weights may hold NaN from there on"
    if not steps and origin.get("forward_module"):
        # Skipped by the loss scaler, but born in a module's forward: still worth naming.
        steps = [st for st, v in bad if v > 0]
        how = "(the loss scaler skipped them; the forward will make NaN again)"
    if not steps:
        return []
    rank = origin.get("first_rank", _typical(e.signals.get("nonfinite"), "max_rank"))
    began = ""
    if origin.get("forward_module"):
        began = (f" It began on rank {origin['forward_rank']} in {origin['forward_module']}: "
                 "the first module whose forward output was not finite (traced at step "
                 f"{origin['forward_step']}).")  # fmt: skip
    elif origin.get("first_module"):
        began = (f" It began on rank {origin['first_rank']} in {origin['first_module']}"
                 f" (step {origin['first_step']}: its local gradients, before the "
                 "reduction).")  # fmt: skip
    return [
        Finding(
            kind="nonfinite",
            severity="critical",
            ranks=(rank,) if rank is not None else (),
            steps=(steps[0], steps[-1]),
            message=f"{len(steps)} step(s) had a non-finite loss or gradient {how}.{began}",
            suggestion="Roll back to the checkpoint before the first such step; look for a "
            "bad batch, a division by zero or log(0) in the loss, a learning rate spike; "
            "enable gradient clipping.",
            evidence={
                "steps": steps[-20:],
                "nonfinite_steps_total": e.totals.get("nonfinite_steps", (0.0, []))[0],
                "first_rank": origin.get("first_rank"),
                "first_module": origin.get("first_module"),
                **{k: v for k, v in origin.items() if k not in ("first_rank", "first_module")},
            },
            chart="training",
        )
    ]


# -- stage choice --------------------------------------------------------------------------------


def _offloads(p: predict.Prediction) -> bool:
    return p.change.offload_optimizer or p.change.offload_param


def stage_choice(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Another stage, offload or bucket size that fits and is predicted faster; or, when
    memory is short, the layout that frees memory at a stated cost; or, when neither, the
    leanest layout without offload, its cost on record (the calibrated planner,
    zerowatch.predict: every other layout, and a quarter and four times the run's
    reduce_bucket_size where the engine counted its calls at each size, its buffers in the
    peak). Offload is named only where memory is short or it is predicted faster, and never
    on a CPU run as a way to free memory (its device memory is the host's); the config is to
    be pasted only where the change is predicted faster or frees memory the run needs.
    Predictions are against the step with the host to itself (predict.uncontended): a run
    that shared its cores with another process is not told that a change would win back
    what that process took."""
    m = measured(e)
    if m is None or m.world_size < 2:
        return []
    preds = [predict.predict(m, c)
             for c in predict.candidates(m) + predict.bucket_candidates(m)]  # fmt: skip
    short = bool(m.peak_bytes and m.capacity_bytes
                 and m.peak_bytes >= s.memory_headroom_share * m.capacity_bytes)  # fmt: skip
    fitting = [p for p in preds if p.fits is not False]
    now = predict.uncontended(m).step_time_s
    # Which figure "now" is: the run's step time as every surface states it, less what
    # other processes took of the host where they did (the figure the predictions are
    # against), then named apart.
    fig = e.step_time
    now_text = (f"now {fmt_seconds(now)} a step with the host to itself, against the "
                f"{fig.cite()} as measured" if now < m.step_time_s * 0.995
                else f"now {fig.text} a step: the {fig.stat}")  # fmt: skip
    fast = [p for p in fitting if p.step_time_s < (1 - s.stage_choice_min_gain) * now]
    candidates = {"candidates": [p.to_dict(m) for p in sorted(preds, key=lambda p: p.step_time_s)]}
    # Offload frees device memory for host memory: nothing on a CPU run, and not asked for
    # where memory is not short.
    lean = [p for p in fitting if p.model_state_bytes < m.model_state_bytes
            and not (_offloads(p) and (m.device == "cpu" or not short))]  # fmt: skip
    paste = "Paste the prediction's config into the DeepSpeed JSON and compare the next run " \
            "with this one."  # fmt: skip
    if fast and not short:
        best = min(fast, key=lambda p: p.step_time_s)
        what = (f"is predicted {_pct(1 - best.step_time_s / now)} faster: "
                f"{fmt_seconds(best.step_time_s)} a step ({now_text}), "
                f"{fmt_bytes(best.model_state_bytes)} of model state per rank (now "
                f"{fmt_bytes(m.model_state_bytes)})")  # fmt: skip
    elif not lean and not short:
        # Nothing faster, nothing that frees memory without offload: the predictions stay on
        # record, and the advice is to keep the layout.
        why = ("offload frees no memory on a CPU run (its device memory is the host's)"
               if m.device == "cpu" else "memory is not short")  # fmt: skip
        return [
            Finding(
                kind="stage_choice",
                severity="info",
                steps=e.window,
                message=f"No layout or bucket size is predicted {_pct(s.stage_choice_min_gain)} "
                f"faster ({now_text}), and none frees model state without "
                f"offload; {why}.",
                suggestion="Keep this layout; evidence.candidates holds every other one's "
                "prediction.",
                evidence=candidates,
                chart="memory",
            )
        ]
    else:
        if not lean:
            return []
        # Short of memory: the fastest that frees any; otherwise (none is enough faster)
        # the leanest without offload, so that the trade of memory for time is on record
        # with its cost.
        best = (min(lean, key=lambda p: (p.step_time_s, p.model_state_bytes)) if short
                else min(lean, key=lambda p: (p.model_state_bytes, p.step_time_s)))  # fmt: skip
        what = (f"frees {fmt_bytes(m.model_state_bytes - best.model_state_bytes)} per rank, "
                f"predicted at {fmt_seconds(best.step_time_s)} a step ({now_text})")  # fmt: skip
    fits = {True: "fits", None: "device capacity unknown"}.get(best.fits, "does not fit")
    c = predict.contention(m)
    shared = (f" This run's steps took {c:.2f}x the CPU time its threads used outside the "
              f"collective waits ({fmt_seconds(m.step_time_s)} a step measured): its threads "
              "were off the CPU for other reasons (another process on its cores, or the job "
              "sleeping or waiting on I/O inside its steps); the times here are for the "
              "host to itself." if c > 1 + s.stage_choice_min_gain else "")  # fmt: skip
    lead = best.change.describe()
    suggestion = paste
    if not short and not fast:
        lead = (f"No layout or bucket size is predicted {_pct(s.stage_choice_min_gain)} "
                f"faster; the leanest layout without offload, {lead},")  # fmt: skip
        room = "memory is not short" if m.capacity_bytes else "the device's capacity is unknown"
        suggestion = (f"Keep this layout (nothing is predicted faster, and {room}); should "
                      "memory run short, the prediction is what that layout would cost.")  # fmt: skip
    gain = 1 - best.step_time_s / now if now > 0 else 0.0
    return [
        Finding(
            kind="stage_choice",
            severity="warning" if gain >= s.stage_choice_warning_gain else "info",
            steps=e.window,
            message=f"{lead} {what}; {fits}.{shared}",
            suggestion=suggestion,
            evidence=candidates,
            prediction=best.to_dict(m),
            chart="memory",
        )
    ]


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
