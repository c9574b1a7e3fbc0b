"""The wire schema shared by the agent (producer) and the server (consumer).

Standard library only: the agent imports it next to torch, the server without torch. The
server validates request bodies against these same dataclasses (pydantic understands
standard-library dataclasses, and `__pydantic_config__` forbids NaN/inf where it matters).

One training job is one *run*. Every rank has its own agent, and every rank sends one
`StepEvent` per optimizer step (per `engine.step()` call that crossed a gradient-accumulation
boundary). Events are identified by `(run_id, rank, seq)`; `seq` counts events of one rank
from 0 without gaps, so a replay from the on-disk spool never double-counts: the server
drops any `(run_id, rank, seq)` it already holds.

A batch on the wire is a JSON object `{"schema_version": 1, "run_id": ..., "events": [...]}`,
sent gzip-compressed (`Content-Encoding: gzip`) to `POST /api/v1/runs/{run_id}/events`.

Units: seconds for times, bytes for sizes, bytes/s for bandwidths; unix epoch seconds for
timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

SCHEMA_VERSION: Final = 1

# -- vocabulary -------------------------------------------------------------------------

#: Phases of one training step, announced by the engine (or an adapter). The whole step is
#: `step` (engine/phases.py adds it); the others may nest or overlap (grad_reduce runs inside
#: backward under overlap_comm), so they do not have to add up to the step. Written once, as
#: the type; PHASES is the same names as a tuple, in the order charts draw them.
Phase = Literal[
    "forward",
    "backward",
    "grad_reduce",
    "param_gather",
    "optimizer_step",
    "offload_d2h",
    "offload_h2d",
]
PHASES: Final[tuple[Phase, ...]] = get_args(Phase)

#: How zerowatch phases map onto DeepSpeed's `wall_clock_breakdown` timer names.
DEEPSPEED_TIMER_NAMES: Final = {
    "fwd": "forward",
    "bwd": "backward",
    "bwd_allreduce": "grad_reduce",
    "step": "optimizer_step",
}

#: The exclusive decomposition of a step: parts that never overlap and add up to the step
#: time (the agent takes each phase's self time, so nested communication is counted once).
#: Communication that compute hid is reported beside them (`StepEvent.hidden_comm_s`),
#: never inside the sum. docs/timing.md defines each part on CPU and on GPU.
STEP_PARTS: Final = (
    "forward_compute",
    "backward_compute",
    "optimizer_step",
    "exposed_param_gather",
    "exposed_grad_reduce",
    "exposed_offload",
    "other",
)

CollectiveOp = Literal["all_gather", "reduce_scatter", "all_reduce", "broadcast"]
COLLECTIVE_OPS: Final[tuple[CollectiveOp, ...]] = get_args(CollectiveOp)

#: Why a collective ran: parameter fetch (stage 3 gathers in forward/backward), gradient
#: reduction, the all-gather of updated parameter shards after the optimizer (stages 1-2),
#: or anything else (checkpointing, grad-norm, loss-scale agreement).
Purpose = Literal["param_fetch", "grad_reduce", "optimizer_gather", "other"]
PURPOSES: Final[tuple[Purpose, ...]] = get_args(Purpose)

#: Upper bounds (seconds) of the fixed latency histogram buckets: sub-millisecond to
#: multi-second collectives. The last bucket (+Inf) is implicit: `buckets` in
#: `CollectiveStats` has len(LATENCY_BUCKETS) + 1 entries, non-cumulative counts.
LATENCY_BUCKETS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

#: Model-state kinds, as in the ZeRO paper; theory.py and the engine use the same keys.
STATE_KINDS: Final = ("params", "grads", "optimizer_states", "master_weights")

RunStatus = Literal["running", "finished", "failed", "crashed", "stalled"]
Precision = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu"]


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor.

    (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce, 1 for broadcast.
    """
    n = max(int(world_size), 1)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def node_key(host: str, node: int) -> str:
    """The name a rank's node is stored and shown under: the host name, and the launcher's
    node index after it where there is one ("gpu-a#3"), so that two containers with the same
    host name on two nodes stay two nodes."""
    return f"{host}#{node}" if node >= 0 else host


