"""What the DeepSpeed and FSDP2 adapters share: a base class, a phase board and a tensor
census.

`ForeignAdapter` is their common part: a `PhaseBoard` whose first observer installs the
adapter's hooks on the foreign engine and whose last takes them off again, and the two
start-up object collectives, run through dist_wrap on the job's default process group.

`PhaseBoard` is the foreign engine's stand-in for engine/phases.py: the adapter's hooks
call `start(phase)` / `end(phase)`, the board tells the attached observers (in the shapes
of zerowatch.engine.hooks) and remembers which phases are open, so that a collective seen
by `dist_wrap` can be given its purpose:

    all_gather      in forward or backward -> param_fetch; in optimizer_step ->
                    optimizer_gather; elsewhere -> other
    reduce_scatter  -> grad_reduce (it is how sharded engines reduce gradients)
    all_reduce      in backward or grad_reduce -> grad_reduce; elsewhere (grad-norm,
                    overflow checks in the optimizer step, user code) -> other
    broadcast       -> other (DeepSpeed's stage-3 trace checks, start-up syncs)

`step` is the whole optimizer step: it opens with the first forward of an accumulation
cycle (`begin_forward`) and closes after the optimizer step (`finish_step`).

`TensorCensus` adds up the bytes of the tensors an engine holds, counting each storage
once (a flat buffer and the parameter views into it are one allocation).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from zerowatch.agent.adapters import clip_watch, dist_wrap
from zerowatch.agent.adapters.base import StepStats
from zerowatch.agent.adapters.dist_wrap import CollectiveTap

from zerowatch.engine.hooks import CollectiveRecord, ObserverRegistry


class PhaseBoard:
    """Open phases of the foreign engine, announced to observers; classifies collectives."""

    def __init__(self) -> None:
        self.observers = ObserverRegistry()
        self._open: dict[str, int] = {}
        self.in_step = False
        self.tap = CollectiveTap(self.classify, self._on_collective, self._on_launch)

    # -- observers -------------------------------------------------------------------------

    def add(self, observer: Any) -> bool:
        """Add an observer; True when it is the first (the adapter installs its hooks)."""
        first = not self.observers
        self.observers.add(observer)
        if first:
            self.tap.open()
        return first

    def remove(self, observer: Any) -> bool:
        """Remove an observer; True when none is left (the adapter removes its hooks)."""
        self.observers.remove(observer)
        if self.observers:
            return False
        self.tap.close()
        self._open.clear()
        self.in_step = False
        return True

    def _on_collective(self, rec: CollectiveRecord) -> None:
        self.observers.call("on_collective", rec)

    def _on_launch(self, group: str, seq: int, op: str, numel: int, dtype: Any,
                   t: float) -> None:  # fmt: skip
        self.observers.call("on_collective_launch", group, seq, op, numel, dtype, t)

    # -- phases ----------------------------------------------------------------------------

    def start(self, phase: str) -> None:
        self._open[phase] = self._open.get(phase, 0) + 1
        self.observers.call("on_phase_start", phase, time.perf_counter())

    def end(self, phase: str) -> None:
        n = self._open.get(phase, 0)
        if n <= 0:
            return  # attached mid-phase: nothing was announced
        self._open[phase] = n - 1
        self.observers.call("on_phase_end", phase, time.perf_counter())

    def is_open(self, phase: str) -> bool:
        return self._open.get(phase, 0) > 0

    def begin_forward(self) -> None:
        """A forward starts; the first of an accumulation cycle also opens `step`."""
        if not self.in_step:
            self.in_step = True
            self.start("step")
        self.start("forward")

    def finish_step(self) -> None:
        """The optimizer step is done: close `step` (and anything left open in it)."""
        for phase in ("forward", "backward", "grad_reduce", "optimizer_step"):
            while self.is_open(phase):
                self.end(phase)
        if self.in_step:
            self.in_step = False
            self.end("step")

    def classify(self, op: str) -> str:
        if op == "all_gather":
            if self.is_open("optimizer_step"):
                return "optimizer_gather"
            if self.is_open("forward") or self.is_open("backward"):
                return "param_fetch"
            return "other"
        if op == "reduce_scatter":
            return "grad_reduce"
        if op == "all_reduce":
            if self.is_open("optimizer_step"):
                return "other"
            if self.is_open("backward") or self.is_open("grad_reduce"):
                return "grad_reduce"
            return "other"
        return "other"


class ForeignAdapter:
    """The shared part of the adapters of engines that know nothing of zerowatch: hooks on
    while an observer is attached, start-up collectives through dist_wrap. Subclasses
    install and remove their hooks in `_install` / `_uninstall`."""

    board: PhaseBoard
    #: The removable handles of the hooks `_install` registered.
    _handles: list[Any]

    def __init__(self) -> None:
        self.board = PhaseBoard()
        self._handles = []

    def attach(self, observer: Any) -> None:
        if self.board.add(observer):
            self._install()

    def detach(self, observer: Any) -> None:
        if self.board.remove(observer):
            self._uninstall()

    def _install(self) -> None:
        raise NotImplementedError

    def _uninstall(self) -> None:
        raise NotImplementedError

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return dist_wrap.broadcast_object(obj, src=src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return dist_wrap.all_gather_object(obj)


#: A parameter dtype -> the precision the run reports.
DTYPE_PRECISION = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


class ModuleOptimizerAdapter(ForeignAdapter):
    """The shared part of the adapters of a torch module stepped by a torch optimizer (DDP,
    the first FSDP, FSDP2): the optimizer it needs, the optimizer's configuration, the
    `clip_grad_norm_` call seen inside a step, and the device.

    Args:
        model: the module.
        optimizer: the torch optimizer stepping its parameters; it marks where each step
            ends.
        call: how `zerowatch.instrument` is called with them, for the error message.

    Raises:
        TypeError: naming `optimizer` when it is missing or has no step hooks.
    """

    def __init__(self, model: Any, optimizer: Any, call: str) -> None:
        if optimizer is None or not hasattr(optimizer, "register_step_post_hook"):
            raise TypeError(
                f"optimizer: {call} needs the torch optimizer that steps the model, got "
                f"{type(optimizer).__name__}"
            )
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        #: (total norm, max_norm) of the last clip_grad_norm_ call in the current step.
        self._clip: tuple[Any, float] | None = None

    def _optimizer_config(self) -> dict[str, Any]:
        """The optimizer's class and its scalar hyper-parameters per group."""
        groups = [
            {k: v for k, v in g.items() if isinstance(v, (int, float, str, bool))}
            for g in self.optimizer.param_groups
        ]
        return {"type": type(self.optimizer).__qualname__, "param_groups": groups}

    def _forward_begins(self) -> None:
        """A forward begins: under grad mode (an evaluation forward is no part of a step)
        it opens the forward phase, and the first of a step forgets the last step's
        clip_grad_norm_ call."""
        if torch.is_grad_enabled():
            if not self.board.in_step:
                self._clip = None
            self.board.begin_forward()

    def _on_clip(self, total_norm: Any, max_norm: Any) -> None:
        """A clip_grad_norm_ call: kept when made inside the step, before the optimizer
        step (the last such call of the step wins)."""
        if self.board.in_step and not self.board.is_open("optimizer_step"):
            self._clip = (total_norm, float(max_norm))

    def step_stats(self) -> StepStats:
        return clip_watch.step_stats(self.optimizer, self._clip)

    def torch_device(self) -> Any:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))


