"""The memory waterfall of one rank: where its device memory went, bar by bar.

    ZeRO theory -> measured model state -> communication buffers -> activations
    -> allocator reserve (and fragmentation)

Each bar is what the one before it does not explain:

- `theory`: the model-state bytes zerowatch.theory predicts on the device for the run's
  stage, offload and precision;
- `model_state`: what the engine measured it holds (engine.model_state_bytes(), device
  kinds only);
- `comm_buffers`: the transient buffers the config implies (plan.buffer_bytes: the
  reduction bucket(s), the all-gather bucket, stage 3's live parameters), a planned figure;
- `activations`: the allocator's peak of allocated bytes beyond model state and buffers
  (CUDA only: on a CPU the process's RSS holds the interpreter and libraries too, so it is
  None there);
- `allocator_reserve`: reserved beyond the peak allocated: the caching allocator's reserve,
  fragmentation included (CUDA only).

Standard library only: the agent builds one at a crash, the run page one per rank from the
stored steps (the same function, so the two agree).
"""

from __future__ import annotations

from typing import Any

from zerowatch import events as ev
from zerowatch import plan as planner

#: The bars, in the order they are drawn.
BARS = ("theory", "model_state", "comm_buffers", "activations", "allocator_reserve")


def device_bytes(kinds: dict[str, Any] | None) -> int | None:
    """The device part of a model-state dict (kinds in STATE_KINDS; `host_*` left out)."""
    if not kinds:
        return None
    return int(sum(int(v) for k, v in kinds.items() if k in ev.STATE_KINDS))


def comm_buffer_bytes(*, param_count: int, world_size: int, precision: str, stage: int,
                      zero_config: dict[str, Any] | None) -> int | None:  # fmt: skip
    """The transient buffers the run's `zero_optimization` section implies on one rank
    (plan.buffer_bytes); None for one rank (nothing is reduced) or an unknown model."""
    if world_size < 2 or not param_count:
        return None
    z = zero_config or {}
    given = {k: z[k] for k in ("reduce_bucket_size", "allgather_bucket_size",
                               "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                               "overlap_comm") if isinstance(z.get(k), int | bool)}  # fmt: skip
    try:
        return int(sum(planner.buffer_bytes(param_count, precision, stage, **given).values()))
    except (KeyError, TypeError, ValueError):
        return None


def waterfall(
    *,
    theory: dict[str, Any] | None,
    model_state: dict[str, Any] | None,
    comm_buffers: int | None = None,
    peak_allocated: int | None = None,
    reserved: int | None = None,
    capacity: int | None = None,
) -> dict[str, Any]:
    """One rank's waterfall (module docstring): {bar: bytes or None, "capacity": bytes or
    None, "unexplained": peak allocated beyond the bars before the reserve (None when
    unknown)}; a bar is None where it cannot be measured."""
    state = device_bytes(model_state)
    activations = None
    if peak_allocated is not None and state is not None:
        activations = max(int(peak_allocated) - state - int(comm_buffers or 0), 0)
    reserve = None
    if reserved is not None and peak_allocated is not None:
        reserve = max(int(reserved) - int(peak_allocated), 0)
    return {
        "theory": device_bytes(theory),
        "model_state": state,
        "comm_buffers": comm_buffers,
        "activations": activations,
        "allocator_reserve": reserve,
        "capacity": capacity,
    }


__all__ = ["BARS", "comm_buffer_bytes", "device_bytes", "waterfall"]
