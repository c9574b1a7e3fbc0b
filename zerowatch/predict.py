"""The planner calibrated with a run's own measurements: what another ZeRO stage, offload or
bucket size would cost this job, per rank and per optimizer step (the doctor's predictions).

The capacity planner (plan.py) prices a configuration from the ZeRO model alone
(theory.py). Here the model is anchored on what the run measured (`Measured`: medians over
its steps), so that only the differences between the two configurations come from the
model:

    predicted step = measured step - (exposed comm + optimizer + offload copies
                                      + overlap cost + communication path)
                                   + (the same five for the other configuration)

- model-state memory: theory's bytes of the other layout times the run's own overhead
  above theory; the peak moves by the same difference;
- communication: where the bundled engine's calls were counted (`CountedCalls`, from
  `engine_info["collective_calls"]`, zerowatch/rehearse), each op's calls times the run's
  measured seconds per call; else theory's bytes at the run's bus bandwidth per op. The
  share that compute did not hide stays the run's own;
- the optimizer step scales with the elements a rank updates; offload adds its copies at
  the run's copy bandwidth (where the run could not measure a rate, an assumed one, and
  `calibrated` is False);
- the overlap cost (CPU runs): the CPU the communication threads take from compute
  (`other_cpu_s`), moving with the communication seconds or the calls' ring passes;
- the communication path on the training thread outside the waits (`comm_phase_host_s`;
  stage 3: its parameter management): the run's own at its stage, another stage's as it
  was rehearsed on the job (`management_s`);
- contention: a CPU run slowed by another process is first taken back to its host to
  itself (`uncontended`).

A `reduce_bucket_size` change is priced the same way, part by part, with the counted calls
at the new size (`_counted_bucket`). The formulas, the measurements they rest on and their
limits: docs/doctor.md, "The prediction". Standard library, theory and plan only.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from zerowatch import plan, theory


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What a run measured, per rank and per optimizer step (medians over its steps)."""

    num_params: int
    world_size: int
    stage: int
    precision: str = "fp32"
    offload_optimizer: bool = False
    offload_param: bool = False
    gradient_accumulation_steps: int = 1
    device: str = "cpu"
    step_time_s: float
    exposed_comm_s: float
    optimizer_s: float = 0.0
    #: Seconds per step spent in each op (latency summed over its calls).
    comm_s: dict[str, float] = field(default_factory=dict)
    #: Bus bandwidth per op (B/s), and calls per step.
    busbw: dict[str, float] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)
    #: Bytes per step per op (nccl-tests size), as measured.
    comm_bytes: dict[str, float] = field(default_factory=dict)
    #: Device model-state bytes held per rank, and the peak and capacity (None: unknown).
    model_state_bytes: float = 0.0
    peak_bytes: float | None = None
    capacity_bytes: float | None = None
    offload_bytes_per_s: float | None = None
    zero_config: dict[str, Any] = field(default_factory=dict)
    #: CPU seconds per step on the training thread and on the process's other threads (its
    #: communication threads), on a run that computes on the host; None: not measured.
    thread_cpu_s: float | None = None
    other_cpu_s: float | None = None
    #: Seconds per step of the communication phases (param_gather, grad_reduce: their
    #: exclusive parts) not spent waiting on a collective: the training thread's own work
    #: around the collectives; at stage 3 its parameter management. None: not measured (a
    #: GPU run, events without the exclusive parts).
    comm_phase_host_s: float | None = None
    #: The count of the bundled engine's collective calls per step of each stage and
    #: bucket size (engine_info["collective_calls"]); None where the run has none.
    counted_calls: CountedCalls | None = None
    #: The bus bandwidth the job's links reach with large messages (B/s), where the run's
    #: own ops carry none large enough to show it: the probe of the link when the agent
    #: attached (zerowatch/rehearse/link.py), or a figure the doctor was given. β of the
    #: α-β split where it is above the run's best (`call_costs`, `reference_bandwidth`);
    #: None: the run's own.
    link_busbw: float | None = None


