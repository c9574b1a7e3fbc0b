"""What the agent says when a step goes wrong: crashes, out-of-memory, non-finite values.

- **A crash** (an exception leaving the engine or the `with zerowatch.instrument(...)`
  block): `crash_report` is the rank's last event's payload: the exception's type,
  message and stack, the step and phase, and on an out-of-memory error the rank's memory
  waterfall at that moment (zerowatch.waterfall) with the failed allocation's size and what
  would fit (the largest micro-batch the measured activations allow, the cheapest layout
  the planner fits).
- **A non-finite step**: `step_forensics` turns the engine's local-gradient report
  (zerowatch/engine/forensics.py: each rank's gradients before the reduction) into this
  rank's local gradient norm and the first module whose local gradients were not finite.
- **A NaN born in the forward**: `ForwardTracer` hooks every module's forward only on the
  step after a flagged one (normal steps pay nothing) and names the first module whose
  output was not finite while its inputs and own parameters were (a model whose weights
  a non-finite update already spoiled has no such module: the NaN was not born there).

Nothing here raises into training: the callers guard every call.
"""

from __future__ import annotations

import math
import re
import traceback
from typing import Any

from zerowatch import plan as planner
from zerowatch import waterfall as wf

#: "Tried to allocate 2.00 GiB" (torch's CUDA message), in bytes.
_TRIED = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?([KMGT]i?B|B|bytes)")
_UNITS = {"B": 1, "bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}  # fmt: skip
#: Longest stack kept (characters, the innermost frames).
MAX_STACK = 16_000


def is_oom(error: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA, and what a test raises on CPU) or Python's MemoryError."""
    if isinstance(error, MemoryError):
        return True
    return any(k.__name__ == "OutOfMemoryError" for k in type(error).__mro__)


def failed_allocation_bytes(message: str) -> int | None:
    """The size of the allocation that failed, where the message gives it."""
    match = _TRIED.search(message)
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def module_of(param_name: str) -> str:
    """The module a parameter belongs to ("blocks.2.fc.weight" -> "blocks.2.fc")."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def crash_report(error: BaseException, *, phase: str, step: int | None,
                 memory: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The payload of a crashed rank's last event (events.EndEvent.crash)."""
    stack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return {
        "type": type(error).__name__,
        "message": str(error)[:4000],
        "stack": stack[-MAX_STACK:],
        "step": step,
        "phase": phase,
        "oom": is_oom(error),
        "memory": memory,
    }


def memory_at_crash(model_state: dict[str, int], job: Any,
                    error: BaseException) -> dict[str, Any]:  # fmt: skip
    """The rank's memory waterfall now (zerowatch.waterfall) from the engine's measured
    model state (`model_state`) and the job's theory, the failed allocation and what would
    fit. Fields that cannot be measured (activations and the allocator on a CPU) are None."""
    state = {str(k): int(v) for k, v in model_state.items()}
    theory = dict(job.theory)
    buffers = comm_buffer_bytes(job)
    peak = reserved = capacity = None
    allocator: dict[str, Any] = {}
    if str(job.device).startswith("cuda"):
        import torch

        stats = torch.cuda.memory_stats(job.device)
        peak = int(stats.get("allocated_bytes.all.peak", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        capacity = int(torch.cuda.get_device_properties(job.device).total_memory)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        allocator = {"allocated_bytes": allocated, "reserved_bytes": reserved,
                     "peak_allocated_bytes": peak,
                     "fragmentation_bytes": max(reserved - allocated, 0),
                     "alloc_retries": int(stats.get("num_alloc_retries", 0)),
                     "ooms": int(stats.get("num_ooms", 0))}  # fmt: skip
    bars = wf.waterfall(theory=theory, model_state=state, comm_buffers=buffers,
                        peak_allocated=peak, reserved=reserved, capacity=capacity)  # fmt: skip
    micro = max(int(job.micro_batch_size or 1), 1)
    per_sample = bars["activations"] / micro if bars["activations"] else None
    return {
        "device": "cuda" if capacity is not None else "cpu",
        "waterfall": bars,
        "theory": theory,
        "model_state": state,
        "allocator": allocator or None,
        "failed_allocation_bytes": failed_allocation_bytes(str(error)),
        "micro_batch_size": micro,
        "activation_bytes_per_sample": per_sample,
        "fits": what_fits(job, bars, per_sample),
    }


def comm_buffer_bytes(job: Any) -> int | None:
    """The transient buffers the job's config implies (zerowatch.waterfall)."""
    return wf.comm_buffer_bytes(
        param_count=job.param_count, world_size=job.world_size, precision=job.precision,
        stage=job.zero_stage, zero_config=(job.config or {}).get("zero_optimization"),
    )  # fmt: skip


def what_fits(job: Any, bars: dict[str, Any], per_sample: float | None) -> dict[str, Any]:
    """The largest micro-batch the device holds at the measured activations per sample, and
    the cheapest layout (plan.py) that leaves room for this micro-batch's activations;
    None each where the capacity or the activations are unknown."""
    capacity = bars.get("capacity")
    out: dict[str, Any] = {"max_micro_batch": None, "layout": None}
    if not capacity:
        return out
    fixed = (bars.get("model_state") or 0) + (bars.get("comm_buffers") or 0)
    if per_sample:
        out["max_micro_batch"] = max(int((capacity - fixed) // per_sample), 0)
    activations = int(bars.get("activations") or 0)
    room = capacity - activations
    if room > 0 and job.param_count:
        try:
            result = planner.plan(job.param_count, gpus=max(job.world_size, 1), gpu_memory=room,
                                  precision=job.precision)  # fmt: skip
        except Exception:
            return out
        row = result.recommended
        if row is not None:
            out["layout"] = {"stage": row.stage, "offload": row.offload,
                             "device_bytes": row.device_bytes}  # fmt: skip
    return out


def step_forensics(local: Any, *, nonfinite: bool, forward_module: str | None,
                   batch_ids: list[Any] | None) -> dict[str, Any] | None:  # fmt: skip
    """A flagged step's forensics on this rank (events.StepEvent.forensics); None on a
    step with nothing to say."""
    if not nonfinite and forward_module is None:
        return None
    out: dict[str, Any] = {"local_grad_norm": None, "nonfinite_params": [],
                           "first_module": None, "forward_module": forward_module,
                           "batch_ids": batch_ids}  # fmt: skip
    if local is not None:
        read = local.read()
        norm = read["local_grad_norm"]
        out["local_grad_norm"] = norm if math.isfinite(norm) else None
        bad = read["nonfinite_params"]
        out["nonfinite_params"] = bad[:20]
        out["first_module"] = module_of(bad[0]) if bad else None
    return out


class ForwardTracer:
    """Forward hooks on every module of `model`, armed for one step at a time (`arm`):
    `take()` gives the first module (in the order their forwards finished) whose output
    was not finite while its inputs and own parameters were: where a NaN was born; None."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._hooks: list[Any] = []
        self._found: str | None = None
        self._checked_bad = False

    @property
    def armed(self) -> bool:
        return bool(self._hooks)

    def arm(self) -> None:
        if self._hooks or self._model is None:
            return
        self._found, self._checked_bad = None, False
        for name, module in self._model.named_modules():
            if name:
                self._hooks.append(module.register_forward_hook(self._hook(name, module)))

    def _hook(self, name: str, module: Any) -> Any:
        def check(_: Any, inputs: Any, output: Any) -> None:
            if self._found is not None or self._checked_bad or _finite(output):
                return
            # The first non-finite output decides: born here, or carried in (then no
            # module after it can be the origin either).
            self._checked_bad = True
            own = list(module.parameters(recurse=False))
            if _finite(inputs) and _finite(own):
                self._found = name

        return check

    def take(self) -> str | None:
        """The traced step's module (None: nothing non-finite); disarms."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        found, self._found, self._checked_bad = self._found, None, False
        return found


def _finite(value: Any) -> bool:
    """Whether every floating tensor in `value` (nested tuples, lists, dicts) is finite."""
    import torch

    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


__all__ = [
    "ForwardTracer",
    "comm_buffer_bytes",
    "crash_report",
    "failed_allocation_bytes",
    "is_oom",
    "memory_at_crash",
    "module_of",
    "step_forensics",
    "what_fits",
]