def bucket_index(seconds: float) -> int:
    """Index of the histogram bucket (in LATENCY_BUCKETS, +Inf last) holding `seconds`."""
    for i, upper in enumerate(LATENCY_BUCKETS):
        if seconds <= upper:
            return i
    return len(LATENCY_BUCKETS)


# -- metric names (shared with alerts/ and the server's /metrics) ----------------------

METRIC_PREFIX: Final = "zerowatch"
METRICS: Final = {
    "step_time": "zerowatch_step_time_seconds",
    "busy": "zerowatch_busy_seconds",
    "phase": "zerowatch_phase_seconds",
    "optimizer_step": "zerowatch_optimizer_step_seconds",
    "collective_latency": "zerowatch_collective_latency_seconds",
    "collective_busbw": "zerowatch_collective_bus_bandwidth_bytes_per_second",
    "collective_bytes": "zerowatch_collective_bytes",
    "exposed_comm": "zerowatch_exposed_communication_seconds",
    "step_part": "zerowatch_step_part_seconds",
    "hidden_comm": "zerowatch_hidden_communication_seconds",
    "offload_bw": "zerowatch_offload_bandwidth_bytes_per_second",
    "memory_peak": "zerowatch_memory_peak_bytes",
    "memory_capacity": "zerowatch_memory_capacity_bytes",
    "model_state": "zerowatch_model_state_bytes",
    "model_state_theory": "zerowatch_model_state_theory_bytes",
    "grad_norm": "zerowatch_grad_norm",
    "loss": "zerowatch_loss",
    "loss_scale": "zerowatch_loss_scale",
    "skipped_steps": "zerowatch_skipped_steps_total",
    "nonfinite": "zerowatch_nonfinite_steps_total",
    "samples_per_second": "zerowatch_samples_per_second",
    "tokens_per_second": "zerowatch_tokens_per_second",
    "mfu": "zerowatch_mfu_ratio",
    "last_event": "zerowatch_run_last_event_timestamp_seconds",
    "run_info": "zerowatch_run_info",
    "run_running": "zerowatch_run_running",
    "steps": "zerowatch_steps_total",
    # GPU health (NVML, sampled by the agent at about 1 Hz; docs/gpu.md)
    "gpu_sm_clock_ratio": "zerowatch_gpu_sm_clock_ratio",
    "gpu_throttled_fraction": "zerowatch_gpu_throttled_ratio",
    "gpu_throttled_ranks": "zerowatch_gpu_throttled_ranks",
    "gpu_temperature": "zerowatch_gpu_temperature_celsius",
    "gpu_power": "zerowatch_gpu_power_watts",
    "gpu_power_limit_ratio": "zerowatch_gpu_power_limit_ratio",
    "gpu_xid_errors": "zerowatch_gpu_xid_errors_total",
    "gpu_ecc_errors": "zerowatch_gpu_ecc_errors_total",
    # Collective forensics (the ranks' heartbeats; docs/forensics.md)
    "hung_ranks": "zerowatch_hung_ranks",
    # Checkpoints (agent/checkpoints.py; the newest save and load of a run)
    "checkpoint_seconds": "zerowatch_checkpoint_seconds",
    "checkpoint_bytes": "zerowatch_checkpoint_bytes",
    "checkpoint_bandwidth": "zerowatch_checkpoint_bandwidth_bytes_per_second",
    # The exposition itself
    "runs_left_out": "zerowatch_metrics_runs_left_out",
}

#: NVML's clock event (throttle) reasons, by bit (nvmlClocksEventReason* /
#: nvmlClocksThrottleReason*: the same bits under both names).
GPU_THROTTLE_REASONS: Final = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
#: The reasons that slow a busy GPU below what it could run at: a step that ran under one
#: of them was *throttled*. (Idle, application clocks, sync boost and display clocks are
#: settings or the absence of work, not a GPU holding itself back.)
GPU_SLOWING_REASONS: Final = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


