"""Simulated runs: realistic event streams without torch, for the server's tests, the alert
end-to-end tests, the dashboards' tests and the ingest benchmark.

The numbers follow the ZeRO model (zerowatch.theory): collective sizes per step are the
theoretical ones for the stage, model-state bytes are the theory's, and phase times are
drawn around a base step time. Knobs make a run regress (step time grows after a step),
stall (stop emitting), spike its grad norm, or have a straggler rank; with GPU telemetry
(`gpu`), a rank's GPU can be throttled or report XID and ECC errors.

Standard library only.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zerowatch import events as ev
from zerowatch import theory


@dataclass(frozen=True, kw_only=True)
class SimSpec:
    """What to simulate."""

    name: str = "sim"
    project: str = "default"
    tags: tuple[str, ...] = ()
    world_size: int = 2
    stage: int = 3
    precision: str = "bf16"
    offload_optimizer: bool = False
    num_params: int = 125_000_000
    micro_batch: int = 8
    seq_len: int = 1024
    step_time_s: float = 0.5
    #: The peak FLOP/s of a rank's device (e.g. 989.5e12, an H100 SXM in bf16): steps carry
    #: their MFU, 6·num_params FLOPs a token; None: no MFU, as on a device not in the table.
    peak_flops: float | None = None
    #: From this step on, step times are multiplied by `regress_factor`.
    regress_at: int | None = None
    regress_factor: float = 1.5
    #: This rank runs `straggler_factor` slower.
    straggler_rank: int | None = None
    straggler_factor: float = 1.3
    #: At this step the grad norm jumps 50-fold.
    grad_spike_at: int | None = None
    #: Ranks per host (torchrun's nproc_per_node): rank r runs on host r // ranks_per_host.
    ranks_per_host: int = 8
    #: Events carry the launcher's node index (torchrun's GROUP_RANK: r // ranks_per_host),
    #: as the agent sends it; False: host names alone (an agent without node ids).
    node_ids: bool = False
    #: Every rank's steps carry GPU telemetry (events.GpuTelemetry, as the agent's NVML
    #: probe sends it): a healthy GPU unless named below. On when a GPU knob is set.
    gpu: bool = False
    #: This rank's GPU is throttled (`gpu_throttle_reasons`, NVML's bits: 0x4 power cap)
    #: in `gpu_throttled_share` of its steps, its SM clock then at 75% of its maximum.
    gpu_throttled_rank: int | None = None
    gpu_throttle_reasons: int = 0x4
    gpu_throttled_share: float = 1.0
    #: This rank's GPU reports one more critical XID (79) and one more uncorrected ECC
    #: error every step from `gpu_errors_at` on.
    gpu_error_rank: int | None = None
    gpu_errors_at: int = 0
    #: Every this many steps carries raw spans (for the trace export); 0 = never.
    spans_every: int = 10
    #: Heartbeats (`heartbeats`): from step `hang_at` on, these ranks never begin the step
    #: (stuck in their data loader) and every other rank waits in the step's first
    #: collective. None: no hang.
    hang_at: int | None = None
    hang_ranks: tuple[int, ...] = ()
    #: Collectives each rank issues a step on the default group (the heartbeats' seqs).
    collectives_per_step: int = 24
    seed: int = 0


def run_create(spec: SimSpec, run_id: str | None = None) -> ev.RunCreate:
    """The RunCreate a real agent would send for this spec."""
    ms = theory.model_state_bytes(
        spec.num_params, spec.world_size, spec.stage,
        precision=spec.precision, offload_optimizer=spec.offload_optimizer,
    )  # fmt: skip
    return ev.RunCreate(
        run_id=run_id or uuid.uuid4().hex,
        name=spec.name,
        project=spec.project,
        tags=list(spec.tags),
        world_size=spec.world_size,
        engine="simulated",
        zero_stage=spec.stage,
        offload_optimizer="cpu" if spec.offload_optimizer else "none",
        precision=spec.precision,  # type: ignore[arg-type]
        config={
            "zero_optimization": {"stage": spec.stage},
            "train_micro_batch_size_per_gpu": spec.micro_batch,
        },
        param_count=spec.num_params,
        hosts=[host_of(spec, r) for r in range(0, spec.world_size, spec.ranks_per_host)],
        theory=ms.flat(),
        theory_comm=theory.comm_bytes_per_step(
            spec.num_params, spec.world_size, spec.stage, precision=spec.precision
        ),
        started_at=time.time(),
    )


def host_of(spec: SimSpec, rank: int) -> str:
    """The simulated host name of a rank."""
    return f"sim-node-{rank // spec.ranks_per_host:04d}"


def _collectives(spec: SimSpec, rng: random.Random, scale: float) -> list[ev.CollectiveStats]:
    sizes = theory.comm_bytes_per_step(
        spec.num_params, spec.world_size, spec.stage, precision=spec.precision
    )
    purpose = {"all_reduce": "grad_reduce", "reduce_scatter": "grad_reduce",
               "all_gather": "param_fetch" if spec.stage == 3 else "optimizer_gather"}  # fmt: skip
    out = []
    for op, nbytes in sizes.items():
        count = 24 if spec.stage == 3 else 4
        buckets = [0] * (len(ev.LATENCY_BUCKETS) + 1)
        lat_sum = lat_max = 0.0
        for _ in range(count):
            lat = spec.step_time_s * scale * 0.02 * rng.uniform(0.5, 1.5)
            buckets[ev.bucket_index(lat)] += 1
            lat_sum += lat
            lat_max = max(lat_max, lat)
        out.append(
            ev.CollectiveStats.of_calls(
                op, purpose[op], world_size=spec.world_size, count=count, nbytes=nbytes,
                latency_sum_s=lat_sum, latency_max_s=lat_max, buckets=buckets,
                async_count=count // 2,
            )
        )  # fmt: skip
    return out


def gpu_telemetry(spec: SimSpec, rank: int, step: int) -> ev.GpuTelemetry | None:
    """One rank's GPU during one step (None when the spec simulates no GPU telemetry)."""
    if not (spec.gpu or spec.gpu_throttled_rank is not None or spec.gpu_error_rank is not None):
        return None
    share = spec.gpu_throttled_share
    throttled = spec.gpu_throttled_rank == rank and int((step + 1) * share) > int(step * share)
    errors = max(step - spec.gpu_errors_at + 1, 0) if spec.gpu_error_rank == rank else 0
    sm_max = 1980.0
    sm = sm_max * (0.75 if throttled else 1.0)
    limit = 700.0
    return ev.GpuTelemetry(
        samples=1,
        sm_clock_mhz=sm,
        sm_clock_max_mhz=sm_max,
        mem_clock_mhz=2619.0,
        sm_clock_ratio=sm / sm_max,
        throttle_reasons=spec.gpu_throttle_reasons if throttled else 0,
        throttled_fraction=1.0 if throttled else 0.0,
        temperature_c=84.0 if throttled else 62.0,
        power_w=limit if throttled else 540.0,
        power_limit_w=limit,
        xid_errors=errors,
        last_xid=79 if errors else None,
        ecc_errors=errors,
        remapped_rows=0,
        remap_pending=False,
        pcie_tx_bytes_per_s=2e9,
        pcie_rx_bytes_per_s=2e9,
    )


