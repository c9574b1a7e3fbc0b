"""Adapter for a model wrapped in PyTorch `DistributedDataParallel` (or a plain module) and
its optimizer: what the Hugging Face Trainer, Accelerate and Lightning build for plain data
parallelism.

DDP has no engine object: the wrapped module and the optimizer are the public surface.
`zerowatch.instrument(ddp_model, optimizer=opt)` hooks both for the life of the run:

    forward         a forward pre-hook on the DDP module, put first (DDP's own pre-forward,
                    buffer broadcast included, is inside), and a forward hook put last
    backward        from the first gradient reaching the outputs (a tensor hook) to an
                    autograd-engine callback that runs after DDP's own final callback
                    (the reducer's, which waits for the last bucket's all-reduce and copies
                    the averaged gradients back): the first callback, queued at the start of
                    backward, runs before DDP's and queues the second behind it
    optimizer_step  `optimizer.register_step_pre_hook` / `register_step_post_hook`
                    (or, for `optimizer.step(closure)` as Lightning calls it, from the
                    closure's return: the closure runs forward and backward)
    step            from the first forward of an accumulation cycle to the end of the
                    optimizer step; clipping and anything else between backward and step is
                    in the step but in no phase (`other`)
    grad norm       a `torch.nn.utils.clip_grad_norm_` call inside the step (clip_watch), as
                    for FSDP2; a script that does not clip has no grad norm

Collectives: DDP all-reduces gradient buckets from C++, out of `dist_wrap`'s sight, unless
a communication hook does it. The adapter registers one (`dist_wrap.allreduce_seen`) that does what
DDP's built-in all-reduce does — divide the bucket by the group size, all-reduce it by sum —
through `torch.distributed.all_reduce`, which `dist_wrap` times while a run is open. A DDP
module takes one communication hook for its life, so the hook stays after the run closes
(then it calls the plain all-reduce) and a second run on the same module finds it there.
A module whose script registered a hook of its own keeps it, and its bucket all-reduces
are not seen (a warning says so). Each bucket's all-reduce is reported when its future
completes (a callback on it: DDP never waits on the work, only on the future), so its
latency is from launch to completion and none of it is counted as exposed: the time
backward waited for the last buckets is inside `backward`.

The run is recorded as ZeRO stage 0 (every rank holds the whole model, its gradients and
optimizer state) in the parameters' dtype. Model-state bytes are the parameters, their
`.grad` and the optimizer's state (DDP's gradient buckets, a second copy of the gradients
unless `gradient_as_bucket_view=True`, are not counted).

A plain module (no DDP) with its optimizer is taken too, by `DDPAdapter(model, optimizer)`
directly: a single-process Trainer or Accelerate job (world size 1, no collectives).

The first FSDP (`FullyShardedDataParallel`, what Lightning's FSDPStrategy builds) is taken
by the same hooks: it all-gathers and reduce-scatters through torch.distributed's Python
functions, which `dist_wrap` sees without a communication hook; its FULL_SHARD is recorded
as stage 3, SHARD_GRAD_OP as stage 2, NO_SHARD as stage 0, engine "fsdp1"; model-state
bytes are its flat parameters' local shards, their gradients and the optimizer's state. It
clips with its own `clip_grad_norm_` method, which clip_watch does not see: no grad norm.
"""

from __future__ import annotations

import logging
from typing import Any

from zerowatch.agent.adapters import clip_watch
from zerowatch.agent.adapters.base import JobInfo, loaded_instance
from zerowatch.agent.adapters.dist_wrap import allreduce_seen
from zerowatch.agent.adapters.foreign import (
    DTYPE_PRECISION,
    ModuleOptimizerAdapter,
    TensorCensus,
    hook_output_grads,
    optimizer_state_tensors,
)

from zerowatch import theory

log = logging.getLogger("zerowatch.agent")

#: DDP's settings recorded with the run.
_DDP_SETTINGS = ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view",
                 "static_graph", "bucket_bytes_cap")  # fmt: skip


def matches(obj: Any) -> bool:
    """A `torch.nn.parallel.DistributedDataParallel` or a `FullyShardedDataParallel` (the
    first FSDP, Lightning's FSDPStrategy) root (checked only if torch is loaded)."""
    return _is_ddp(obj) or _is_fsdp1(obj)


def _is_ddp(obj: Any) -> bool:
    return loaded_instance(obj, "torch", "torch.nn.parallel", "DistributedDataParallel")


def _is_fsdp1(obj: Any) -> bool:
    return loaded_instance(obj, "torch", "torch.distributed.fsdp", "FullyShardedDataParallel")


#: FSDP1 sharding strategy -> the ZeRO stage it is.
_FSDP1_STAGE = {"FULL_SHARD": 3, "HYBRID_SHARD": 3, "SHARD_GRAD_OP": 2, "_HYBRID_SHARD_ZERO2": 2,
                "NO_SHARD": 0}  # fmt: skip


def _install_comm_hook(model: Any) -> bool:
    """Register `allreduce_seen` on a DDP module once; False when another hook is there."""
    hooks = getattr(model, "_comm_hooks", None)
    if hooks is None:
        return False
    if any(hook is allreduce_seen for hook, _ in hooks):
        return True
    if hooks:
        return False
    try:
        model.register_comm_hook(getattr(model, "process_group", None), allreduce_seen)
    except Exception as e:  # registered too late (after a backward), or refused
        log.warning("zerowatch agent: DDP's gradient all-reduce cannot be observed: %s", e)
        return False
    return True