#: How the slowing reasons read in a sentence ("throttled (power cap)").
GPU_REASON_LABELS: Final = {
    "sw_power_cap": "power cap",
    "hw_slowdown": "hardware slowdown",
    "sw_thermal_slowdown": "thermal, software",
    "hw_thermal_slowdown": "thermal, hardware",
    "hw_power_brake_slowdown": "power brake",
}


def gpu_reason_names(mask: int) -> list[str]:
    """The names of the reasons set in an NVML clock-event bitmask, lowest bit first."""
    return [name for bit, name in GPU_THROTTLE_REASONS.items() if mask & bit]


# -- records ---------------------------------------------------------------------------

_FINITE = {"allow_inf_nan": False}


@dataclass
class CollectiveStats:
    """Aggregate of all calls of one (op, purpose) within one step on one rank.

    `bytes` uses nccl-tests' "size": the full tensor (all-gather output, reduce-scatter
    input, all-reduce buffer). algbw = bytes / latency; busbw = algbw * factor(op, n).
    """

    __pydantic_config__ = _FINITE

    op: CollectiveOp
    purpose: Purpose
    count: int
    bytes: int
    latency_sum_s: float
    latency_max_s: float
    #: Non-cumulative counts per LATENCY_BUCKETS bucket, +Inf last.
    buckets: list[int]
    world_size: int
    #: Bytes-weighted bandwidths over the step: bytes / latency_sum_s (and * factor).
    algbw_bytes_per_s: float = 0.0
    busbw_bytes_per_s: float = 0.0
    #: Calls issued asynchronously (overlapped with compute).
    async_count: int = 0

    @classmethod
    def of_calls(
        cls,
        op: str,
        purpose: str,
        *,
        world_size: int,
        count: int,
        nbytes: int,
        latency_sum_s: float,
        latency_max_s: float,
        buckets: list[int],
        async_count: int = 0,
    ) -> CollectiveStats:
        """The stats of `count` calls of one (op, purpose), their bandwidths by nccl-tests'
        definitions: algbw = bytes / summed latency (0 when no time was measured), busbw =
        algbw * bus_bandwidth_factor(op, world_size). The one place a step's collective
        record is built (the agent's aggregator, the simulator)."""
        algbw = nbytes / latency_sum_s if latency_sum_s > 0 else 0.0
        return cls(
            op=op,  # type: ignore[arg-type]
            purpose=purpose,  # type: ignore[arg-type]
            count=count,
            bytes=nbytes,
            latency_sum_s=latency_sum_s,
            latency_max_s=latency_max_s,
            buckets=list(buckets),
            world_size=world_size,
            algbw_bytes_per_s=algbw,
            busbw_bytes_per_s=algbw * bus_bandwidth_factor(op, world_size),
            async_count=async_count,
        )


@dataclass
class OffloadStats:
    """Host<->device copies of one direction within one step (the PCIe figure on a GPU)."""

    __pydantic_config__ = _FINITE

    direction: Literal["d2h", "h2d"]
    bytes: int
    seconds: float
    bandwidth_bytes_per_s: float = 0.0


@dataclass
class MemoryStats:
    """Memory of one rank in one step, measured next to the ZeRO theory."""

    __pydantic_config__ = _FINITE

    #: Peak bytes per phase: on a GPU the allocated bytes' peak in the phase, exact where
    #: the allocator's statistics at its two ends prove it, else a lower bound (its peak is
    #: never reset: docs/gpu.md); on CPU the process RSS peak seen during the phase.
    peak_by_phase: dict[str, int] = field(default_factory=dict)
    #: Bytes of model state the engine holds, per kind in STATE_KINDS, on its device
    #: (and `host_` + kind for offloaded state).
    model_state: dict[str, int] = field(default_factory=dict)
    #: The same kinds according to zerowatch.theory for this stage, offload and precision.
    model_state_theory: dict[str, int] = field(default_factory=dict)
    device: Literal["cpu", "cuda"] = "cpu"
    reserved_bytes: int = 0
    capacity_bytes: int = 0
    rss_peak_bytes: int = 0
    alloc_retries: int = 0
    ooms: int = 0


