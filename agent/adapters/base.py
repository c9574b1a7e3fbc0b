"""The seam between the agent and a training engine: one small Protocol.

The agent measures through an adapter, never through an engine's own attributes, so that
the bundled ZeRO engine, DeepSpeed's engine and an FSDP2 model can each be instrumented by
one file that knows that engine (`adapters/<engine>.py`) and nothing else changes.

An adapter (1) describes the job once (`info`), (2) attaches an observer that receives the
engine's phase boundaries and collectives in the shapes of `zerowatch.engine.hooks`
(`on_phase_start/end(phase, t)`, `on_collective(record)`, `on_offload(...)`, with a
`step` phase around each optimizer step), (3) answers per-step questions (model-state
bytes, grad norm, loss scale, lr; an adapter whose engine records each step in a new
immutable object may also offer `step_stats_later()`, a callable that reads it when the
event is built, off the training thread) and (4) runs the two object collectives the agent needs
at start-up (agreeing on the run id, gathering host names) through the engine's own
process group.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, kw_only=True)
class JobInfo:
    """What a run records about the job; constant for the run's life."""

    engine: str
    rank: int
    world_size: int
    device: str
    zero_stage: int
    precision: str
    offload_optimizer: str = "none"
    offload_param: str = "none"
    config: dict[str, Any] = field(default_factory=dict)
    param_count: int = 0
    persistent_params: int = 0
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    #: Theoretical per-rank model-state bytes, events.MemoryStats form (`host_<kind>` offloaded).
    theory: dict[str, int] = field(default_factory=dict)
    #: Theoretical collective sizes per step per op (theory.comm_bytes_per_step).
    theory_comm: dict[str, int] = field(default_factory=dict)
    engine_info: dict[str, Any] = field(default_factory=dict)
    #: The engine's optimizer-step counter when the agent attached.
    global_step: int = 0


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """The optimizer's view of the step that just ended."""

    grad_norm: float | None = None
    clipped: bool = False
    loss_scale: float | None = None
    skipped: bool = False
    lr: float | None = None
    nonfinite: bool = False
    #: This rank's gradients before the reduction (the bundled engine's
    #: engine/forensics.LocalGradReport, read on the shipper thread); None: not known.
    local_grads: Any = None


@runtime_checkable
class EngineAdapter(Protocol):
    """What the agent needs from an engine."""

    def info(self) -> JobInfo: ...

    def attach(self, observer: Any) -> None: ...

    def detach(self, observer: Any) -> None: ...

    def model_state_bytes(self) -> dict[str, int]: ...

    def step_stats(self) -> StepStats: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def torch_device(self) -> Any: ...


def loaded_instance(obj: Any, package: str, module: str, name: str) -> bool:
    """Whether `obj` is an instance of `module.name`, checked only where `package` is
    already imported (an adapter's check never imports a framework the job does not use)."""
    if package not in sys.modules:
        return False
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(obj, cls)


__all__ = ["EngineAdapter", "JobInfo", "StepStats", "loaded_instance"]
