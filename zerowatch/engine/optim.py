"""The sharded optimizer step: fp32 master shards, global-norm clipping, loss-scale skip.

The optimizer never sees the model's parameters. It sees one fp32 tensor per segment: the
master copy of the part of that segment this rank owns (the whole segment in stage 0).

* fp32 without offload: the master *is* the rank's part of the parameters (a view into
  the same storage), so nothing is copied and no extra memory is held.
* bf16/fp16, or any offload: the master is a separate fp32 copy (on the host with
  `offload_optimizer`, else on the device: with `offload_param` alone the parameter parts
  live on the host while the gradients and the optimizer live on the device), updated by
  the optimizer and copied back (cast) into the parameter part after the step.

One step:
  1. squared norm of every gradient part (one all-reduce of a scalar when parts are
     sharded), scaled by `grad_divisor` = loss_scale × what is left of N (the reducers
     leave sums over ranks of gradients divided before the sum, engine.py `predivide`);
  2. non-finite norm under fp16: skip the step (the scaler lowers the scale);
  3. gradients times 1/grad_divisor * min(1, clip / (norm + 1e-6)) (torch's
     clip_grad_norm_ coefficient), copied to the host first with `offload_optimizer`;
  4. `optimizer.step()` on the masters, then masters -> parameter parts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from zerowatch.config import ConfigError, OptimizerConfig
from zerowatch.engine.comm import Comm
from zerowatch.engine.flat import Segment
from zerowatch.engine.phases import Phases


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did (`engine.last_step`).

    Attributes:
        grad_norm: global gradient norm before clipping (unscaled); None if non-finite.
        clipped: the gradients were scaled down to `gradient_clipping`.
        loss_scale: the fp16 loss scale used for this step; None without fp16.
        skipped: the step was skipped (fp16 overflow).
        lr: learning rate of the first param group for this step.
        nonfinite: the gradients held inf or nan.
        local_grads: this rank's gradients before the reduction (forensics.py), read
            when asked; None when not collected.
    """

    grad_norm: float | None
    clipped: bool
    loss_scale: float | None
    skipped: bool
    lr: float
    nonfinite: bool
    local_grads: Any = None


class _Master:
    def __init__(self, seg: Segment, param: nn.Parameter, alias: bool,
                 host_grad: torch.Tensor | None) -> None:  # fmt: skip
        self.seg, self.param, self.alias, self.host_grad = seg, param, alias, host_grad


class MasterWeights:
    """fp32 master parts of every segment and the step that updates them.

    Args:
        segments: all segments (their `param_shard` and `grad_shard` are set).
        precision: "fp32", "bf16" or "fp16".
        offload: `offload_optimizer`: masters, fp32 gradients and optimizer state on host.
        params_on_host: the parameter parts themselves live on the host (stage 3
            `offload_param`), so copying masters back is not a host-to-device copy.
    """

    def __init__(self, segments: list[Segment], comm: Comm, phases: Phases, *, precision: str,
                 offload: bool, params_on_host: bool, device: torch.device) -> None:  # fmt: skip
        self.comm, self.phases, self.offload = comm, phases, offload
        self.params_on_host = params_on_host
        pin = offload and device.type == "cuda"
        self.masters: list[_Master] = []
        for seg in segments:
            # Parameter parts kept on the host (offload_param) cannot be the master the
            # optimizer steps on the device with the device's gradients.
            alias = precision == "fp32" and not offload and not seg.param_shard_on_host
            if alias:
                param = nn.Parameter(seg.param_shard)
                host_grad = None
            else:
                home = torch.device("cpu") if offload else device
                data = torch.empty(seg.shard_numel, dtype=torch.float32, device=home,
                                   pin_memory=pin)  # fmt: skip
                data.copy_(seg.param_shard)
                param = nn.Parameter(data)
                host_grad = (torch.zeros(seg.shard_numel, dtype=torch.float32, device=home,
                                         pin_memory=pin) if offload else None)  # fmt: skip
            self.masters.append(_Master(seg, param, alias, host_grad))

    def group_params(self, num_groups: int) -> list[list[nn.Parameter]]:
        out: list[list[nn.Parameter]] = [[] for _ in range(num_groups)]
        for m in self.masters:
            out[m.seg.group].append(m.param)
        return out

    # -- the step --------------------------------------------------------------------------

    def global_norm(self, grad_divisor: float) -> float:
        """Norm of the full (averaged, unscaled) gradient, across all ranks' parts."""
        dev = self.masters[0].seg.grad_shard.device if self.masters else torch.device("cpu")
        sharded = torch.zeros((), dtype=torch.float32, device=dev)
        replicated = torch.zeros((), dtype=torch.float32, device=dev)
        for m in self.masters:
            g = m.seg.grad_shard
            sq = torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
            if m.seg.sharded:
                sharded += sq
            else:
                replicated += sq
        if any(m.seg.sharded for m in self.masters):
            self.comm.all_reduce(sharded, purpose="other")
        return math.sqrt(float(sharded + replicated)) / grad_divisor

    def step(self, optimizer: Optimizer, *, grad_divisor: float, clip: float, skip_nonfinite: bool,
             loss_scale: float | None) -> StepStats:  # fmt: skip
        """Clip and apply the reduced gradients; see the module docstring."""
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else 0.0
        norm = self.global_norm(grad_divisor)
        finite = math.isfinite(norm)
        if not finite and skip_nonfinite:
            return StepStats(None, False, loss_scale, True, lr, True)
        clip_coef = 1.0
        if clip > 0 and finite:
            clip_coef = min(1.0, clip / (norm + 1e-6))
        coef = clip_coef / grad_divisor
        for m in self.masters:
            g = m.seg.grad_shard
            if m.alias:
                m.param.grad = g.mul_(coef)
            elif m.host_grad is not None:
                with self.phases.offload("d2h", g.numel() * g.element_size()):
                    m.host_grad.copy_(g)
                m.param.grad = m.host_grad.mul_(coef)
            else:
                m.param.grad = g.to(torch.float32).mul_(coef)
        optimizer.step()
        self.copy_to_params()
        for m in self.masters:
            if not m.alias:
                m.param.grad = None
        return StepStats(norm if finite else None, clip > 0 and finite and norm > clip,
                         loss_scale, False, lr, not finite)  # fmt: skip

    def copy_to_params(self) -> None:
        """Masters -> parameter parts (cast), where they are separate tensors."""
        for m in self.masters:
            if m.alias:
                continue
            dst = m.seg.param_shard
            with torch.no_grad():
                # Host masters to device parts (offload_optimizer), device masters to
                # host parts (offload_param alone), else no copy between memories.
                way = ("h2d" if self.offload and not self.params_on_host else
                       "d2h" if not self.offload and m.seg.param_shard_on_host else None)  # fmt: skip
                if way is None:
                    dst.copy_(m.param)
                else:
                    with self.phases.offload(way, dst.numel() * dst.element_size()):
                        dst.copy_(m.param)

    # -- memory ----------------------------------------------------------------------------

    def master_tensors(self) -> list[torch.Tensor]:
        return [m.param for m in self.masters if not m.alias]

    def host_grad_tensors(self) -> list[torch.Tensor]:
        return [m.host_grad for m in self.masters if m.host_grad is not None]