@dataclass
class Span:
    """One raw slice for the trace export (sampled steps only): a phase or a collective."""

    __pydantic_config__ = _FINITE

    name: str
    cat: Literal["phase", "collective", "offload"]
    start: float
    end: float
    #: Collective details: op, purpose, bytes, async.
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class GpuTelemetry:
    """The rank's own GPU while one step ran, from NVML (the agent samples it at about 1 Hz
    on a thread of its own; docs/gpu.md). Every field is None where the card or driver does
    not support the reading. Samples taken during the step are summarised; a step shorter
    than the sampling interval carries the newest sample before its end (`samples` 0).
    Error counts are since the agent attached (its first sample is their zero), so a count
    above 0 is an error of this run."""

    __pydantic_config__ = _FINITE

    #: NVML samples taken while the step ran.
    samples: int = 0
    #: SM and memory clocks (MHz, mean of the samples) and the SM clock's maximum.
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    mem_clock_mhz: float | None = None
    #: sm_clock_mhz / sm_clock_max_mhz.
    sm_clock_ratio: float | None = None
    #: Clock event reasons seen in the step's samples (OR of the NVML bitmasks:
    #: GPU_THROTTLE_REASONS), and the share of samples in which one of
    #: GPU_SLOWING_REASONS held (power cap, thermal, hardware slowdown).
    throttle_reasons: int | None = None
    throttled_fraction: float | None = None
    #: Degrees Celsius; watts drawn and the enforced power limit (mean of the samples).
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    #: Critical XID events (NVML event set), volatile uncorrected ECC errors, and
    #: uncorrectable row remaps since the agent attached; remap_pending: a row remap waits
    #: for a GPU reset.
    xid_errors: int | None = None
    last_xid: int | None = None
    ecc_errors: int | None = None
    remapped_rows: int | None = None
    remap_pending: bool | None = None
    #: PCIe and NVLink throughput, bytes/s (NVML's 20 ms PCIe window; NVLink from the
    #: throughput counters' change between two samples).
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None


@dataclass
class CheckpointTiming:
    """One `save_checkpoint` or `load_checkpoint` call on one rank, timed outside any step
    (agent/checkpoints.py). It rides on the rank's next event (the step it preceded, or
    the rank's EndEvent)."""

    __pydantic_config__ = _FINITE

    op: Literal["save", "load"]
    #: The engine's global step when the call returned (a load's: the step it restored).
    step: int
    #: Unix time the call began (rank 0's clock) and its wall-clock seconds on this rank.
    time: float
    seconds: float
    #: Bytes this process wrote (save) or read (load) during the call; None when the
    #: platform does not count them.
    bytes: int | None = None
    tag: str = ""


