"""Adapter for a PyTorch FSDP2 model (`torch.distributed.fsdp.fully_shard`) and its optimizer.

FSDP2 has no engine object: the root module and the optimizer are the public surface.
`zerowatch.instrument(model, optimizer=opt)` hooks both for the life of the run:

    forward         a forward pre-hook on the root, put first (before FSDP's own root
                    pre-forward, so the root's parameter all-gather is inside), and a
                    forward hook put last (after FSDP's post-forward)
    backward        from the first gradient reaching the root's outputs (a tensor hook,
                    registered after FSDP's pre-backward hook) to an autograd-engine
                    callback queued from it, which runs after FSDP's own final callback,
                    i.e. once the last reduce-scatter has been waited for
    optimizer_step  `optimizer.register_step_pre_hook` / `register_step_post_hook`
    step            from the first forward of an accumulation cycle to the end of the
                    optimizer step; gradient clipping and anything else the script does
                    between backward and step is in the step but in no phase (`other`)
    grad norm       `torch.nn.utils.clip_grad_norm_` (also reached as
                    `torch.nn.utils.clip_grad.clip_grad_norm_`) is wrapped while a run is
                    open: the total norm it returns for a call made between the step's
                    start and the optimizer step is the step's grad norm (pre-clip), and
                    `clipped` is norm > max_norm. A script that does not clip has no grad
                    norm (FSDP2 computes none on its own).

Collectives come from `dist_wrap`: FSDP2 calls `all_gather_single` (parameter all-gather,
forward and backward: param_fetch) and `reduce_scatter_single` (gradients: grad_reduce),
and `all_reduce` for HSDP replicas and `clip_grad_norm_` (other).

The run is recorded as ZeRO stage 3: between steps FSDP2 holds parameters, gradients and
optimizer state sharded, whatever `reshard_after_forward` says (that only decides whether
a module's parameters stay gathered from its forward to its backward, which changes the
all-gather volume, not the state at rest); how many sharded modules keep their parameters
gathered after forward is recorded beside the mesh. The precision is the mixed precision
policy's `param_dtype`. Model-state bytes are the local shards of the DTensor
parameters and their gradients, and the optimizer's state. FSDP2 keeps the sharded
parameters in their original dtype (fp32), which serve as the master weights: under a bf16
or fp16 policy they are reported as `master_weights`, and `params` at rest is 0 (the
low-precision copy exists only while gathered) where the ZeRO model counts 2Ψ/N.
"""

from __future__ import annotations

import warnings
from typing import Any

from zerowatch.agent.adapters import clip_watch
from zerowatch.agent.adapters.base import JobInfo, loaded_instance
from zerowatch.agent.adapters.foreign import (
    DTYPE_PRECISION,
    ModuleOptimizerAdapter,
    TensorCensus,
    hook_output_grads,
    optimizer_state_tensors,
)

from zerowatch import theory

#: The start of the warning torch.utils.hooks gives when a module's full backward hook
#: fires on its outputs' gradients because none of its inputs requires one.
_BACKWARD_HOOK_NOTE = (
    "Full backward hook is firing when gradients are computed with respect to module outputs"
)


def matches(obj: Any) -> bool:
    """A module that `fully_shard` has wrapped (checked only if torch is loaded)."""
    return loaded_instance(obj, "torch", "torch.distributed.fsdp", "FSDPModule")


def _fsdp_state(model: Any) -> Any:
    try:
        return model._get_fsdp_state()
    except AttributeError:
        return None