def step_event(spec: SimSpec, rank: int, step: int, *, t: float | None = None,
               rng: random.Random | None = None) -> ev.StepEvent:  # fmt: skip
    """One rank's event for one step (seq == step)."""
    rng = rng or random.Random(spec.seed * 1_000_003 + rank * 7919 + step)
    scale = 1.0
    if spec.regress_at is not None and step >= spec.regress_at:
        scale *= spec.regress_factor
    if spec.straggler_rank == rank:
        scale *= spec.straggler_factor
    total = spec.step_time_s * scale * rng.uniform(0.95, 1.05)
    phases = {
        "forward": total * 0.3,
        "backward": total * 0.55,
        "grad_reduce": total * 0.1,
        "optimizer_step": total * 0.15,
    }
    if spec.stage == 3:
        phases["param_gather"] = total * 0.12
    offload = []
    if spec.offload_optimizer:
        nbytes = 2 * theory.shard(spec.num_params, spec.world_size)
        phases["offload_d2h"] = total * 0.03
        phases["offload_h2d"] = total * 0.03
        offload = [
            ev.OffloadStats(
                direction=d,
                bytes=nbytes,
                seconds=phases[f"offload_{d}"],
                bandwidth_bytes_per_s=nbytes / phases[f"offload_{d}"],
            )
            for d in ("d2h", "h2d")
        ]
    ms = theory.model_state_bytes(
        spec.num_params, spec.world_size, spec.stage,
        precision=spec.precision, offload_optimizer=spec.offload_optimizer,
    )  # fmt: skip
    state = ms.flat()
    peak = ms.device_total
    memory = ev.MemoryStats(
        peak_by_phase={
            p: int(peak * f)
            for p, f in (("forward", 1.3), ("backward", 1.5), ("optimizer_step", 1.2))
        },
        model_state={k: int(v * rng.uniform(1.0, 1.02)) for k, v in state.items()},
        model_state_theory=state,
        device="cuda",
        reserved_bytes=int(peak * 1.7),
        capacity_bytes=80 * 2**30,
    )
    grad_norm = rng.uniform(0.8, 1.2)
    if spec.grad_spike_at is not None and step == spec.grad_spike_at:
        grad_norm *= 50
    samples = spec.micro_batch
    spans = None
    if spec.spans_every and step % spec.spans_every == 0:
        end = t if t is not None else time.time()
        start = end - total
        spans, cursor = [], start
        for name in ("forward", "backward", "optimizer_step"):
            dur = phases[name] * 0.9
            spans.append(ev.Span(name=name, cat="phase", start=cursor, end=cursor + dur))
            cursor += dur
        spans.append(ev.Span(name="all_gather", cat="collective", start=start, end=start + 0.01,
                             args={"op": "all_gather", "bytes": 1 << 20, "async": True}))  # fmt: skip
    exposed = total * 0.08
    parts = {
        "forward_compute": total * 0.27,
        "backward_compute": total * 0.5,
        "optimizer_step": total * (0.1 if spec.offload_optimizer else 0.12),
        "exposed_param_gather": exposed * 0.4 if spec.stage == 3 else 0.0,
        "exposed_grad_reduce": exposed * 0.6 if spec.stage == 3 else exposed,
        "exposed_offload": total * 0.02 if spec.offload_optimizer else 0.0,
    }
    parts["other"] = max(0.0, total - sum(parts.values()))
    return ev.StepEvent(
        rank=rank,
        seq=step,
        step=step,
        time=t if t is not None else time.time(),
        step_time_s=total,
        phases=phases,
        collectives=_collectives(spec, rng, scale),
        exposed_comm_s=exposed,
        parts=parts,
        hidden_comm_s=total * 0.1,
        offload=offload,
        memory=memory,
        grad_norm=grad_norm,
        clipped=grad_norm > 1.0,
        loss=4.0 / (1 + 0.05 * step) + rng.uniform(-0.02, 0.02),
        loss_scale=65536.0 if spec.precision == "fp16" else None,
        lr=1e-4 * min(1.0, (step + 1) / 10),
        samples=samples,
        tokens=samples * spec.seq_len,
        samples_per_s=samples / total,
        tokens_per_s=samples * spec.seq_len / total,
        mfu=(
            samples * spec.seq_len / total * 6 * spec.num_params / spec.peak_flops
            if spec.peak_flops
            else None
        ),
        spans=spans,
        host=host_of(spec, rank),
        local_rank=rank % spec.ranks_per_host,
        node=rank // spec.ranks_per_host if spec.node_ids else -1,
        gpu=gpu_telemetry(spec, rank, step),
    )


