"""The run as the calibrated planner (zerowatch.predict) sees it, from the doctor's evidence:
the collectives' medians per op and the `predict.Measured` that the stage choice and the
latency-bound collectives price their changes with."""

from __future__ import annotations

import statistics

from zerowatch.server.read.doctor_evidence import Evidence

from zerowatch import events as ev
from zerowatch import predict, theory


def op_stats(e: Evidence) -> dict[str, dict[str, float]]:
    """{op: the window's medians of its calls, bytes, bus bandwidth and latency a step, with
    its seconds a step and its message size} for every op the run made."""
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
    ops = op_stats(e)
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


__all__ = ["measured", "op_stats"]