class TensorCensus:
    """Bytes per kind of the tensors found, each storage counted once (first kind wins)."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, found: Any) -> None:
        for t in _tensors(found):
            local = _local_tensor(t)
            if local is None or local.device.type == "meta":
                continue
            try:
                storage = local.untyped_storage()
                ptr, size = int(storage.data_ptr()), int(storage.nbytes())
            except (RuntimeError, NotImplementedError):
                ptr, size = id(local), int(local.numel()) * int(local.element_size())
            if size == 0 or ptr in self._seen:
                continue
            self._seen.add(ptr)
            self.bytes[kind] = self.bytes.get(kind, 0) + size

    def result(self) -> dict[str, int]:
        return {k: v for k, v in self.bytes.items() if v}


def _local_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """A DTensor's local shard, or the tensor itself."""
    if type(t).__name__ != "DTensor":
        return t
    # The shard DTensor holds (`to_local()` returns the same storage, through autograd,
    # at many times the cost: this runs for every parameter, gradient and state each step).
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return t.to_local()  # type: ignore[attr-defined,no-any-return]


def _tensors(found: Any) -> Iterable[torch.Tensor]:
    if found is None:
        return
    if isinstance(found, torch.Tensor):
        yield found
    elif isinstance(found, dict):
        for v in found.values():
            yield from _tensors(v)
    elif isinstance(found, (list, tuple)):
        for v in found:
            yield from _tensors(v)


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of a torch optimizer's per-parameter state (Adam's exp_avg, exp_avg_sq)."""
    out: list[torch.Tensor] = []
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return out
    for per_param in state.values():
        if isinstance(per_param, dict):
            out.extend(v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def host_kinds(measured: dict[str, int], kinds: Iterable[str]) -> dict[str, int]:
    """Rename offloaded kinds to `host_<kind>` (the events.MemoryStats form)."""
    kinds = set(kinds)
    return {(f"host_{k}" if k in kinds else k): v for k, v in measured.items()}


def hook_output_grads(output: Any, hook: Any) -> None:
    """Register `hook` on every tensor of a forward's `output` that requires a gradient
    (under grad mode only: an evaluation forward is no part of a step)."""
    if not torch.is_grad_enabled():
        return
    from torch.utils._pytree import tree_leaves

    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)


__all__ = [
    "DTYPE_PRECISION",
    "ForeignAdapter",
    "ModuleOptimizerAdapter",
    "PhaseBoard",
    "TensorCensus",
    "hook_output_grads",
    "host_kinds",
    "optimizer_state_tensors",
]