@dataclass
class StepEvent:
    """Everything one rank measured in one optimizer step."""

    __pydantic_config__ = _FINITE

    rank: int
    seq: int
    step: int
    #: Unix time at the end of the step.
    time: float
    step_time_s: float
    phases: dict[str, float] = field(default_factory=dict)
    collectives: list[CollectiveStats] = field(default_factory=list)
    #: Communication time compute did not hide: sync collectives plus the time spent
    #: blocked waiting on async ones.
    exposed_comm_s: float = 0.0
    #: The exclusive decomposition (keys from STEP_PARTS; they sum to step_time_s). Empty
    #: from an agent that does not send it.
    parts: dict[str, float] = field(default_factory=dict)
    #: Communication that ran while compute went on (overlapped, so not in `parts`).
    hidden_comm_s: float = 0.0
    #: CPU seconds of the step on the training thread, and on the process's other threads
    #: (communication threads: gloo's; the agent's shipper), on a run whose compute runs on
    #: the host's CPU in the training thread alone. None on GPU runs, with intra-op threads
    #: and from an agent that does not send them. The doctor prices the cost of communication that
    #: overlaps compute with them (docs/doctor.md).
    thread_cpu_s: float | None = None
    other_cpu_s: float | None = None
    offload: list[OffloadStats] = field(default_factory=list)
    memory: MemoryStats | None = None
    #: Global gradient norm before clipping; None when non-finite or unknown.
    grad_norm: float | None = None
    clipped: bool = False
    loss: float | None = None
    loss_scale: float | None = None
    skipped: bool = False
    nonfinite: bool = False
    lr: float | None = None
    samples: int = 0
    tokens: int = 0
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    #: User scalars from run.log(**scalars).
    scalars: dict[str, float] = field(default_factory=dict)
    #: Raw spans for the trace export; only on sampled steps.
    spans: list[Span] | None = None
    #: Where this rank runs: its host's name and its rank on that host (torchrun's
    #: LOCAL_RANK), so ranks group by node. "" / -1 when unknown.
    host: str = ""
    local_rank: int = -1
    #: The node's index from the launcher (torchrun's GROUP_RANK, SLURM_NODEID): the
    #: node's identity, the host name its label (`node_key`); -1 when not launched so.
    node: int = -1
    #: The rank's GPU during the step (NVML); None off a GPU, without NVML, or from an agent
    #: that does not send it.
    gpu: GpuTelemetry | None = None
    #: On a step with a non-finite loss or gradient (and the step after it), where it came
    #: from on this rank (docs/forensics.md): {"local_grad_norm": this rank's gradient norm
    #: before the reduction (None: not finite), "nonfinite_params": the parameters whose
    #: local gradients were not finite, earliest in forward order first, "first_module":
    #: the module of the first of them, "forward_module": the first module whose forward
    #: output was not finite (traced on a step after a flagged one), "batch_ids": what
    #: `run.log(batch_ids=...)` gave}. None on every other step.
    forensics: dict[str, Any] | None = None
    #: Checkpoint saves and loads since the rank's previous event (outside the step time).
    checkpoints: list[CheckpointTiming] = field(default_factory=list)
    kind: Literal["step"] = "step"


@dataclass
class EndEvent:
    """The last event of a rank: the run finished or failed on this rank."""

    rank: int
    seq: int
    time: float
    status: Literal["finished", "failed", "crashed"]
    error: str | None = None
    #: "crashed": what left the engine or the instrumented block (docs/forensics.md):
    #: {"type", "message", "stack", "step", "phase", "oom": bool, "memory": the rank's
    #: memory waterfall at that moment (out-of-memory errors only)}.
    crash: dict[str, Any] | None = None
    #: Agent health: events dropped because the spool was full, agent errors swallowed.
    dropped_events: int = 0
    agent_errors: int = 0
    checkpoints: list[CheckpointTiming] = field(default_factory=list)
    kind: Literal["end"] = "end"


Event = StepEvent | EndEvent


@dataclass
class RunCreate:
    """Sent once per job (by rank 0, idempotent on run_id) before any event."""

    __pydantic_config__ = _FINITE

    run_id: str
    name: str
    project: str = "default"
    tags: list[str] = field(default_factory=list)
    world_size: int = 1
    #: Which engine: "zerowatch" (bundled), "deepspeed", "fsdp2", "ddp", "fsdp1".
    engine: str = "zerowatch"
    engine_info: dict[str, Any] = field(default_factory=dict)
    zero_stage: int = 0
    offload_optimizer: OffloadDevice = "none"
    offload_param: OffloadDevice = "none"
    precision: Precision = "fp32"
    #: The full resolved DeepSpeed-style config.
    config: dict[str, Any] = field(default_factory=dict)
    param_count: int = 0
    hosts: list[str] = field(default_factory=list)
    torch_version: str = ""
    zerowatch_version: str = ""
    #: Per-rank theoretical model-state bytes (theory.py) for this stage, by kind.
    theory: dict[str, int] = field(default_factory=dict)
    #: Theoretical bytes per step per collective op (nccl-tests size), from theory.py.
    theory_comm: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0
    #: The job this run belongs to: runs of one job across restarts share it (the user's
    #: name, `$ZEROWATCH_JOB`, the SLURM job id or torchrun's run id); "" for none.
    job: str = ""
    schema_version: int = SCHEMA_VERSION


