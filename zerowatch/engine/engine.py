"""`ZeroEngine`: the training loop's view of the bundled ZeRO engine.

    engine, optimizer, _, lr_scheduler = zerowatch.initialize(model=m, config=cfg)
    for batch in data:
        loss = engine(batch)          # forward
        engine.backward(loss)         # gradients reduced (and sharded) as backward runs
        engine.step()                 # optimizer step on the gradient-accumulation boundary

The engine composes one stage from a parameter owner, a gradient reducer and the master
weights (stages.py, optim.py); it moves nothing itself. Everything it communicates goes
through `comm.Comm`, every phase boundary through `phases.Phases`, and observers attach
with `add_observer` (see hooks.py).

The parts hook the model (gradient hooks on its parameters, forward hooks on its modules at
stage 3). They come off again with `engine.destroy()` (DeepSpeed's name), when the engine is
garbage-collected, and when the same model is wrapped by a new engine, so that a discarded
engine never reduces a gradient or gathers a parameter again.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zerowatch import theory
from zerowatch.config import ConfigError, ZeroWatchConfig
from zerowatch.engine import checkpoint as _checkpoint
from zerowatch.engine import gathered as _gathered
from zerowatch.engine import launch
from zerowatch.engine import zero_init as _zero_init
from zerowatch.engine.comm import Comm, carries_cuda, device_backends
from zerowatch.engine.flat import Segment, Slot
from zerowatch.engine.forensics import LocalGrads
from zerowatch.engine.hooks import ObserverRegistry
from zerowatch.engine.optim import MasterWeights, StepStats, build_optimizer, state_tensors
from zerowatch.engine.phases import Phases
from zerowatch.engine.precision import DTYPES, make_scaler
from zerowatch.engine.schedulers import build_scheduler
from zerowatch.engine.stages import ParamList, compose


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def pick_device() -> torch.device:
    """This rank's device (docs/gpu.md): its GPU, cuda:(local_rank % device_count) made
    current with torch.cuda.set_device, when CUDA is available and the default process group
    (or no group) carries CUDA tensors; else the CPU.

    A group whose CUDA tensors would go through gloo trains on the CPU (gloo stages CUDA
    tensors through host memory and lacks some CUDA collectives): said once.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if torch.distributed.is_initialized() and not carries_cuda():
        config = ",".join(f"{d}:{b}" for d, b in device_backends().items())
        launch.log_once(f"the process group ({config}) reduces CUDA tensors with gloo: "
                        "training on the CPU; make the group with 'nccl' or "
                        "'cpu:gloo,cuda:nccl' to train on the GPU")  # fmt: skip
        return torch.device("cpu")
    return launch.bind_device()


