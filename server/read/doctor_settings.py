"""The doctor's thresholds and windows: one typed, frozen settings object.

Like the alert rules' settings (alerts/settings.py), every field is checked when the object
is built and an error names the field. `DoctorSettings()` holds the defaults the server
uses; tests and benchmarks build their own. docs/doctor.md lists them with each kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class DoctorSettingsError(ValueError):
    """A threshold out of its range (the message names the field)."""


@dataclass(frozen=True, kw_only=True)
class DoctorSettings:
    """Thresholds of the doctor's findings (see docs/doctor.md for what each kind reads)."""

    window_steps: int = 50
    """Performance findings read the newest this many steps (their rollups)."""

    warmup_steps: int = 2
    """Steps left out at the start of a run (allocation, first-call costs) when the run has
    more than this many steps."""

    signal_steps: int = 2000
    """Training-signal findings (loss scale, grad norm, non-finite, offload bandwidth against
    its earlier level) read the newest this many steps."""

    straggler_ratio: float = 1.2
    """straggler: a rank whose busy time (step time less exposed communication) is more than
    this multiple of the median rank's (> 1; the alert rule's default too)."""

    straggler_critical_ratio: float = 2.0
    """straggler: critical above this multiple."""

    input_stall_share: float = 0.10
    """input_stall: warn when the time between steps (outside the engine: the data loader)
    is more than this share of the step's wall time (gap / (gap + step time))."""

    input_stall_critical_share: float = 0.30
    """input_stall: critical above this share."""

    exposed_comm_share: float = 0.50
    """exposed_communication: warn when communication that compute did not hide is more
    than this share of the step (on the rank that waits least: waiting for a straggler is
    the straggler's finding, not the network's)."""

    exposed_comm_info_share: float = 0.20
    """exposed_communication: an info finding above this share."""

    latency_bound_ratio: float = 0.5
    """latency_bound_collectives: an op's bus bandwidth below this fraction of what the link
    reaches with larger messages (an op of the same run, the engine's probe of the link, or
    `link_busbw_bytes_per_s`; in (0, 1))."""

    latency_bound_min_calls: float = 8.0
    """latency_bound_collectives: only ops with at least this many calls per step."""

    latency_bound_size_factor: float = 4.0
    """latency_bound_collectives: "larger messages" are at least this many times larger."""

    link_busbw_bytes_per_s: float = 0.0
    """latency_bound_collectives: the bus bandwidth the job's links reach with large
    messages (e.g. 150e9 for NVLink 4 between 8 GPUs), for runs with no larger messages of
    their own and no probe of the link by the engine. 0: unknown, not used."""

    memory_headroom_share: float = 0.90
    """memory_headroom: warn when the fullest rank's peak is above this share of the
    smallest device's capacity (ranks whose capacity is unknown never fire)."""

    memory_critical_share: float = 0.97
    """memory_headroom: critical above this share."""

    fragmentation_ratio: float = 1.5
    """memory_headroom: an info finding when the allocator's reserved bytes are more than
    this multiple of the peak allocated bytes."""

    offload_bandwidth_ratio: float = 0.5
    """offload_bandwidth: warn when a direction's recent bandwidth is below this fraction of
    what the run reached before (the 90th percentile of its per-step medians)."""

    offload_link_bytes_per_s: float = 0.0
    """offload_bandwidth: the host link's bandwidth (e.g. 25e9 for PCIe 4 x16); an info
    finding below a quarter of it. 0: unknown, not checked."""

    loss_scale_floor: float = 1.0
    """loss_scale: critical when the fp16 loss scale is at or below this (DeepSpeed's
    default min_loss_scale)."""

    loss_scale_drop_factor: float = 1024.0
    """loss_scale: warn when the scale fell by more than this factor below its maximum in
    the window (1024 = ten halvings)."""

    skipped_share: float = 0.05
    """loss_scale: warn when more than this share of the window's steps were skipped."""

    grad_norm_spike_ratio: float = 10.0
    """grad_norm_spike: a step whose gradient norm is more than this multiple of the median
    of the steps before it (> 1)."""

    grad_norm_baseline_steps: int = 10
    """grad_norm_spike: steps needed before a step to judge it (and the most used: 10x)."""

    stage_choice_min_gain: float = 0.10
    """stage_choice: suggest another configuration only when it is predicted this share
    faster (or, under memory pressure, when it frees memory)."""

    stage_choice_warning_gain: float = 0.30
    """stage_choice: a warning, not info, when the configuration it names is predicted at
    least this share faster."""

    stage_choice_fit_share: float = 0.90
    """stage_choice: a configuration fits when its predicted peak is within this share of
    the device capacity."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise DoctorSettingsError(f"{f.name}: expected a number, got {value!r}")

        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise DoctorSettingsError(f"{name}: expected {what}, got {getattr(self, name)!r}")

        for name in ("window_steps", "signal_steps", "grad_norm_baseline_steps"):
            need(int(getattr(self, name)) >= 1, name, "a whole number >= 1")
        need(self.warmup_steps >= 0, "warmup_steps", "a whole number >= 0")
        for name in ("straggler_ratio", "straggler_critical_ratio", "loss_scale_drop_factor",
                     "grad_norm_spike_ratio", "latency_bound_size_factor",
                     "fragmentation_ratio"):  # fmt: skip
            need(getattr(self, name) > 1.0, name, "a number > 1")
        for name in ("input_stall_share", "input_stall_critical_share", "exposed_comm_share",
                     "exposed_comm_info_share", "latency_bound_ratio", "memory_headroom_share",
                     "memory_critical_share", "offload_bandwidth_ratio", "skipped_share",
                     "stage_choice_min_gain", "stage_choice_warning_gain",
                     "stage_choice_fit_share"):  # fmt: skip
            need(0.0 < getattr(self, name) <= 1.0, name, "a fraction in (0, 1]")
        for name in ("latency_bound_min_calls", "offload_link_bytes_per_s", "loss_scale_floor",
                     "link_busbw_bytes_per_s"):  # fmt: skip
            need(getattr(self, name) >= 0.0, name, "a number >= 0")
        need(self.straggler_critical_ratio >= self.straggler_ratio, "straggler_critical_ratio",
             f"a number >= straggler_ratio ({self.straggler_ratio})")  # fmt: skip


__all__ = ["DoctorSettings", "DoctorSettingsError"]
