"""A live bundled engine's layout inputs, on stand-in parameters.

Counting a stage's calls (counts.py) and rehearsing its path (paths.py) lay every stage out
with the engine's own functions (`flat.bucket`, `stages.stage3_units`), which read each
parameter's shape. A stage-3 engine's parameters hold empty tensors between uses, so the
layouts here are made of stand-ins: for each trained parameter, a parameter of its shape
over one element (a zero-stride view, no memory), in the same order and param group. The
shapes come from the engine's segments (`Slot.shape`), which cover every trained parameter
at every stage. The rehearsal points the stand-ins at its buffers as stage 3 points the
real ones; the engine's own parameters are never touched.

Stage 3's units are found on the engine's module tree, which holds the real parameters:
`sharded()` keys the stand-ins by the real parameter's id, and `real_id` maps a stand-in
back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerowatch.config import ZeroConfig
from zerowatch.engine.flat import Segment
from zerowatch.engine.stages import ParamList, stage3_units


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What every stage of one job is laid out from."""

    module: nn.Module
    #: (name, stand-in, param group), in the engine's order (the model's).
    params: ParamList
    #: id(stand-in) -> id(the trained parameter it stands for).
    real_ids: dict[int, int]
    zc: ZeroConfig
    world_size: int
    rank: int
    gradient_accumulation_steps: int
    device: torch.device
    dtype: torch.dtype

    def real_id(self, standin: nn.Parameter) -> int:
        return self.real_ids[id(standin)]

    def sharded(self) -> dict[int, tuple[str, nn.Parameter, int]]:
        """id(real parameter) -> its stand-in's entry, for the parameters stage 3 shards
        (at least `stage3_param_persistence_threshold` elements)."""
        threshold = int(self.zc.stage3_param_persistence_threshold)
        return {self.real_id(t[1]): t for t in self.params if t[1].numel() >= threshold}

    def persistent(self) -> ParamList:
        """The parameters stage 3 keeps whole on every rank (below the threshold)."""
        threshold = int(self.zc.stage3_param_persistence_threshold)
        return [t for t in self.params if t[1].numel() < threshold]

    def stage3_units(self, max_numel: int, rank: int) -> tuple[list[Segment], list[nn.Module]]:
        """Stage 3's units (stand-in slots) and their roots, with buckets of `max_numel`."""
        return stage3_units(self.module, self.sharded(), self.world_size, rank,
                            max_numel=max_numel)  # fmt: skip


def standin(shape: torch.Size, dtype: torch.dtype) -> nn.Parameter:
    """A parameter of `shape` that holds one element (every index reads it)."""
    return nn.Parameter(torch.zeros((), dtype=dtype).expand(shape), requires_grad=False)


def of_params(module: nn.Module, trained: ParamList, zc: ZeroConfig, *, world_size: int,
              rank: int, gradient_accumulation_steps: int, device: torch.device,
              dtype: torch.dtype, shapes: dict[int, torch.Size] | None = None) -> Layout:  # fmt: skip
    """The layout of `trained` ((name, parameter, group) of `module`, in its order), with
    each parameter's shape from `shapes` (by id; default: its own)."""
    params: ParamList = []
    real_ids: dict[int, int] = {}
    for name, p, group in trained:
        stand = standin(shapes[id(p)] if shapes is not None else p.shape, dtype)
        params.append((name, stand, group))
        real_ids[id(stand)] = id(p)
    return Layout(module=module, params=params, real_ids=real_ids, zc=zc,
                  world_size=world_size, rank=rank,
                  gradient_accumulation_steps=gradient_accumulation_steps,
                  device=device, dtype=dtype)  # fmt: skip


def of_engine(engine: Any) -> Layout | None:
    """The layout of a bundled engine (`zerowatch.engine.ZeroEngine`), its shapes from its
    segments; None for an object without them (an engine shaped like it)."""
    trained = getattr(engine, "trained_params", None)
    parts = getattr(engine, "parts", None)
    config = getattr(engine, "config", None)
    if trained is None or parts is None or config is None:
        return None
    shapes = {id(s.param): s.shape for seg in parts.segments for s in seg.slots}
    return of_params(engine.module, trained, config.zero_optimization,
                     world_size=int(engine.world_size), rank=int(engine.rank),
                     gradient_accumulation_steps=int(engine.gradient_accumulation_steps),
                     device=engine.device, dtype=engine.dtype, shapes=shapes)  # fmt: skip


__all__ = ["Layout", "of_engine", "of_params", "standin"]