#: Where a simulated rank's training thread waits: in a collective, in its data loader.
_IN_COLLECTIVE = [ev.Frame("zerowatch/engine/comm.py", "wait", 171),
                  ev.Frame("zerowatch/engine/reducers.py", "reduce", 212),
                  ev.Frame("train.py", "train_step", 88)]  # fmt: skip
_IN_LOADER = [ev.Frame("/usr/lib/python3.11/threading.py", "wait", 331),
              ev.Frame("data/loader.py", "next_batch", 57),
              ev.Frame("train.py", "main", 41)]  # fmt: skip


def heartbeat(spec: SimSpec, rank: int, *, t: float, step: int | None = None,
              stalled_s: float = 0.0) -> ev.Heartbeat:  # fmt: skip
    """A rank's heartbeat at time `t`, at `step` (default: the spec's `hang_at`; the last
    finished step is the one before), stalled for `stalled_s` seconds: a rank of
    `hang_ranks` has not launched the step's first collective (and sits in its loader), any
    other rank waits in it (launched at the step's start, not completed)."""
    step = step if step is not None else (spec.hang_at or 0)
    per = spec.collectives_per_step
    done = step * per
    hung = spec.hang_at is not None and rank in spec.hang_ranks
    waits = spec.hang_at is not None and not hung
    sizes = theory.comm_bytes_per_step(spec.num_params, spec.world_size, spec.stage,
                                       precision=spec.precision)  # fmt: skip
    op = "reduce_scatter" if "reduce_scatter" in sizes else next(iter(sizes), "all_reduce")
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(spec.precision, "float32")
    elements = max(int(sizes.get(op, 4 * per) // per // 2), 1)
    start = t - stalled_s
    calls: list[Any] = [(s, op, elements, dtype, "completed", start - (done - s + 1) * 0.01,
                         start - (done - s) * 0.01)
                        for s in range(max(done - 7, 1), done + 1)]  # fmt: skip
    if waits:
        calls = [*calls[1:], (done + 1, op, elements, dtype, "launched", start, None)]
    stalled = spec.hang_at is not None and stalled_s > 0
    return ev.Heartbeat(
        rank=rank, time=t, last_step=step - 1 if step else None, last_step_end=start,
        phase="between_steps" if hung else ("backward" if waits else "forward"),
        stalled_s=stalled_s, stall_after_s=10.0,
        groups={"0": ev.GroupFlight(launched=done + 1 if waits else done, completed=done,
                                    calls=calls)},
        stack=(_IN_LOADER if hung else _IN_COLLECTIVE) if stalled else None,
        host=host_of(spec, rank), node=rank // spec.ranks_per_host,
    )  # fmt: skip


def heartbeats(spec: SimSpec, *, t: float | None = None,
               stalled_s: float = 30.0) -> list[ev.Heartbeat]:  # fmt: skip
    """Every rank's heartbeat (`heartbeat`) at `t` (default: now)."""
    t = time.time() if t is None else t
    return [heartbeat(spec, r, t=t, stalled_s=stalled_s) for r in range(spec.world_size)]


def steps(spec: SimSpec, n_steps: int, *, start: int = 0,
          t0: float | None = None) -> Iterator[list[ev.StepEvent]]:  # fmt: skip
    """Yield, per step, the events of every rank, timestamped as if the run had started at
    `t0` (default: so that the last step ends now)."""
    if t0 is None:
        t0 = time.time() - n_steps * spec.step_time_s
    for step in range(start, start + n_steps):
        t = t0 + (step - start + 1) * spec.step_time_s
        yield [step_event(spec, r, step, t=t) for r in range(spec.world_size)]


__all__ = ["SimSpec", "gpu_telemetry", "heartbeat", "heartbeats", "host_of", "run_create",
           "step_event", "steps"]  # fmt: skip