class FSDP2Adapter(ModuleOptimizerAdapter):
    """An FSDP2 root module (+ its optimizer) -> EngineAdapter.

    Args:
        model: the root module returned by `fully_shard`.
        optimizer: the optimizer stepping its parameters; it marks where each step ends.

    Raises:
        TypeError: naming `optimizer` when it is missing or has no step hooks.
    """

    name = "fsdp2"

    def __init__(self, model: Any, optimizer: Any = None) -> None:
        super().__init__(model, optimizer, "zerowatch.instrument(fsdp_model, optimizer=opt)")
        self._in_backward = False
        self._end_queued = False
        self._quiet: Any = None  # the open warnings.catch_warnings, see _install

    # -- the job ---------------------------------------------------------------------------

    def _mesh(self) -> Any:
        for p in self.model.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return mesh
        return None

    def _mp_policy(self) -> Any:
        state = _fsdp_state(self.model)
        return getattr(state, "_mp_policy", None)

    def _precision(self) -> str:
        policy = self._mp_policy()
        dtype = getattr(policy, "param_dtype", None)
        return DTYPE_PRECISION.get(str(dtype), "fp32") if dtype is not None else "fp32"

    def _sharded_modules(self) -> dict[str, int]:
        """FSDP modules, and how many keep their parameters gathered after forward (the
        root does so on its own once FSDP has lazily initialised)."""
        from torch.distributed.fsdp import FSDPModule

        modules = kept = 0
        for module in self.model.modules():
            if not isinstance(module, FSDPModule):
                continue
            modules += 1
            groups = getattr(_fsdp_state(module), "_fsdp_param_groups", None) or []
            if any(getattr(g, "post_forward_mesh_info", True) is None for g in groups):
                kept += 1
        return {"modules": modules, "kept_gathered_after_forward": kept}

    def info(self) -> JobInfo:
        import torch
        import torch.distributed as dist

        mesh = self._mesh()
        world = int(mesh.size()) if mesh is not None else (
            dist.get_world_size() if dist.is_initialized() else 1)  # fmt: skip
        rank = dist.get_rank() if dist.is_initialized() else 0
        precision = self._precision()
        stage = 3
        n_params = sum(int(p.numel()) for p in self.model.parameters() if p.requires_grad)
        policy = self._mp_policy()
        policy_info = {
            k: str(getattr(policy, k))
            for k in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
            if policy is not None and hasattr(policy, k)
        }
        mesh_info: dict[str, Any] = {}
        if mesh is not None:
            mesh_info = {
                "device_type": str(mesh.device_type),
                "shape": [int(s) for s in mesh.shape],
                "dim_names": list(mesh.mesh_dim_names or ()),
                "ranks": [int(r) for r in mesh.mesh.flatten().tolist()],
            }
        device = str(next((p.device for p in self.model.parameters()), torch.device("cpu")))
        return JobInfo(
            engine=self.name,
            rank=int(rank),
            world_size=world,
            device=device,
            zero_stage=stage,
            precision=precision,
            config={
                "fsdp2": {
                    "mesh": mesh_info,
                    "mp_policy": policy_info,
                    "optimizer": self._optimizer_config(),
                }
            },
            param_count=n_params,
            micro_batch_size=1,
            gradient_accumulation_steps=1,
            theory=theory.model_state_bytes(n_params, world, stage, precision=precision).flat(),
            theory_comm=theory.comm_bytes_per_step(n_params, world, stage, precision=precision),
            engine_info={
                "name": "fsdp2",
                "torch_version": str(torch.__version__),
                "class": type(self.model).__qualname__,
                "mesh": mesh_info,
                "mp_policy": policy_info,
                "sharded_modules": self._sharded_modules(),
                "optimizer": type(self.optimizer).__qualname__,
            },
        )

    # -- hooks -----------------------------------------------------------------------------

    def _uninstall(self) -> None:
        self._remove_handles()
        clip_watch.unwatch(self._on_clip)
        self._unquiet()
        self._in_backward = self._end_queued = False
        self._clip = None

    def _unquiet(self) -> None:
        if self._quiet is not None:
            quiet, self._quiet = self._quiet, None
            quiet.__exit__(None, None, None)

    def _install(self) -> None:
        from torch.autograd import Variable

        board = self.board

        def backward_done() -> None:
            self._unquiet()
            self._in_backward = self._end_queued = False
            board.end("backward")

        def backward_begins(_module: Any, _grad_output: Any) -> None:
            # The backward pre-hook is ours, not the user's: torch's note that it fires on
            # the outputs' gradients (the inputs need none) comes right after this returns,
            # from the same torch hook. It is silenced from here until the next thing that
            # runs, the gradient reaching the outputs (`queue_backward_end`), and nowhere
            # else: the user's filters are untouched outside that window.
            if self._quiet is None:
                self._quiet = warnings.catch_warnings()
                self._quiet.__enter__()
                warnings.filterwarnings("ignore", message=_BACKWARD_HOOK_NOTE,
                                        category=UserWarning)  # fmt: skip
            if not self._in_backward:
                self._in_backward = True
                board.start("backward")

        def queue_backward_end(grad: Any) -> Any:
            self._unquiet()
            if self._in_backward and not self._end_queued:
                self._end_queued = True
                Variable._execution_engine.queue_callback(backward_done)
            return grad

        def pre_forward(_module: Any, _args: Any) -> None:
            self._unquiet()
            self._forward_begins()

        def post_forward(_module: Any, _args: Any, output: Any) -> None:
            board.end("forward")
            # After FSDP's: the end-of-backward callback is queued after FSDP's final one.
            hook_output_grads(output, queue_backward_end)

        def pre_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            board.start("optimizer_step")

        def post_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            self._unquiet()
            board.end("optimizer_step")
            board.finish_step()  # the step's stats are read here; kept until the next step

        self._handles = [
            self.model.register_forward_pre_hook(pre_forward, prepend=True),
            # A backward pre-hook wraps the outputs after every forward hook has run, so
            # it fires before FSDP's pre-backward hooks (which all-gather for backward).
            self.model.register_full_backward_pre_hook(backward_begins),
            self.model.register_forward_hook(post_forward, always_call=True),
            self.optimizer.register_step_pre_hook(pre_step),
            self.optimizer.register_step_post_hook(post_step),
        ]
        clip_watch.watch(self._on_clip)

    # -- per step --------------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        census = TensorCensus()
        params = [p for p in self.model.parameters()]
        # Under a low-precision policy the sharded parameters FSDP2 keeps at rest are the
        # fp32 masters; the low-precision copy exists only while gathered.
        census.add("params" if self._precision() == "fp32" else "master_weights", params)
        census.add("grads", [p.grad for p in params])
        census.add("optimizer_states", optimizer_state_tensors(self.optimizer))
        return census.result()


__all__ = ["FSDP2Adapter", "matches"]