def _seconds(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


@dataclass(frozen=True, kw_only=True)
class CountedCalls:
    """Collective calls per optimizer step of each stage (0-3) at a range of
    `reduce_bucket_size` values, as counted from the bundled engine's layout
    (zerowatch/rehearse/counts.py)."""

    #: The run's own reduce_bucket_size (elements), and the sizes counted, ascending.
    reduce_bucket_size: int
    bucket_sizes: tuple[int, ...]
    #: stage -> op -> calls per step at each of `bucket_sizes`.
    calls: dict[int, dict[str, tuple[int, ...]]]
    #: stage -> seconds per step of that stage's communication path on the training thread
    #: outside the collectives' waits (stage 3: its parameter management; stages 0-2: their
    #: bucket handling), as rehearsed on the job's process group when the agent attached
    #: (zerowatch/rehearse/paths.py); empty: not rehearsed (a GPU, one rank, a model built
    #: under zero.Init, `instrument(rehearse=False)`).
    management_s: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_engine_info(cls, info: Any) -> CountedCalls | None:
        """The table of a run's engine_info (None: absent or not the expected shape)."""
        raw = info.get("collective_calls") if isinstance(info, dict) else None
        if not isinstance(raw, dict):
            return None
        try:
            sizes = tuple(int(b) for b in raw["bucket_sizes"])
            calls = {int(st): {str(op): tuple(int(c) for c in per) for op, per in ops.items()}
                     for st, ops in raw["calls"].items()}  # fmt: skip
            own = int(raw["reduce_bucket_size"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        table = raw.get("management_s")
        per_stage: dict[int, float] = {}
        if isinstance(table, dict):
            try:
                per_stage = {int(st): float(v) for st, v in table.items() if _seconds(v)}
            except (TypeError, ValueError):
                per_stage = {}
        if (
            not sizes
            or list(sizes) != sorted(sizes)
            or any(len(per) != len(sizes) for ops in calls.values() for per in ops.values())
        ):
            return None
        return cls(reduce_bucket_size=own, bucket_sizes=sizes, calls=calls,
                   management_s=per_stage)  # fmt: skip

    def at(self, stage: int, bucket: int | None = None) -> dict[str, float] | None:
        """Calls per op of `stage` with buckets of `bucket` elements (default: the run's):
        the count at the largest size counted that is not larger (None: stage not counted,
        or a bucket below every size counted)."""
        ops = self.calls.get(stage)
        if ops is None:
            return None
        size = self.reduce_bucket_size if bucket is None else bucket
        i = bisect.bisect_right(self.bucket_sizes, size) - 1
        if i < 0:
            return None
        return {op: float(per[i]) for op, per in ops.items() if per[i] > 0}


@dataclass(frozen=True, kw_only=True)
class Change:
    """One change to price: a layout, or one bucket size (elements) of the current layout."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False
    bucket: tuple[str, int] | None = None
    #: The op whose calls the bucket size sets (default: from the key and the stage).
    bucket_op: str | None = None

    def fragment(self, current: Measured) -> dict[str, Any]:
        """The DeepSpeed JSON fragment to paste."""
        if self.bucket is not None:
            return {"zero_optimization": {self.bucket[0]: self.bucket[1]}}
        z: dict[str, Any] = {"stage": self.stage}
        if self.offload_optimizer != current.offload_optimizer:
            z["offload_optimizer"] = {"device": "cpu" if self.offload_optimizer else "none"}
        if self.offload_param != current.offload_param:
            z["offload_param"] = {"device": "cpu" if self.offload_param else "none"}
        return {"zero_optimization": z}

    def describe(self) -> str:
        if self.bucket is not None:
            return f"{self.bucket[0]} = {self.bucket[1]:,}"
        lay = plan.Layout(self.stage, self.offload_optimizer, self.offload_param)
        return f"ZeRO stage {self.stage}, offload {lay.offload}"


@dataclass(frozen=True, kw_only=True)
class Prediction:
    change: Change
    step_time_s: float
    model_state_bytes: float
    peak_bytes: float | None
    fits: bool | None
    #: Which parts were calibrated on this run (False: a default rate was assumed).
    calibrated: bool
    basis: dict[str, float]

    def to_dict(self, current: Measured) -> dict[str, Any]:
        return {
            "change": self.change.describe(),
            "config": self.change.fragment(current),
            "step_time_s": self.step_time_s,
            "step_time_now_s": current.step_time_s,
            "model_state_bytes": self.model_state_bytes,
            "model_state_now_bytes": current.model_state_bytes,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "calibrated": self.calibrated,
            "basis": self.basis,
        }


#: Rates used only where the run could not measure them.
HOST_COPY_BYTES_PER_S = 10e9
CPU_ADAM_PARAMS_PER_S = 1e9


def _opt_elems(psi: int, n: int, stage: int) -> int:
    return psi if stage == 0 else theory.shard(psi, n)


def _layout_bytes(m: Measured, stage: int, off_opt: bool, off_par: bool) -> float:
    return float(
        theory.model_state_bytes(
            m.num_params, m.world_size, stage, precision=m.precision,
            offload_optimizer=off_opt, offload_param=off_par,
        ).device_total
    )  # fmt: skip


def _comm_seconds(m: Measured, stage: int) -> float:
    """Seconds of communication per step of a stage: by its counted calls and bytes where
    the run has them (`counted_comm_seconds`), else its bytes at the run's bandwidth
    per op."""
    counted = counted_comm_seconds(m, stage)
    if counted is not None:
        return counted
    sizes = theory.comm_bytes_per_step(
        m.num_params, m.world_size, stage, precision=m.precision,
        gradient_accumulation_steps=m.gradient_accumulation_steps,
    )  # fmt: skip
    known = [bw for bw in m.busbw.values() if bw > 0]
    fallback = statistics.median(known) if known else None
    total = 0.0
    for op, size in sizes.items():
        bw = m.busbw.get(op) or fallback
        if not bw:
            return math.nan
        total += theory.comm_traffic_bytes({op: size}, m.world_size) / bw
    return total


def call_costs(m: Measured) -> tuple[dict[str, float], float] | None:
    """(α per op: the run's measured seconds per call of each op beyond its bytes at β,
    β: the best bus bandwidth the run reached, or `link_busbw` where that is higher), or
    None where the run measured no op.
    An op's seconds are calls × α + bus bytes / β."""
    ops = [op for op in m.comm_s if m.calls.get(op, 0) > 0 and m.busbw.get(op, 0) > 0
           and m.comm_s[op] > 0]  # fmt: skip
    if not ops:
        return None
    beta = max([m.busbw[op] for op in ops] + [m.link_busbw or 0.0])
    alpha = {op: max(m.comm_s[op] - m.busbw[op] * m.comm_s[op] / beta, 0.0) / m.calls[op]
             for op in ops}  # fmt: skip
    return alpha, beta


#: An op's measured seconds per call price another configuration's calls of that op only
#: while their messages are at most this many times larger (a stage-1 run's all-reduce is
#: the gradient norm's 4 bytes; stage 0 all-reduces whole buckets).
CALL_SIZE_FACTOR = 4.0


def call_latencies(m: Measured) -> dict[str, float]:
    """The run's measured seconds per call of each op it made (its latency, bytes included,
    at its own message size and overlap)."""
    return {op: s / m.calls[op] for op, s in m.comm_s.items()
            if m.calls.get(op, 0) > 0 and s > 0}  # fmt: skip


def counted_comm_seconds(m: Measured, stage: int, bucket: int | None = None) -> float | None:
    """Seconds of communication per step of `stage` (buckets of `bucket` elements; default
    the run's) from the engine's counted calls: Σ over ops of calls × the run's measured
    seconds per call of that op (`call_latencies`). An op the run did not make, or whose
    messages there are more than CALL_SIZE_FACTOR times the run's (theory's bytes over the
    counted calls), takes the median of the run's other ops. None without a count or a
    measured op."""
    if m.counted_calls is None:
        return None
    calls = m.counted_calls.at(stage, bucket)
    latency = call_latencies(m)
    if calls is None or not latency:
        return None
    sizes = theory.comm_bytes_per_step(
        m.num_params, m.world_size, stage, precision=m.precision,
        gradient_accumulation_steps=m.gradient_accumulation_steps,
    )  # fmt: skip
    fallback = statistics.median(latency.values())
    total = 0.0
    for op, n in calls.items():
        per_call = latency.get(op, fallback)
        mine = _message_bytes(m, op)
        if op in latency and mine is not None and sizes.get(op, 0) / n > CALL_SIZE_FACTOR * mine:
            others = [v for o, v in latency.items() if o != op]
            per_call = statistics.median(others) if others else per_call
        total += n * per_call
    return total


def _copies(m: Measured, stage: int, off_opt: bool, off_par: bool) -> float:
    lay = plan.Layout(stage, off_opt, off_par)
    p = theory.PARAM_BYTES[m.precision]
    return float(
        plan._offload_copies(m.num_params, m.world_size, p, m.gradient_accumulation_steps, lay)
    )


def contention(m: Measured) -> float:
    """c >= 1: how much longer the run's step, less its collective waits, took than the CPU
    its training thread and communication threads used (module docstring); 1 where the
    clocks were not read (a GPU run, events without them) or explain the step."""
    if m.thread_cpu_s is None or m.other_cpu_s is None or m.device != "cpu":
        return 1.0
    own = max(m.thread_cpu_s, 0.0) + max(m.other_cpu_s, 0.0)
    busy = m.step_time_s - m.exposed_comm_s
    return busy / own if own > 0 and busy > own else 1.0


def uncontended(m: Measured) -> Measured:
    """The run with every wall-clock figure divided by its contention (bandwidths
    multiplied): what it would have measured with the host to itself. The CPU clocks and
    the bytes are kept."""
    c = contention(m)
    if c == 1.0:
        return m
    return replace(
        m, step_time_s=m.step_time_s / c, exposed_comm_s=m.exposed_comm_s / c,
        optimizer_s=m.optimizer_s / c, comm_s={op: s / c for op, s in m.comm_s.items()},
        busbw={op: bw * c for op, bw in m.busbw.items()},
        offload_bytes_per_s=None if m.offload_bytes_per_s is None else m.offload_bytes_per_s * c,
        comm_phase_host_s=None if m.comm_phase_host_s is None else m.comm_phase_host_s / c,
    )  # fmt: skip


def predict(m: Measured, change: Change) -> Prediction:
    """The step time and per-rank memory of `change` applied to the measured run (its
    wall-clock figures taken back to the host to itself first: `uncontended`)."""
    c = contention(m)
    m = uncontended(m)
    calibrated = True
    copy_bw = m.offload_bytes_per_s or HOST_COPY_BYTES_PER_S
    if not m.offload_bytes_per_s:
        calibrated = calibrated and not (change.offload_optimizer or change.offload_param)
    now_state = _layout_bytes(m, m.stage, m.offload_optimizer, m.offload_param)
    overhead = m.model_state_bytes / now_state if now_state and m.model_state_bytes else 1.0
    basis: dict[str, float] = {"state_overhead": overhead, "contention": c,
                               "step_time_uncontended_s": m.step_time_s}  # fmt: skip
    if change.bucket is not None:
        key, size = change.bucket
        counted = _counted_bucket(m, key, size)
        if counted is not None:
            now, new = counted
            basis.update(counted_calls=1.0, **{f"{k}_now": v for k, v in now.items()},
                         **{f"{k}_new": v for k, v in new.items()})  # fmt: skip
            step = m.step_time_s - sum(now.values()) + sum(new.values())
            # The training thread's CPU work outside its communication path stays: at
            # least its CPU clock less the path's wall time. A run with little compute has
            # parts that sum to about its whole step (the comm threads' CPU runs during
            # the waits it also counts), and far fewer calls would take nearly all of them
            # off.
            floor = 0.0
            if m.thread_cpu_s is not None:
                floor = m.thread_cpu_s - now["management_s"] + new["management_s"]
            if step < floor:
                basis["step_floor_s"] = floor
            step = max(step, floor, 0.0)
        else:
            op = change.bucket_op or (
                "reduce_scatter" if key == "reduce_bucket_size" else "all_gather"
            )
            if change.bucket_op is None and m.stage == 0 and key == "reduce_bucket_size":
                op = "all_reduce"
            delta, alpha, beta = _bucket_delta(m, op, size)
            rho = overlap_cpu_per_comm_s(m, sum(m.comm_s.values()))
            basis.update(alpha_s=alpha, beta_bytes_per_s=beta, overlap_cpu_per_comm_s=rho)
            step = m.step_time_s + delta * _exposed_share(m) + rho * delta
        peak = None if m.peak_bytes is None else m.peak_bytes + _buffer_delta(m, key, size)
        return Prediction(change=change, step_time_s=step, model_state_bytes=m.model_state_bytes,
                          peak_bytes=peak, fits=_fits(m, peak), calibrated=calibrated,
                          basis=basis)  # fmt: skip
    st, oo, op_ = change.stage, change.offload_optimizer, change.offload_param
    comm_now, comm_new = _comm_seconds(m, m.stage), _comm_seconds(m, st)
    exposed_new = m.exposed_comm_s * (comm_new / comm_now) if comm_now else m.exposed_comm_s
    if math.isnan(exposed_new):
        exposed_new = m.exposed_comm_s
    elems_now = _opt_elems(m.num_params, m.world_size, m.stage)
    elems_new = _opt_elems(m.num_params, m.world_size, st)
    opt_new = m.optimizer_s * elems_new / max(elems_now, 1)
    if m.device != "cpu" and oo != m.offload_optimizer:
        calibrated = False
        if oo:
            opt_new = elems_new / CPU_ADAM_PARAMS_PER_S
        else:
            opt_new = m.optimizer_s * 0.1 * elems_new / max(elems_now, 1)
    copies_now = _copies(m, m.stage, m.offload_optimizer, m.offload_param) / copy_bw
    copies_new = _copies(m, st, oo, op_) / copy_bw
    rho = overlap_cpu_per_comm_s(m, comm_now)
    overlap_now = rho * comm_now
    overlap_new = rho * comm_new if not math.isnan(comm_new) else overlap_now
    counted_now, counted_new = comm_thread_cpu_s(m, m.stage), comm_thread_cpu_s(m, st)
    if counted_now is not None and counted_new is not None:
        overlap_now, overlap_new = counted_now, counted_new
        basis["overlap_by_calls"] = 1.0
    manage_now, manage_new = management_s(m, m.stage), management_s(m, st)
    if st != m.stage and m.device == "cpu" and rehearsed_management_s(m, st) is None:
        # The other stage's path on the training thread is unknown (not rehearsed): 0.
        calibrated = False
    step = (m.step_time_s - m.exposed_comm_s - m.optimizer_s - copies_now - overlap_now
            - manage_now + exposed_new + opt_new + copies_new + overlap_new
            + manage_new)  # fmt: skip
    state = _layout_bytes(m, st, oo, op_) * overhead
    peak = None if m.peak_bytes is None else m.peak_bytes - m.model_state_bytes + state
    basis.update(comm_s_now=comm_now, comm_s_new=comm_new, optimizer_s_new=opt_new,
                 copies_s_new=copies_new, overlap_s_now=overlap_now,
                 overlap_s_new=overlap_new, management_s_now=manage_now,
                 management_s_new=manage_new)  # fmt: skip
    return Prediction(change=change, step_time_s=max(step, 0.0), model_state_bytes=state,
                      peak_bytes=peak, fits=_fits(m, peak), calibrated=calibrated,
                      basis=basis)  # fmt: skip


def overlap_cpu_per_comm_s(m: Measured, comm_s: float) -> float:
    """ρ: CPU seconds the rank's communication threads use per second of its communication
    (`other_cpu_s` over `comm_s`, the run's communication seconds per step); 0 where the run
    did not measure it (a GPU run, events without the clock) or communicated nothing."""
    if m.other_cpu_s is None or not comm_s or math.isnan(comm_s) or comm_s <= 0:
        return 0.0
    return max(m.other_cpu_s, 0.0) / comm_s


def ring_passes(calls: dict[str, float]) -> float:
    """Calls weighted by the passes over the ring each makes: an all-reduce is a
    reduce-scatter and an all-gather (its nccl-tests bus factor is twice theirs), every
    other op one."""
    return sum(c * (2.0 if op == "all_reduce" else 1.0) for op, c in calls.items())


def comm_thread_cpu_s(m: Measured, stage: int, bucket: int | None = None) -> float | None:
    """CPU seconds per step of the rank's communication threads at `stage` (buckets of
    `bucket` elements; default the run's), from the engine's counted calls: the run's
    `other_cpu_s` per ring pass
    (`ring_passes` of its own stage's counted calls) times the stage's passes. The comm
    threads' CPU goes per call, not per second of latency: in the stored bench runs it is
    0.4-0.75 ms a call at stages 1, 2 and 3 alike within each run set, where per byte it
    moves 1.6 times between stage 1 and 3, and the latency of stage 1's reduce-scatters
    (issued together at the end of backward) includes their wait in the queue. None
    without the counts or the clock (the overlap cost then follows the communication
    seconds: `overlap_cpu_per_comm_s`)."""
    if m.other_cpu_s is None or m.counted_calls is None:
        return None
    now, new = m.counted_calls.at(m.stage), m.counted_calls.at(stage, bucket)
    if not now or new is None or ring_passes(now) <= 0:
        return None
    return max(m.other_cpu_s, 0.0) * ring_passes(new) / ring_passes(now)


def stage3_management_s(m: Measured) -> float:
    """Seconds per step of stage 3's parameter management on the training thread: the
    run's `comm_phase_host_s` on a stage-3 CPU run; 0 below stage 3 (the run measured
    the lower stage's own bucket handling, which a stage-1/2 layout keeps), on a GPU and
    where not measured."""
    if m.stage != 3 or m.device != "cpu" or m.comm_phase_host_s is None:
        return 0.0
    return max(m.comm_phase_host_s, 0.0)


def rehearsed_management_s(m: Measured, stage: int) -> float | None:
    """Seconds per step of `stage`'s communication path on the training thread outside the
    collectives' waits, as rehearsed on the job's process group when the agent attached
    (zerowatch/rehearse/paths.py: the real calls, asynchronous, with the stage's
    bookkeeping around them; the median of its passes). None on a GPU and where it was
    not rehearsed."""
    cc = m.counted_calls
    if m.device != "cpu" or cc is None:
        return None
    return cc.management_s.get(stage)


def management_s(m: Measured, stage: int) -> float:
    """Seconds per step of the training thread's communication path outside the
    collectives' waits at `stage` (`comm_phase_host_s`: the communication phases' time
    less the waits): at the run's own stage what it measured, where the stages were
    rehearsed (a multi-rank CPU run of the bundled engine) or at stage 3 (its parameter
    management); at another stage its rehearsed figure. 0 on a GPU (the host's bookkeeping
    runs ahead of the device's queue) and where neither is there (a lower stage without the
    rehearsed figures: the run's own bucket handling is kept as it is, inside its step, and
    the prediction is not `calibrated`)."""
    if m.device != "cpu":
        return 0.0
    rehearsed = m.counted_calls is not None and bool(m.counted_calls.management_s)
    if stage == m.stage:
        return stage3_management_s(m) if m.stage == 3 or not rehearsed else _own(m)
    return rehearsed_management_s(m, stage) or 0.0


def _own(m: Measured) -> float:
    return 0.0 if m.comm_phase_host_s is None else max(m.comm_phase_host_s, 0.0)


def _exposed_share(m: Measured) -> float:
    total = sum(m.comm_s.values())
    return min(1.0, m.exposed_comm_s / total) if total > 0 else 1.0


def _fits(m: Measured, peak: float | None, share: float = 0.9) -> bool | None:
    if peak is None or not m.capacity_bytes:
        return None
    return peak <= share * m.capacity_bytes


def reference_bandwidth(m: Measured, op: str, size_factor: float = 4.0) -> float | None:
    """The best bus bandwidth of ops whose messages are `size_factor` times larger than
    `op`'s on this run, else `link_busbw` (None: neither)."""
    mine = _message_bytes(m, op)
    if mine is None:
        return None
    best = [m.busbw[o] for o in m.busbw if o != op and (_message_bytes(m, o) or 0) >= size_factor
            * mine and m.busbw[o] > 0]  # fmt: skip
    return max(best) if best else m.link_busbw


def _message_bytes(m: Measured, op: str) -> float | None:
    calls = m.calls.get(op, 0.0)
    return m.comm_bytes.get(op, 0.0) / calls if calls > 0 else None


def _bucket_delta(m: Measured, op: str, bucket_elems: int) -> tuple[float, float, float]:
    """(seconds of `op` per step saved (negative) or added, α, β) with buckets of
    `bucket_elems` elements: calls × α + bytes / β, α-β calibrated on the run."""
    nbytes, calls, secs = m.comm_bytes.get(op, 0.0), m.calls.get(op, 0.0), m.comm_s.get(op, 0.0)
    beta = reference_bandwidth(m, op) or m.busbw.get(op) or 0.0
    if calls <= 0 or beta <= 0 or secs <= 0:
        return 0.0, 0.0, beta
    traffic = m.busbw.get(op, 0.0) * secs  # bus bytes per step: busbw = traffic / seconds
    alpha = max((secs - traffic / beta) / calls, 0.0)
    new_calls = max(1.0, math.ceil(nbytes / max(bucket_elems * theory.PARAM_BYTES[m.precision], 1)))
    return new_calls * alpha + traffic / beta - secs, alpha, beta


_BUFFER_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters")  # fmt: skip


def _buffer_delta(m: Measured, key: str, size: int) -> float:
    """Device bytes per rank a bucket size adds to the peak (negative: frees): the transient
    buffers the engine's config implies (plan.buffer_bytes: two reduce buckets with
    `overlap_comm`), at the run's zero_optimization values and with `key` set to `size`;
    0 where the run's own value of `key` is not known (absent, "auto": the engine's default
    is not ours to guess). The engine's count of its calls carries its own reduce size."""
    z = m.zero_config
    now: dict[str, Any] = {k: int(v) for k in _BUFFER_KEYS
                           if isinstance(v := z.get(k), int | float) and not isinstance(v, bool)
                           and v > 0}  # fmt: skip
    if m.counted_calls is not None:
        now["reduce_bucket_size"] = m.counted_calls.reduce_bucket_size
    now["overlap_comm"] = z.get("overlap_comm") is True
    if key not in now:
        return 0.0

    def total(cfg: dict[str, Any]) -> int:
        return sum(plan.buffer_bytes(m.num_params, m.precision, m.stage, **cfg).values())

    return float(total({**now, key: int(size)}) - total(now))


def _counted_bucket(
    m: Measured, key: str, size: int
) -> tuple[dict[str, float], dict[str, float]] | None:
    """({part: seconds per step} now, the same with buckets of `size` elements) for the
    parts a `reduce_bucket_size` change moves, priced as a change of layout is (`predict`)
    with the engine's counted calls of the run's stage at each size: the exposed waits
    (`exposed_s`) move with the communication seconds, which move by the calls added or
    removed, each at its op's α (`call_costs`: the bytes are the same, in more or fewer
    messages; a run's measured seconds per call hold its own message size, and a smaller
    bucket's calls are shorter); the communication threads' CPU (`overlap_s`)
    with the calls' ring passes (`comm_thread_cpu_s`: it goes per call); the training
    thread's communication path (`management_s`) with the calls it handles: at stage 3 its
    units' gathers and reduce-scatters (the parameter management goes per unit), at stages
    0-2 every call (the bucket handling goes per bucket). None: not counted, or a key the
    counts do not follow (the bundled engine gathers per reduce bucket:
    `allgather_bucket_size` and the prefetch size change no call)."""
    cc = m.counted_calls
    if cc is None or key != "reduce_bucket_size":
        return None
    calls_now, calls_new = cc.at(m.stage), cc.at(m.stage, size)
    costs = call_costs(m)
    comm_now = sum(m.comm_s.values())
    if not calls_now or calls_new is None or costs is None or comm_now <= 0:
        return None
    alpha, _ = costs
    fallback = statistics.median(alpha.values())
    comm_new = comm_now + sum((calls_new.get(op, 0.0) - calls_now.get(op, 0.0))
                              * alpha.get(op, fallback) for op in set(calls_now) | set(calls_new))  # fmt: skip
    comm_new = max(comm_new, 0.0)
    handled = ("all_gather", "reduce_scatter") if m.stage == 3 else tuple(calls_now)
    per_now = sum(calls_now.get(op, 0.0) for op in handled)
    per_new = sum(calls_new.get(op, 0.0) for op in handled)
    path = management_s(m, m.stage)
    now = {"exposed_s": m.exposed_comm_s, "overlap_s": comm_thread_cpu_s(m, m.stage) or 0.0,
           "management_s": path}  # fmt: skip
    new = {"exposed_s": m.exposed_comm_s * comm_new / comm_now,
           "overlap_s": comm_thread_cpu_s(m, m.stage, size) or 0.0,
           "management_s": path * per_new / per_now if per_now else path}  # fmt: skip
    return now, new


#: The bucket sizes `bucket_candidates` prices: the run's own times and divided by this.
BUCKET_STEP = 4


def bucket_candidates(m: Measured) -> list[Change]:
    """`reduce_bucket_size` changes of the run's own layout, one each way: the size the engine
    counted nearest (in ratio) to a quarter of the run's (BUCKET_STEP), and to four times
    it; where that size makes the same calls as the run's own (stage 3 cuts its units by
    the module tree, and a size at or above the model's is one bucket), the next counted
    size further that way that does not. So the calls each is priced with are counted, not
    assumed, and each changes them. Only where the bundled engine's calls were counted at
    each size (a foreign engine's calls at another size are not known: its latency-bound
    collectives still get their bucket size from that finding)."""
    cc = m.counted_calls
    own_calls = None if cc is None else cc.at(m.stage)
    if cc is None or own_calls is None:
        return []
    own = cc.reduce_bucket_size
    out: list[Change] = []
    for target, further in ((own / BUCKET_STEP, -1), (own * BUCKET_STEP, 1)):
        i = min(
            range(len(cc.bucket_sizes)), key=lambda k: abs(math.log(cc.bucket_sizes[k] / target))
        )
        while 0 <= i < len(cc.bucket_sizes) and (
            (cc.bucket_sizes[i] - own) * further <= 0
            or cc.at(m.stage, cc.bucket_sizes[i]) == own_calls
        ):
            i += further
        if 0 <= i < len(cc.bucket_sizes):
            out.append(Change(stage=m.stage, offload_optimizer=m.offload_optimizer,
                              offload_param=m.offload_param,
                              bucket=("reduce_bucket_size", cc.bucket_sizes[i])))  # fmt: skip
    return out


def candidates(m: Measured) -> list[Change]:
    """Every layout the planner compares that differs from the run's."""
    out = []
    for lay in plan.LAYOUTS:
        if (lay.stage, lay.offload_optimizer, lay.offload_param) == (
            m.stage,
            m.offload_optimizer,
            m.offload_param,
        ):
            continue
        out.append(Change(stage=lay.stage, offload_optimizer=lay.offload_optimizer,
                          offload_param=lay.offload_param))  # fmt: skip
    return out


__all__ = [
    "BUCKET_STEP",
    "CALL_SIZE_FACTOR",
    "CPU_ADAM_PARAMS_PER_S",
    "HOST_COPY_BYTES_PER_S",
    "Change",
    "CountedCalls",
    "Measured",
    "Prediction",
    "bucket_candidates",
    "call_costs",
    "call_latencies",
    "candidates",
    "comm_thread_cpu_s",
    "contention",
    "counted_comm_seconds",
    "management_s",
    "overlap_cpu_per_comm_s",
    "predict",
    "reference_bandwidth",
    "rehearsed_management_s",
    "ring_passes",
    "stage3_management_s",
    "uncontended",
]
