"""The agent's knobs, parsed once at `instrument()` time.

Every keyword of `zerowatch.instrument(...)` beyond the named ones lands here; an unknown
keyword is a `TypeError` naming it (with a did-you-mean), a bad value a `ValueError` naming
the field. Standard library only.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

#: POSTs a second that a whole job aims at when `flush_interval_s` is left to the agent.
JOB_POSTS_PER_S = 256.0
#: Bounds of the automatic flush interval: the default of a small job, and the longest a
#: step waits on a rank before it is sent.
MIN_FLUSH_INTERVAL_S = 2.0
MAX_FLUSH_INTERVAL_S = 30.0
#: The longest time between two heartbeats by default: a hang is named within a minute.
MAX_HEARTBEAT_INTERVAL_S = 15.0


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """How the agent measures and ships. Defaults suit a real job; tests shrink them."""

    spans_every: int = 10
    """Every this many steps carries raw phase/collective spans for the trace export
    (0 = never). Step 0 is always sampled when enabled."""
    max_spans_per_step: int = 4096
    """Cap on raw spans kept for one sampled step (stage 3 gathers many small modules)."""
    memory_every: int = 10
    """Read the engine's model-state bytes, and on CPU the process RSS (at each top-level
    phase's end, and its lifetime peak), every this many steps; the last readings are
    repeated between. Model state is fixed once the optimizer has stepped and walking a
    large model's tensors every step costs; each RSS reading is a system call, 12-25 µs of
    the training thread between the engine's kernels. CUDA allocator peaks are read every
    step."""
    queue_size: int = 4096
    """Events the training thread may hand to the shipper before it drops (bounded memory)."""
    batch_max_events: int = 64
    """Most events in one POST."""
    flush_interval_s: float | None = None
    """How often the shipper wakes to send what is queued (one POST per wake-up and up to
    `batch_max_events` events): the longest an event waits before it is sent. None: grows
    with the world size (`flush_interval`), so that the job as a whole sends about
    `JOB_POSTS_PER_S` POSTs a second: 2 s up to 512 ranks, 16 s at 4,096."""
    http_timeout_s: float = 5.0
    """Connect/read timeout of one POST; a hanging server costs the shipper this, never the
    training thread."""
    retry_attempts: int = 3
    """Tries of one POST (exponential backoff with jitter between) before the server is
    considered unreachable and events go to the spool."""
    retry_max_wait_s: float = 2.0
    """Longest wait between two tries, and between two probes of an unreachable server."""
    close_timeout_s: float = 10.0
    """How long `close()` may spend sending what is left; the rest stays in the spool."""
    crash_flush_s: float = 2.0
    """How long a crashing rank may spend sending its last event before the exception goes
    on (the process is about to die; what is not sent stays in the spool)."""
    max_spool_bytes: int = 512 * 1024 * 1024
    """Bound on this rank's on-disk spool; past it new events are dropped and counted."""
    spool_segment_bytes: int = 4 * 1024 * 1024
    """Size of one append-only JSONL segment file of the spool."""
    fsync_interval_s: float = 1.0
    """Spooled events reach the disk (fsync) at least this often, and at segment ends and
    at close."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device (e.g. 989.5e12 for an H100 SXM in bf16). Default: from
    the table of `agent/flops.py` by the device's name and the run's precision (None for
    a device not listed: no MFU)."""
    flops_per_token: float | None = None
    """Model FLOPs per trained token (forward + backward), in place of the accounting the
    agent makes from the model (6·N + 12·L·H·T, MoE experts by their top-k)."""
    flops_params: int | None = None
    """Parameters counted for 6·N FLOPs per token (default: the model's trainable
    parameters less its embedding tables, experts counted by their top-k)."""
    num_layers: int | None = None
    """Transformer layers L, for the attention FLOPs 12·L·H·T per token."""
    hidden_size: int | None = None
    """Model width H (heads × head dim), for the attention FLOPs."""
    seq_len: int | None = None
    """Sequence length T, for the attention FLOPs."""
    clock_sync_rounds: int = 8
    """Round trips over the job's process group per estimate of this host's clock offset
    to rank 0's (`zerowatch.clocks`); 0: no estimate, times stay on the host's clock."""
    clock_sync_every: int = 1000
    """Estimate the offset again every this many steps (between two steps, on every rank
    together); 0: only at `instrument()`."""
    name: str | None = None
    """Human-readable run name (default: the `run` argument, or the run id)."""
    gpu_telemetry: bool | None = None
    """Sample the rank's GPU through NVML (`pip install nvidia-ml-py`) about once a second
    on a thread of the agent's own, and send it with each step (docs/gpu.md). None: on
    for runs on a CUDA device when NVML is there; False: off; True: also on CPU runs, for
    the GPU at LOCAL_RANK."""
    gpu_sample_interval_s: float = 1.0
    """Seconds between two NVML samples."""
    heartbeat_interval_s: float | None = None
    """How often the shipper thread sends the rank's heartbeat (its last step, phase and
    flight recorder, agent/heartbeat.py), whatever the training thread does. None: the
    flush interval, between 2 and `MAX_HEARTBEAT_INTERVAL_S` seconds."""
    stall_floor_s: float = 10.0
    """A rank is stalled (its heartbeat carries the training thread's stack) once it has not
    finished a step for `stall_factor` times its median step time, and at least this long."""
    stall_factor: float = 5.0
    """See `stall_floor_s`."""

    def __post_init__(self) -> None:
        positive_ints = ("max_spans_per_step", "memory_every", "queue_size", "batch_max_events",
                         "retry_attempts", "spool_segment_bytes")  # fmt: skip
        for key in positive_ints:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key}: expected an integer >= 1, got {value!r}")
        for key in ("spans_every", "max_spool_bytes", "clock_sync_rounds", "clock_sync_every"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key}: expected an integer >= 0, got {value!r}")
        for key in ("flush_interval_s", "http_timeout_s", "retry_max_wait_s",
                    "close_timeout_s", "fsync_interval_s", "gpu_sample_interval_s",
                    "heartbeat_interval_s", "stall_floor_s", "stall_factor",
                    "crash_flush_s"):  # fmt: skip
            value = getattr(self, key)
            if value is None and key in ("flush_interval_s", "heartbeat_interval_s"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{key}: expected a number of seconds > 0, got {value!r}")
        if self.peak_flops is not None and not (
            isinstance(self.peak_flops, (int, float)) and self.peak_flops > 0
        ):
            raise ValueError(f"peak_flops: expected FLOP/s > 0, got {self.peak_flops!r}")
        if self.flops_per_token is not None and not (
            isinstance(self.flops_per_token, (int, float)) and self.flops_per_token > 0
        ):
            raise ValueError(f"flops_per_token: expected FLOPs > 0, got {self.flops_per_token!r}")
        for key in ("flops_params", "num_layers", "hidden_size", "seq_len"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{key}: expected an integer >= 0, got {value!r}")

    def flush_interval(self, world_size: int) -> float:
        """The shipper's flush interval for a job of `world_size` ranks.

        Every rank ships its own events, so a job sends world_size / interval POSTs a
        second, and the server pays for each POST (HTTP, routing, a wake-up of its writer)
        whatever it holds. With the interval growing with the world size, the job sends
        about `JOB_POSTS_PER_S` of them and each carries more steps: at one step a second
        a rank of 4,096 posts 16 steps every 16 s instead of 2 every 2 s. The cost is
        latency: a step reaches the server at most one interval after it ended.
        """
        if self.flush_interval_s is not None:
            return float(self.flush_interval_s)
        wanted = max(int(world_size), 1) / JOB_POSTS_PER_S
        return min(max(wanted, MIN_FLUSH_INTERVAL_S), MAX_FLUSH_INTERVAL_S)

    def heartbeat_interval(self, world_size: int) -> float:
        """Seconds between two heartbeats of a rank (`heartbeat_interval_s`)."""
        if self.heartbeat_interval_s is not None:
            return float(self.heartbeat_interval_s)
        return min(max(self.flush_interval(world_size), MIN_FLUSH_INTERVAL_S),
                   MAX_HEARTBEAT_INTERVAL_S)  # fmt: skip

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> AgentConfig:
        """Build from `instrument(**kw)`; an unknown key is a TypeError with a did-you-mean."""
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"instrument() got an unknown keyword {key!r}{hint}")
        return cls(**kwargs)


__all__ = ["JOB_POSTS_PER_S", "MAX_FLUSH_INTERVAL_S", "MAX_HEARTBEAT_INTERVAL_S",
           "MIN_FLUSH_INTERVAL_S", "AgentConfig"]  # fmt: skip
