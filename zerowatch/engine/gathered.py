"""Whole parameters of a sharded model outside the training step: DeepSpeed's
`deepspeed.zero.GatheredParameters`, so that scripts run with `import zerowatch as deepspeed`.

    with zerowatch.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.fill_(0.0)     # e.g. re-initialise a layer mid-training

Inside the block the parameters are whole on every rank (stage 3 all-gathers their units;
the other stages hold them whole anyway). With `modifier_rank`, what that rank wrote is
broadcast when the block ends and becomes the training state everywhere: the parameters'
parts and the fp32 master weights the optimizer steps (DeepSpeed repartitions only the
parameter itself, so its optimizer keeps the old master values). Without it, changes are
dropped at stage 3 when the units are released. Only parameters an engine trains take part,
and those of a model built under `zerowatch.zero.Init` before `initialize` (whole inside,
back to their parts after, the modifier rank's values kept); buffers, frozen parameters and
other tensors are left as they are.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerowatch.engine import zero_init

if TYPE_CHECKING:  # pragma: no cover
    from zerowatch.engine.engine import ZeroEngine

#: Every live engine, to find the one that trains a given parameter.
_ENGINES: weakref.WeakSet[ZeroEngine] = weakref.WeakSet()


def register(engine: ZeroEngine) -> None:
    _ENGINES.add(engine)


def unregister(engine: ZeroEngine) -> None:
    _ENGINES.discard(engine)


def engines_over(module: nn.Module) -> list[ZeroEngine]:
    """The live engines that train `module` (an earlier wrap of the same model)."""
    return [e for e in list(_ENGINES) if e.module is module]


def _by_engine(params: list[nn.Parameter]) -> list[tuple[ZeroEngine, list[nn.Parameter]]]:
    out: list[tuple[ZeroEngine, list[nn.Parameter]]] = []
    for engine in list(_ENGINES):
        index = engine.slot_index()
        mine = [p for p in params if id(p) in index]
        if mine:
            out.append((engine, mine))
    return out


class GatheredParameters:
    """Context manager: `params` whole on every rank inside; see the module docstring.

    Args:
        params: a parameter or an iterable of them (None entries are skipped).
        modifier_rank: the rank whose changes are kept (broadcast to all), or None.
        fwd_module: accepted for DeepSpeed's signature; not needed here.
        enabled: False makes the block a no-op.
    """

    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter | None],
                 modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:  # fmt: skip
        del fwd_module
        items = [params] if isinstance(params, torch.Tensor) else list(params)
        self.params: list[nn.Parameter] = [p for p in items if isinstance(p, torch.Tensor)]  # type: ignore[misc]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._held: list[tuple[ZeroEngine, list[nn.Parameter], Any]] = []
        self._built: list[nn.Parameter] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        # Parameters of a model built under zero.Init that no engine has adopted yet.
        self._built = zero_init.hold_whole(self.params)
        for engine, params in _by_engine(self.params):
            self._held.append((engine, params, engine.hold_whole(params)))

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        built, self._built = self._built, []
        zero_init.release_whole(built, self.modifier_rank if exc_type is None else None)
        held, self._held = self._held, []
        for engine, params, token in held:
            try:
                if self.modifier_rank is not None and exc_type is None:
                    engine.take_changes(params, self.modifier_rank)
            finally:
                engine.release_whole(token)


__all__ = ["GatheredParameters", "register"]
