"""Adapter for DeepSpeed's engine (`deepspeed.initialize(...)[0]`), without editing it.

Phases come from the engine's public surface, wrapped on the instance for the life of the
run and restored on detach:

    forward         a forward pre-hook (first of all) and a forward hook (always called) on
                    the engine module: DeepSpeed's `fwd` timer runs inside them
    backward        from the first gradient reaching the engine's outputs (a tensor hook, at
                    the point where DeepSpeed's own hook starts its `bwd` timer) to the end of
                    `engine.backward(loss)`, after the gradient-reduction epilogue; a bare
                    `loss.backward()` ends it with an autograd-engine callback instead
    grad_reduce     `engine.allreduce_gradients()`, which the backward epilogue calls:
                    DeepSpeed's `bwd_allreduce`
    optimizer_step  `engine.step()`: DeepSpeed's `step` timer covers the same call
    step            from the first forward of an accumulation cycle to the end of the
                    `engine.step()` that crossed the accumulation boundary

Collectives come from `dist_wrap` (DeepSpeed's `deepspeed.comm` calls torch.distributed;
on CPU its shared-memory all-reduce serves only `inference_all_reduce`, which ZeRO
training does not use). Purposes follow the phase a call ran in (see `foreign.PhaseBoard`).

Model-state bytes are read from the ZeRO optimizer's own buffers, each storage once:

    stage 1-2  params: `bit16_groups_flat` (the model's weights live in it);
               master_weights: `single_partition_of_fp32_groups`; grads: their `.grad`,
               the `averaged_gradients` and (offload) `grads_in_partition`;
               optimizer_states: the wrapped torch optimizer's state
    stage 3    params: `fp16_partitioned_groups_flat` and each parameter's `ds_tensor`
               (plus gathered data still held); master_weights: `fp32_partitioned_groups_flat`
               (the same storage as the params in fp32 on the same device: counted once);
               grads: `grad_partitions_flat_buffer` and the fp32 partitions' `.grad`

With `offload_optimizer` on, optimizer states, master weights and the fp32 gradient
partition are reported as `host_<kind>`, as in zerowatch.theory (and the parameter
partitions with stage 3's `offload_param`). DeepSpeed stages 1-2 keep an fp32
master partition even when training in fp32, which the ZeRO model does not count (there
the fp32 parameters are the master): measured master_weights exceed the theory by 4Ψ/N.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from zerowatch.agent.adapters.base import JobInfo, StepStats, loaded_instance
from zerowatch.agent.adapters.foreign import (
    ForeignAdapter,
    TensorCensus,
    hook_output_grads,
    optimizer_state_tensors,
)
from zerowatch.agent.adapters.zerowatch_engine import _finite_or_none

from zerowatch import theory


def matches(obj: Any) -> bool:
    """A `deepspeed.runtime.engine.DeepSpeedEngine` (checked only if deepspeed is loaded)."""
    return loaded_instance(obj, "deepspeed", "deepspeed.runtime.engine", "DeepSpeedEngine")


def _offload_device(value: Any) -> str:
    device = getattr(value, "device", None)
    if device is None:
        return "none"
    name = str(getattr(device, "value", device))
    return "cpu" if name == "cpu" else "none"


class DeepSpeedAdapter(ForeignAdapter):
    """deepspeed.DeepSpeedEngine -> EngineAdapter."""

    name = "deepspeed"

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine
        self._wrapped: dict[str, Callable[..., Any]] = {}
        self._skipped_before = 0

    # -- the job ---------------------------------------------------------------------------

    def _precision(self) -> str:
        e = self.engine
        if e.bfloat16_enabled():
            return "bf16"
        if e.fp16_enabled():
            return "fp16"
        return "fp32"

    def _params(self) -> tuple[int, int]:
        """(trainable parameters Ψ, stage-3 persistent parameter elements)."""
        total = persistent = 0
        for p in self.engine.module.parameters():
            if not p.requires_grad:
                continue
            n = int(getattr(p, "ds_numel", 0) or p.numel())
            total += n
            if getattr(p, "ds_persist", False):
                persistent += n
        return total, persistent

    def info(self) -> JobInfo:
        import deepspeed

        e = self.engine
        stage = int(e.zero_optimization_stage())
        world = int(getattr(e, "dp_world_size", 1) or 1)
        precision = self._precision()
        off_opt = _offload_device(e.zero_offload_optimizer()) if stage >= 1 else "none"
        off_param = _offload_device(e.zero_offload_param()) if stage == 3 else "none"
        n_params, persistent = self._params()
        ga = int(e.gradient_accumulation_steps())
        model = theory.model_state_bytes(
            n_params, world, stage, precision=precision, offload_optimizer=off_opt == "cpu",
            offload_param=off_param == "cpu", persistent_params=persistent,
        )  # fmt: skip
        raw = getattr(getattr(e, "_config", None), "_param_dict", None)
        config = dict(raw) if isinstance(raw, dict) else {}
        return JobInfo(
            engine=self.name,
            rank=int(getattr(e, "global_rank", 0) or 0),
            world_size=world,
            device=str(e.device),
            zero_stage=stage,
            precision=precision,
            offload_optimizer=off_opt,
            offload_param=off_param,
            config=_jsonable(config),
            param_count=n_params,
            persistent_params=persistent,
            micro_batch_size=int(e.train_micro_batch_size_per_gpu()),
            gradient_accumulation_steps=ga,
            theory=model.flat(),
            theory_comm=theory.comm_bytes_per_step(
                n_params,
                world,
                stage,
                precision=precision,
                gradient_accumulation_steps=ga,
                persistent_params=persistent,
            ),
            engine_info={
                "name": "deepspeed",
                "version": deepspeed.__version__,
                "class": type(e).__qualname__,
                "optimizer": type(e.optimizer).__qualname__,
                "wall_clock_breakdown": bool(e.wall_clock_breakdown()),
            },
            global_step=int(getattr(e, "global_steps", 0) or 0),
        )

    # -- hooks -----------------------------------------------------------------------------

    def _install(self) -> None:
        import torch
        from torch.autograd import Variable

        e, board = self.engine, self.board
        state = {"in_engine_backward": False}

        def backward_done() -> None:
            board.end("backward")

        def gradient_reaches_outputs(grad: Any) -> Any:
            # Where DeepSpeed starts its `bwd` timer (its own hook on the same outputs).
            if not board.is_open("backward"):
                board.start("backward")
                if not state["in_engine_backward"]:  # loss.backward() called directly
                    Variable._execution_engine.queue_callback(backward_done)
            return grad

        def pre_forward(_module: Any, _args: Any) -> None:
            if torch.is_grad_enabled():  # an evaluation forward is no part of a step
                board.begin_forward()

        def post_forward(_module: Any, _args: Any, output: Any) -> None:
            board.end("forward")
            hook_output_grads(output, gradient_reaches_outputs)

        self._handles = [
            e.register_forward_pre_hook(pre_forward, prepend=True),
            e.register_forward_hook(post_forward, always_call=True),
        ]
        self._skipped_before = int(getattr(e, "skipped_steps", 0) or 0)
        backward = e.backward

        def backward_wrapper(*args: Any, **kwargs: Any) -> Any:
            state["in_engine_backward"] = True
            try:
                return backward(*args, **kwargs)
            finally:
                state["in_engine_backward"] = False
                board.end("backward")  # after DeepSpeed's epilogue stopped `bwd`

        self._set("backward", backward_wrapper)
        self._wrap("allreduce_gradients", "grad_reduce")
        step = e.step  # the bound method (or whatever wraps it already)

        def step_wrapper(*args: Any, **kwargs: Any) -> Any:
            boundary = bool(e.is_gradient_accumulation_boundary())
            board.start("optimizer_step")
            try:
                return step(*args, **kwargs)
            finally:
                board.end("optimizer_step")
                if boundary:
                    board.finish_step()

        self._set("step", step_wrapper)

    def _wrap(self, method: str, phase: str) -> None:
        inner = getattr(self.engine, method)
        board = self.board

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            board.start(phase)
            try:
                return inner(*args, **kwargs)
            finally:
                board.end(phase)

        self._set(method, wrapper)

    def _set(self, method: str, wrapper: Callable[..., Any]) -> None:
        wrapper.__zerowatch__ = True  # type: ignore[attr-defined]
        # An instance attribute shadows the class's method; nn.Module.__setattr__ takes
        # plain callables as ordinary attributes.
        object.__setattr__(self.engine, method, wrapper)
        self._wrapped[method] = wrapper

    def _uninstall(self) -> None:
        self._remove_handles()
        for method, wrapper in self._wrapped.items():
            if self.engine.__dict__.get(method) is wrapper:
                del self.engine.__dict__[method]
        self._wrapped = {}

    # -- per step --------------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        e = self.engine
        opt = e.optimizer
        stage = int(e.zero_optimization_stage())
        # Offloaded state lives on the host: `host_<kind>`, as zerowatch.theory names it.
        off_opt = stage >= 1 and _offload_device(e.zero_offload_optimizer()) == "cpu"
        off_param = stage == 3 and _offload_device(e.zero_offload_param()) == "cpu"
        params = "host_params" if off_param else "params"
        master = "host_master_weights" if off_opt else "master_weights"
        opt_grads = "host_grads" if off_opt else "grads"  # the fp32 gradient partition
        census = TensorCensus()
        if stage == 3:
            census.add(params, getattr(opt, "fp16_partitioned_groups_flat", None))
            for p in e.module.parameters():
                census.add(params, getattr(p, "ds_tensor", None))
                census.add("params", p.data)  # gathered (or persistent) data on the device
            census.add(master, getattr(opt, "fp32_partitioned_groups_flat", None))
            census.add(opt_grads, getattr(opt, "grad_partitions_flat_buffer", None))
            for flat in getattr(opt, "fp32_partitioned_groups_flat", None) or []:
                census.add(opt_grads, flat.grad)
        elif stage in (1, 2):
            census.add("params", getattr(opt, "bit16_groups_flat", None))
            census.add("params", [p.data for p in e.module.parameters()])
            fp32 = getattr(opt, "single_partition_of_fp32_groups", None) or []
            census.add(master, fp32)
            census.add(opt_grads, [t.grad for t in fp32])
            census.add(opt_grads, getattr(opt, "grads_in_partition", None))
            census.add("grads", getattr(opt, "averaged_gradients", None))
        else:
            census.add("params", [p.data for p in e.module.parameters()])
        census.add("grads", [p.grad for p in e.module.parameters()])
        inner = getattr(opt, "optimizer", opt)
        census.add("host_optimizer_states" if off_opt else "optimizer_states",
                   optimizer_state_tensors(inner))  # fmt: skip
        return census.result()

    def step_stats(self) -> StepStats:
        e = self.engine
        raw = e.get_global_grad_norm()
        norm = _finite_or_none(raw)
        clip = float(e.gradient_clipping() or 0.0)
        skipped_now = int(getattr(e, "skipped_steps", 0) or 0)
        skipped = skipped_now > self._skipped_before
        self._skipped_before = skipped_now
        scale = None
        if e.fp16_enabled():
            cfg = getattr(e.optimizer, "loss_scale_config", None)
            scale = _finite_or_none(getattr(cfg, "cur_scale", None) if cfg is not None
                                    else getattr(e.optimizer, "cur_scale", None))  # fmt: skip
        try:
            lr = _finite_or_none(e.get_lr()[0])
        except (IndexError, TypeError, AttributeError):
            lr = None
        return StepStats(
            grad_norm=norm,
            clipped=bool(norm is not None and clip > 0 and norm > clip),
            loss_scale=scale,
            skipped=skipped,
            lr=lr,
            nonfinite=raw is not None and norm is None,
        )

    def torch_device(self) -> Any:
        import torch

        return torch.device(self.engine.device)


def _jsonable(value: Any) -> Any:
    """The config as plain JSON values (DeepSpeed accepts a few non-JSON ones: the Hugging
    Face integration writes `steps_per_print: inf`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


__all__ = ["DeepSpeedAdapter", "matches"]