@dataclass
class Frame:
    """One frame of a Python stack: where a thread is."""

    __pydantic_config__ = _FINITE

    file: str
    function: str
    line: int


@dataclass
class GroupFlight:
    """A rank's view of one process group's collectives (its flight recorder)."""

    __pydantic_config__ = _FINITE

    #: Number of the last collective this rank issued on the group (1, 2, ...: the same
    #: collective has the same number on every rank), and of the last that completed.
    launched: int = 0
    completed: int = 0
    #: The newest calls, oldest first: [seq, op, elements, dtype, "launched" | "completed",
    #: launched at, None] (unix seconds on rank 0's clock; the completion's time is not kept).
    calls: list[
        tuple[int, str, int, str, Literal["launched", "completed"], float, float | None]
    ] = field(default_factory=list)


@dataclass
class Heartbeat:
    """Sent by a rank's shipper thread every few seconds, whatever its training thread does
    (`POST /api/v1/runs/{run_id}/heartbeats`, not an event: the server keeps the newest of
    each rank). The collective forensics (docs/forensics.md) read it."""

    __pydantic_config__ = _FINITE

    rank: int
    #: When it was sent (unix seconds, rank 0's clock).
    time: float
    #: The last step this rank finished, and when (None: none yet).
    last_step: int | None = None
    last_step_end: float | None = None
    #: Where the training thread is: a phase, "step" (inside a step, between phases) or
    #: "between_steps".
    phase: str = "between_steps"
    #: Seconds since the rank last finished a step, and the rank's stall threshold.
    stalled_s: float = 0.0
    stall_after_s: float = 0.0
    #: Per process group name, the rank's flight recorder.
    groups: dict[str, GroupFlight] = field(default_factory=dict)
    #: The training thread's innermost frames, innermost first, once it has stalled.
    stack: list[Frame] | None = None
    #: Once stalled, the newest entries of torch's own collective flight recorder, where
    #: torch keeps one (agent/heartbeat.py): {"group", "seq", "op" (e.g. "nccl:all_reduce"),
    #: "state" (scheduled, started, completed), "retired" (torch is done with it: its work
    #: finished), "sizes", "dtypes", "created" (unix s)}.
    torch_flight: list[dict[str, Any]] | None = None
    host: str = ""
    node: int = -1


@dataclass
class HeartbeatBatch:
    """One POST of heartbeats (a rank sends its own; a simulator many)."""

    heartbeats: list[Heartbeat]


@dataclass
class EventBatch:
    """One POST of events for one run; ranks may be mixed, order within a rank is by seq."""

    run_id: str
    events: list[StepEvent | EndEvent]
    schema_version: int = SCHEMA_VERSION


__all__ = [
    "COLLECTIVE_OPS",
    "DEEPSPEED_TIMER_NAMES",
    "GPU_REASON_LABELS",
    "GPU_SLOWING_REASONS",
    "GPU_THROTTLE_REASONS",
    "LATENCY_BUCKETS",
    "METRICS",
    "PHASES",
    "PURPOSES",
    "SCHEMA_VERSION",
    "STATE_KINDS",
    "STEP_PARTS",
    "CheckpointTiming",
    "CollectiveStats",
    "EndEvent",
    "Event",
    "EventBatch",
    "Frame",
    "GpuTelemetry",
    "GroupFlight",
    "Heartbeat",
    "HeartbeatBatch",
    "MemoryStats",
    "OffloadStats",
    "RunCreate",
    "Span",
    "StepEvent",
    "bucket_index",
    "bus_bandwidth_factor",
    "gpu_reason_names",
    "node_key",
]