def _param_groups(module: nn.Module, model_parameters: Any,
                  optimizer: Any) -> tuple[ParamList, list[dict[str, Any]]]:  # fmt: skip
    """Trainable parameters with their param-group index, and each group's options."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    trainable = [p for p in module.parameters() if p.requires_grad]
    raw: list[Any]
    if isinstance(optimizer, torch.optim.Optimizer):
        raw = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        raw = list(model_parameters)
        if not raw or not isinstance(raw[0], dict):
            raw = [{"params": raw}]
    else:
        raw = [{"params": trainable}]
    group_of: dict[int, int] = {}
    options: list[dict[str, Any]] = []
    for gi, g in enumerate(raw):
        options.append({k: v for k, v in g.items() if k != "params"})
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError(f"model_parameters: group {gi} holds a tensor that is not a "
                                 "parameter of the model")  # fmt: skip
            if p.requires_grad:
                group_of.setdefault(id(p), gi)
    missing = [names[id(p)] for p in trainable if id(p) not in group_of]
    if missing:
        raise ValueError(f"model_parameters: {missing[0]!r} requires grad but is in no "
                         "param group (freeze it with requires_grad_(False))")  # fmt: skip
    return [(names[id(p)], p, group_of[id(p)]) for p in trainable], options


class _CallableInt(int):
    """An int that also answers a call with itself (DeepSpeed makes some of these methods)."""

    def __call__(self) -> int:
        return int(self)


class ZeroEngine:
    """A model trained with ZeRO stage 0-3; see the module docstring.

    Args:
        module: the model (moved to the device, cast to the compute dtype, parameters
            replaced by views into the engine's buffers).
        config: the resolved config.
        model_parameters: parameters or param-group dicts to train (default: all that
            require grad).
        optimizer: an optimizer built on the model's parameters, or a callable taking param
            groups; default: the `optimizer` config section.
        lr_scheduler: a scheduler on that optimizer, or a callable taking the optimizer;
            the `scheduler` config section wins when present.
    """

    def __init__(self, module: nn.Module, config: ZeroWatchConfig, *, model_parameters: Any = None,
                 optimizer: Any = None, lr_scheduler: Any = None) -> None:  # fmt: skip
        self.config = config
        self.module = module
        self._observers = ObserverRegistry()
        self.comm = Comm(self._observers)
        self.phases = Phases(self._observers)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.device = pick_device()
        self.phases.cuda = self.device.type == "cuda"
        zc = config.zero_optimization
        self.zero_stage = int(zc.stage)
        self.precision = config.precision
        self.dtype = DTYPES[self.precision]
        #: What gradients are divided by before the sum across ranks; the rest of the world
        #: size after it (config.gradient_predivide_factor).
        f = float(config.gradient_predivide_factor)
        self.predivide = f if f != 1.0 else float(self.world_size)
        if zc.offload_param.device == "cpu" and self.zero_stage != 3:
            raise ConfigError("zero_optimization.offload_param: needs stage 3, "
                             f"got stage {self.zero_stage}")  # fmt: skip
        if zc.offload_optimizer.device == "cpu" and self.zero_stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer: needs stage 1, 2 or 3")
        # An int that DeepSpeed scripts may also call: `engine.gradient_accumulation_steps()`.
        self.gradient_accumulation_steps = _CallableInt(
            max(int(config.gradient_accumulation_steps), 1)
        )
        self.micro_batch_size = int(
            config.train_micro_batch_size_per_gpu
            or (config.train_batch_size or 0) // (self.gradient_accumulation_steps * self.world_size)
            or 1)  # fmt: skip

        params, options = _param_groups(module, model_parameters, optimizer)
        self.num_parameters = sum(p.numel() for _, p, _ in params)
        self._unwrap_earlier(module)
        # A model built under zerowatch.zero.Init (zero_init.py) is never made whole: its
        # large trained parameters stay in their parts until ShardedParams adopts them.
        sharded = self._adopt_partitioned(module, params, zc)
        if sharded:
            _zero_init.move(module, self.device)
        else:
            module.to(device=self.device)
        if self.dtype != torch.float32:
            for t in [*module.parameters(), *module.buffers()]:
                if t.is_floating_point() and id(t) not in sharded:
                    t.data = t.data.to(self.dtype)
        self._broadcast_initial_state(skip=sharded, max_numel=max(int(zc.reduce_bucket_size), 1))

        #: (name, parameter, param group) of what the engine trains, in the model's order:
        #: what the stages are laid out from (zerowatch/rehearse lays them out again, on
        #: stand-ins, for the doctor).
        self.trained_params = params
        #: The model came partitioned from zerowatch.zero.Init: it is never held whole.
        self.built_partitioned = bool(sharded)
        #: Stage 3 reduces gradients on a process group of its own (docs/gpu.md).
        self.grad_comm = self.comm.twin() if self.zero_stage == 3 else None
        self.parts = compose(self.zero_stage, module, params, zc, self.comm, self.phases,
                             device=self.device, dtype=self.dtype,
                             grad_comm=self.grad_comm)  # fmt: skip
        # Called by destroy(), or when this engine is collected: it holds the parts, not
        # the engine, so it does not keep a discarded engine alive.
        self._unhook = weakref.finalize(self, self.parts.remove_hooks)
        self._unhook.atexit = False  # nothing to undo in a process that is ending
        self.num_persistent_parameters = self.parts.persistent_numel
        #: Each rank's gradients before the reduction, per step (forensics.py): which rank
        #: and which parameters a non-finite gradient came from.
        self.local_grads = LocalGrads({name: i for i, (name, _, _) in enumerate(params)})
        for r in self.parts.reducers:
            r.local_grads = self.local_grads
        self.offload_optimizer = zc.offload_optimizer.device == "cpu"
        self.offload_param = zc.offload_param.device == "cpu"
        self.masters = MasterWeights(self.parts.segments, self.comm, self.phases,
                                     precision=self.precision, offload=self.offload_optimizer,
                                     params_on_host=self.parts.params_on_host,
                                     device=self.device)  # fmt: skip
        groups = [{"params": ps, **opts}
                  for ps, opts in zip(self.masters.group_params(len(options)), options, strict=True)]  # fmt: skip
        self.optimizer = build_optimizer(config.optimizer, optimizer, groups)
        self.lr_scheduler: Any = None
        if config.scheduler is not None:
            self.lr_scheduler = build_scheduler(config.scheduler.type, self.optimizer,
                                                dict(config.scheduler.params))  # fmt: skip
        elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            self.lr_scheduler = lr_scheduler(self.optimizer)
        else:
            self.lr_scheduler = lr_scheduler
        self.scaler = make_scaler(self.precision, config.fp16)

        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_step: StepStats | None = None
        self._step_open = False
        self._slots: dict[int, tuple[Segment, Slot, Any]] | None = None
        _gathered.register(self)

    # -- life ----------------------------------------------------------------------------------

    @staticmethod
    def _unwrap_earlier(module: nn.Module) -> None:
        """A model wrapped again: the earlier engine's hooks come off first (at stage 3 its
        parameters live partitioned in that engine, so the model cannot be wrapped again)."""
        for earlier in _gathered.engines_over(module):
            if earlier.zero_stage == 3:
                raise ValueError(
                    "model: its parameters are partitioned by a live ZeRO-3 engine; wrap a "
                    "fresh model (load the earlier engine's consolidated_state_dict() into it)"
                )
            earlier.destroy()

    def destroy(self) -> None:
        """Take the engine's hooks off the model: its forward and backward run none of this
        engine's collectives afterwards. Idempotent; the engine is not usable after it."""
        self._unhook()
        _gathered.unregister(self)
        if self.grad_comm is not None:
            self.grad_comm.close()
            self.grad_comm = None

    def _adopt_partitioned(self, module: nn.Module, params: ParamList, zc: Any) -> set[int]:
        """For a model built under zero.Init: check the stage, make whole the partitioned
        parameters that stage 3 keeps whole (frozen ones, those under the persistence
        threshold); the ids of those that stay partitioned (ShardedParams adopts them)."""
        parts = _zero_init.partitioned(module)
        if not parts:
            return set()
        if self.zero_stage != 3:
            raise ConfigError("zero_optimization.stage: a model built under zerowatch.zero.Init "
                             f"needs stage 3, got stage {self.zero_stage}")  # fmt: skip
        threshold = int(zc.stage3_param_persistence_threshold)
        big = {id(p) for _, p, _ in params if p.numel() >= threshold}
        with torch.no_grad():
            for p in parts:
                if id(p) not in big:
                    _zero_init.materialise(p, self.comm, self.device)
        return {id(p) for p in parts if id(p) in big}

    # -- observers ---------------------------------------------------------------------------

    def add_observer(self, observer: Any) -> None:
        """Register an object with any of on_collective, on_phase_start, on_phase_end,
        on_offload (see hooks.py)."""
        self._observers.add(observer)

    def remove_observer(self, observer: Any) -> None:
        self._observers.remove(observer)

    # -- training ----------------------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation cycle."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def _cast_input(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.to(self.device)
            if x.is_floating_point() and x.dtype != self.dtype:
                x = x.to(self.dtype)
        return x

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (floating inputs cast to the compute dtype, moved to the device)."""
        if not self._step_open and torch.is_grad_enabled() and self.module.training:
            self._step_open = True
            self.phases.start("step")
        args, kwargs = tree_map(self._cast_input, (args, kwargs))
        try:
            with self.phases.phase("forward"):
                for o in self.parts.owners:
                    o.begin_pass("forward")
                out = self.module(*args, **kwargs)
                for o in self.parts.owners:
                    o.end_pass("forward")
        except Exception as e:
            self._failed(e, "forward")
            raise
        return out

    __call__ = forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of `loss` / gradient_accumulation_steps (times the fp16 loss scale);
        gradients are reduced as they are produced."""
        try:
            self._backward(loss, retain_graph)
        except Exception as e:
            self._failed(e, "backward")
            raise
        return loss

    def _backward(self, loss: torch.Tensor, retain_graph: bool) -> None:
        sync = self.is_gradient_accumulation_boundary()
        with self.phases.phase("backward"):
            # Divided before the sum across ranks (`predivide`), in the loss: gradients are
            # linear in it, and the multiplication is one the loss scale needs anyway.
            factor = self.scaler.scale / (self.gradient_accumulation_steps * self.predivide)
            scaled = loss if factor == 1.0 else loss.float() * factor
            for r in self.parts.reducers:
                r.begin_backward(sync, roots=[scaled])
            for o in self.parts.owners:
                o.begin_pass("backward")
            scaled.backward(retain_graph=retain_graph)
            # The owners finish the pass's gathers before the reducers wait for anything.
            for o in self.parts.owners:
                o.end_pass("backward")
            for r in self.parts.reducers:
                r.end_backward()

    def step(self) -> None:
        """Step the optimizer if this micro-batch ends an accumulation cycle."""
        try:
            self._step()
        except Exception as e:
            self._failed(e, "optimizer_step")
            raise

    def _failed(self, error: Exception, phase: str) -> None:
        """Tell the observers that `error` is leaving the engine in `phase` of the step in
        progress (`on_error(error, phase, step)`: the agent's last event), before it goes
        on to the caller unchanged."""
        if self._observers:
            self._observers.call("on_error", error, phase, self.global_steps)

    def _step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        # What the reduced gradients were multiplied by (before the scaler moves).
        divisor = self.scaler.scale / (self.gradient_accumulation_steps * self.predivide)
        with self.phases.phase("optimizer_step"):
            stats = self.masters.step(
                self.optimizer, grad_divisor=self.world_size / self.predivide * self.scaler.scale,
                clip=float(self.config.gradient_clipping),
                skip_nonfinite=self.precision == "fp16", loss_scale=self.scaler.reported)  # fmt: skip
            self.scaler.update(stats.nonfinite)
            if stats.skipped:
                self.skipped_steps += 1
            else:
                for o in self.parts.owners:
                    o.after_step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            for r in self.parts.reducers:
                r.zero_grad()
        local = self.local_grads.take(divisor)
        if local is not None:
            stats = dataclasses.replace(stats, local_grads=local)
        self.global_steps += 1
        self.last_step = stats
        if self._step_open:
            self._step_open = False
            self.phases.end("step")

    def zero_optimization_stage(self) -> int:
        """DeepSpeed's name for `zero_stage`."""
        return self.zero_stage

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # DeepSpeed's accessors, for scripts that switch with `import zerowatch as deepspeed`.

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch_size

    def train_batch_size(self) -> int:
        return self.micro_batch_size * int(self.gradient_accumulation_steps) * self.world_size

    def get_global_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None before the first
        step, or when it was not finite)."""
        return self.last_step.grad_norm if self.last_step is not None else None

    def was_step_applied(self) -> bool:
        """False when the last step was skipped (an fp16 overflow)."""
        return self.last_step is not None and not self.last_step.skipped

    # -- memory ------------------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, measured from the engine's tensors.

        Keys: params, grads, optimizer_states, master_weights (on the training device) and
        host_<kind> for what offload keeps in host memory (present only when non-zero).
        Transient buffers (gathered stage-3 units, staging for reduce-scatter) are not
        model state and are not counted; frozen parameters and buffers neither.
        """
        device = {"params": 0, "grads": 0, "optimizer_states": 0, "master_weights": 0}
        host = dict.fromkeys(device, 0)
        for o in self.parts.owners:
            where = host if getattr(o, "offload", False) else device
            where["params"] += _nbytes(o.param_tensors())
        for r in self.parts.reducers:
            device["grads"] += _nbytes(r.grad_tensors())
        opt_where = host if self.offload_optimizer else device
        opt_where["optimizer_states"] += _nbytes(state_tensors(self.optimizer))
        opt_where["master_weights"] += _nbytes(self.masters.master_tensors())
        host["grads"] += _nbytes(self.masters.host_grad_tensors())
        out = dict(device)
        out.update({f"host_{k}": v for k, v in host.items() if v})
        return out

    def theory(self) -> theory.ModelStateBytes:
        """theory.py's per-rank model-state bytes for this engine's stage and options."""
        return theory.model_state_bytes(
            self.num_parameters, self.world_size, self.zero_stage, precision=self.precision,
            offload_optimizer=self.offload_optimizer, offload_param=self.offload_param,
            persistent_params=self.num_persistent_parameters)  # fmt: skip

    # -- whole parameters outside the step (zerowatch.zero.GatheredParameters) -------------

    def slot_index(self) -> dict[int, tuple[Segment, Slot, Any]]:
        """id(trained parameter) -> (its segment, its slot, the segment's fp32 master)."""
        if self._slots is None:
            master_of = {m.seg.index: m for m in self.masters.masters}
            self._slots = {id(s.param): (seg, s, master_of[seg.index])
                           for seg in self.parts.segments for s in seg.slots}  # fmt: skip
        return self._slots

    def hold_whole(self, params: list[nn.Parameter]) -> Any:
        """Make `params` whole (stage 3 gathers their units) until `release_whole(token)`."""
        owner = self.parts.owners[0]
        return (owner, owner.hold(params)) if hasattr(owner, "hold") else None

    def release_whole(self, token: Any) -> None:
        if token is not None:
            owner, units = token
            owner.unhold(units)

    def take_changes(self, params: list[nn.Parameter], src: int) -> None:
        """Broadcast `params` (whole now) from rank `src` and write them into this rank's
        parameter part and fp32 master, so that training goes on from them."""
        index = self.slot_index()
        with torch.no_grad():
            for p in params:
                seg, slot, master = index[id(p)]
                self.comm.broadcast(p.data, src=src, purpose="other")
                # The part of this parameter that falls in this rank's part of the segment.
                lo = max(slot.offset, seg.shard_offset)
                hi = min(slot.offset + slot.numel, seg.shard_offset + seg.shard_numel)
                if lo >= hi:
                    continue
                values = p.data.reshape(-1)[lo - slot.offset : hi - slot.offset]
                at = lo - seg.shard_offset
                seg.param_shard[at : at + hi - lo].copy_(values)
                master.param[at : at + hi - lo].copy_(values)

    # -- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: str | None = None) -> str:
        """Every rank writes its part; returns the checkpoint directory."""
        return _checkpoint.save(self, save_dir, tag)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> str:
        """Load what `save_checkpoint` wrote (same stage; any world size)."""
        return _checkpoint.load(self, load_dir, tag)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (and buffers) that load into the plain model, on rank 0's
        host; the other ranks get an empty dict (DeepSpeed's
        `_zero3_consolidated_16bit_state_dict` gives them None). A collective: every rank
        calls it; gathered one segment at a time, so no other rank holds the model."""
        return _checkpoint.consolidated_state_dict(self)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's call: rank 0 writes the full weights in the compute dtype (fp32
        stays fp32) as a plain `state_dict`; a collective. Returns True where written.
        Rank 0 holds the model once, in the compute dtype; the other ranks never."""
        full = _checkpoint.consolidated_state_dict(self, dtype=self.dtype)
        if self.rank != 0:
            return False
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        torch.save(full, Path(save_dir) / save_filename)
        return True

    def _broadcast_initial_state(self, skip: set[int], max_numel: int) -> None:
        """Start every rank from rank 0's parameters and buffers (but those in `skip`:
        partitioned under zero.Init, where the ranks agree already). Small tensors of one
        dtype go together, concatenated in runs of at most `max_numel` elements
        (`reduce_bucket_size`); a larger one alone, in place: the transient is a bucket,
        not a second copy of the model."""
        if self.world_size == 1:
            return
        tensors = [t for t in [*self.module.parameters(), *self.module.buffers()]
                   if id(t) not in skip]  # fmt: skip
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for ts in by_dtype.values():
                run: list[torch.Tensor] = []
                for nxt in [*ts, None]:
                    full = nxt is None or sum(r.numel() for r in run) + nxt.numel() > max_numel
                    if run and full:
                        self._broadcast_run(run)
                        run = []
                    if nxt is not None:
                        run.append(nxt)

    def _broadcast_run(self, run: list[torch.Tensor]) -> None:
        if len(run) == 1 and run[0].is_contiguous():
            self.comm.broadcast(run[0].detach(), src=0)
            return
        flat = torch.cat([t.detach().reshape(-1) for t in run])
        self.comm.broadcast(flat, src=0)
        offset = 0
        for t in run:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def initialize(model: nn.Module | None = None, config: Any = None, model_parameters: Any = None,
               optimizer: Any = None, lr_scheduler: Any = None,
               **kwargs: Any) -> tuple[ZeroEngine, Any, None, Any]:  # fmt: skip
    """Build the engine: `deepspeed.initialize`'s call and return shape.

    Joins the torchrun job from the environment when torch.distributed is not initialised
    yet (gloo on CPU, NCCL with CUDA); a plain process runs as one rank.

    Returns:
        (engine, optimizer, None, lr_scheduler).
    """
    from zerowatch.config import load_config
    from zerowatch.engine.comm import init_distributed

    if model is None:
        raise ValueError("model: required")
    if config is None:
        config = kwargs.pop("config_params", None)
    if config is None:
        raise ValueError("config: required (a dict or a path to a DeepSpeed JSON file)")
    unknown = sorted(set(kwargs) - {"args", "training_data", "collate_fn", "dist_init_required"})
    if unknown:
        raise TypeError(f"initialize() got an unexpected keyword argument {unknown[0]!r}")
    init_distributed()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if not isinstance(config, ZeroWatchConfig):
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        hidden = hidden or getattr(model, "hidden_size", None) or getattr(model, "d_model", None)
        config = load_config(config, world_size=world, hidden_size=hidden)
    engine = ZeroEngine(model, config, model_parameters=model_parameters, optimizer=optimizer,
                        lr_scheduler=lr_scheduler)  # fmt: skip
    return engine, engine.optimizer, None, engine.lr_scheduler


__all__ = ["ZeroEngine", "initialize", "pick_device"]
