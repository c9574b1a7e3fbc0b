"""The doctor on communication: exposed communication (what compute did not hide, with the
knobs of the op that carries most of it) and latency-bound collectives (many small calls
far below what the link reaches with larger messages: buckets too small)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from zerowatch.server.read.doctor_evidence import Evidence
from zerowatch.server.read.doctor_finding import (
    Finding,
    pct,
    sentence,
    share_text,
)
from zerowatch.server.read.doctor_measured import measured, op_stats
from zerowatch.server.read.doctor_settings import DoctorSettings

from zerowatch import predict, theory
from zerowatch.plan import fmt_bytes, fmt_seconds


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
    ops = op_stats(e)
    top = sorted(ops, key=lambda op: -ops[op]["seconds"])
    tips = [*_comm_tips(e, top[0] if top else None),
            "a larger micro-batch or gradient accumulation spreads the same communication "
            "over more compute"]  # fmt: skip
    return [
        Finding(
            kind="exposed_communication",
            severity="warning" if share >= s.exposed_comm_share else "info",
            steps=e.window,
            message=f"On the rank that waits least, {pct(share)} of the step is "
            f"communication that compute does not hide ({fmt_seconds(exposed)} a step; "
            f"medians over steps {e.window[0]:,}–{e.window[1]:,})"
            + (f", most of it in {top[0]}" if top else "")
            + f"; the run's {e.exposed_share.cite()}.",
            suggestion=sentence("; ".join(tips)),
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
    """The bus bandwidth the agent measured on the job's process group with one large
    message when it attached (zerowatch/rehearse/link.py), or None."""
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
    is not judged); where they do not (every collective small), the agent's probe of the
    link when it attached ("rehearsal"), else `link_busbw_bytes_per_s` ("settings")."""
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
                f"the agent attached ({bw}/s)")  # fmt: skip
    return f"the link's bandwidth (link_busbw_bytes_per_s: {bw}/s)"


def latency_bound_collectives(e: Evidence, s: DoctorSettings) -> list[Finding]:
    """Many small collectives whose bus bandwidth sits far below what the link reaches with
    large messages (`_references`): buckets too small."""
    ops = op_stats(e)
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
                f"{share_text(st['busbw'] / ref['reference_busbw'])} of {_reference_words(ref)}: "
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


__all__ = ["exposed_communication", "latency_bound_collectives"]