class DDPAdapter(ModuleOptimizerAdapter):
    """A DDP module (or a plain module) + its optimizer -> EngineAdapter.

    Args:
        model: the `DistributedDataParallel` module (or a module trained without one).
        optimizer: the torch optimizer stepping its parameters; it marks where each step
            ends.

    Raises:
        TypeError: naming `optimizer` when it is missing or has no step hooks.
    """

    name = "ddp"

    def __init__(self, model: Any, optimizer: Any = None) -> None:
        super().__init__(model, optimizer, "zerowatch.instrument(ddp_model, optimizer=opt)")
        self.is_ddp = _is_ddp(model)
        self.is_fsdp1 = _is_fsdp1(model)
        self.comm_seen = False
        self._in_backward = False

    # -- the job ---------------------------------------------------------------------------

    def _group(self) -> tuple[int, int]:
        """(rank, world size) of the data-parallel group."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        group = getattr(self.model, "process_group", None) if matches(self.model) else None
        return int(dist.get_rank()), int(dist.get_world_size(group))

    def _stage(self) -> int:
        if not self.is_fsdp1:
            return 0
        strategy = getattr(self.model, "sharding_strategy", None)
        return _FSDP1_STAGE.get(str(getattr(strategy, "name", strategy)), 3)

    def _precision(self) -> str:
        dtype = next((p.dtype for p in self.model.parameters() if p.requires_grad), None)
        return DTYPE_PRECISION.get(str(dtype), "fp32")

    def info(self) -> JobInfo:
        import torch

        settings = {k: getattr(self.model, k) for k in _DDP_SETTINGS if hasattr(self.model, k)}
        settings = {k: v for k, v in settings.items() if isinstance(v, (bool, int, float))}
        rank, world = self._group()
        precision = self._precision()
        stage = self._stage()
        n_params = sum(int(getattr(p, "_unpadded_unsharded_size", p.shape).numel())
                       for p in self.model.parameters() if p.requires_grad)  # fmt: skip
        if self.is_fsdp1:
            strategy = getattr(self.model, "sharding_strategy", None)
            settings["sharding_strategy"] = str(getattr(strategy, "name", strategy))
        device = str(next((p.device for p in self.model.parameters()), torch.device("cpu")))
        name = "fsdp1" if self.is_fsdp1 else self.name
        return JobInfo(
            engine=name,
            rank=rank,
            world_size=world,
            device=device,
            zero_stage=stage,
            precision=precision,
            config={name: {**settings, "optimizer": self._optimizer_config()}},
            param_count=n_params,
            theory=theory.model_state_bytes(n_params, world, stage, precision=precision).flat(),
            theory_comm=theory.comm_bytes_per_step(n_params, world, stage, precision=precision),
            engine_info={
                "name": name,
                "torch_version": str(torch.__version__),
                "class": type(self.model).__qualname__,
                "module": type(getattr(self.model, "module", self.model)).__qualname__,
                "ddp": settings,
                "optimizer": type(self.optimizer).__qualname__,
            },
        )

    # -- hooks -----------------------------------------------------------------------------

    def _install(self) -> None:
        from torch.autograd import Variable

        board = self.board
        if self.is_ddp:
            self.comm_seen = _install_comm_hook(self.model)
            if not self.comm_seen:
                log.warning("zerowatch agent: this DDP module has a communication hook of "
                            "its own: its gradient all-reduces are not recorded")  # fmt: skip

        def backward_done() -> None:
            self._in_backward = False
            board.end("backward")

        def after_ddp() -> None:
            # Queued at the start of backward, this runs before DDP's final callback:
            # queue the end of backward behind that one.
            Variable._execution_engine.queue_callback(backward_done)

        def gradient_reaches_outputs(grad: Any) -> Any:
            if not self._in_backward:
                self._in_backward = True
                board.start("backward")
                Variable._execution_engine.queue_callback(after_ddp)
            return grad

        def pre_forward(_module: Any, _args: Any) -> None:
            self._forward_begins()

        def post_forward(_module: Any, _args: Any, output: Any) -> None:
            board.end("forward")
            hook_output_grads(output, gradient_reaches_outputs)

        def pre_step(_opt: Any, args: Any, kwargs: Any) -> Any:
            closure = kwargs.get("closure", args[0] if args else None)
            if not callable(closure):
                board.start("optimizer_step")
                return None

            # `optimizer.step(closure)` (Lightning) runs forward and backward inside the
            # step: the optimizer step proper starts when the closure returns.
            def then_step() -> Any:
                try:
                    return closure()
                finally:
                    board.start("optimizer_step")

            if "closure" in kwargs:
                return args, {**kwargs, "closure": then_step}
            return (then_step, *args[1:]), kwargs

        def post_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            board.end("optimizer_step")
            board.finish_step()

        self._handles = [
            self.model.register_forward_pre_hook(pre_forward, prepend=True),
            self.model.register_forward_hook(post_forward, always_call=True),
            self.optimizer.register_step_pre_hook(pre_step),
            self.optimizer.register_step_post_hook(post_step),
        ]
        clip_watch.watch(self._on_clip)

    def _uninstall(self) -> None:
        self._remove_handles()
        clip_watch.unwatch(self._on_clip)
        self._in_backward = False
        self._clip = None

    # -- per step --------------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        census = TensorCensus()
        params = list(self.model.parameters())
        census.add("params", [p.data for p in params])
        census.add("grads", [p.grad for p in params])
        census.add("optimizer_states", optimizer_state_tensors(self.optimizer))
        return census.result()


__all__ = ["DDPAdapter", "matches"]