def state_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state (Adam: exp_avg, exp_avg_sq, step)."""
    return [
        v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    ]


#: DeepSpeed optimizer params that torch's Adam/AdamW take under the same name.
_TORCH_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "fused")
#: DeepSpeed-only params that are accepted and need no action here.
_IGNORED_KEYS = ("torch_adam", "adam_w_mode", "bias_correction", "max_grad_norm")


def build_optimizer(config: OptimizerConfig | None, passed: Any,
                    groups: list[dict[str, Any]]) -> Optimizer:  # fmt: skip
    """The torch optimizer over the master parts.

    Args:
        config: the `optimizer` config section (used when nothing is passed).
        passed: an Optimizer built on the model's parameters (its param groups are re-pointed
            at the masters, as DeepSpeed does), a callable taking param groups, or None.
        groups: [{"params": [masters...], **group options}], one per param group.
    """
    if isinstance(passed, Optimizer):
        if len(passed.param_groups) != len(groups):
            raise ValueError("optimizer: param groups do not match the model's parameters")
        for pg, g in zip(passed.param_groups, groups, strict=True):
            pg["params"] = g["params"]
        passed.state.clear()
        return passed
    if callable(passed):
        built = passed(groups)
        if not isinstance(built, Optimizer):
            raise TypeError(f"optimizer: the callable returned {type(built).__name__}, "
                            "expected a torch.optim.Optimizer")  # fmt: skip
        return built
    if config is None:
        raise ConfigError("optimizer: pass an optimizer to initialize() or configure one "
                         "under the `optimizer` key")  # fmt: skip
    kind = config.type.lower()
    params = dict(config.params)
    unknown = sorted(set(params) - set(_TORCH_KEYS) - set(_IGNORED_KEYS))
    if unknown:
        raise ConfigError(f"optimizer.params.{unknown[0]}: not supported for {config.type}")
    adam_w_mode = bool(params.get("adam_w_mode", True))
    kwargs = {k: v for k, v in params.items() if k in _TORCH_KEYS}
    kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's default (torch's AdamW says 0.01)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    cls: Callable[..., Optimizer]
    if kind == "adamw" or (kind == "adam" and adam_w_mode):
        cls = torch.optim.AdamW  # DeepSpeed's Adam is decoupled (AdamW) unless adam_w_mode off
    elif kind == "adam":
        cls = torch.optim.Adam
    else:
        raise ConfigError(f"optimizer.type: expected Adam or AdamW, got {config.type!r}")
    return cls(groups, **kwargs)


__all__ = ["MasterWeights", "StepStats", "build_optimizer", "state_tensors"]
