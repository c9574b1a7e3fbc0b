"""Engine adapters: `select_adapter(obj)` picks the one that understands `obj`.

One file per engine, each exposing `matches(obj) -> bool` and an adapter class satisfying
`EngineAdapter` (base.py): `zerowatch_engine.py` (the bundled engine, which reports its own
phases and collectives), `deepspeed.py`, `fsdp2.py` and `ddp.py` (tried first, before the
bundled engine's duck-typed match; they hook the engine's public surface, share
`foreign.py`, and see collectives through `dist_wrap.py`), and `accelerate.py`, which hands
an Accelerate `Accelerator` to the adapter of what its `prepare` built. These import torch
and load on first use; none of them loads the bundled engine (only its observer interface,
zerowatch.engine.hooks).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from zerowatch.agent.adapters import zerowatch_engine
from zerowatch.agent.adapters.base import EngineAdapter, JobInfo, StepStats


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """`zerowatch.agent.adapters.<module>.<name>`, imported on first call (they need torch)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        target = getattr(importlib.import_module(f"zerowatch.agent.adapters.{module}"), name)
        return target(*args, **kwargs)

    return call


#: (name, matches, adapter class), tried in order.
ADAPTERS: list[tuple[str, Callable[[Any], bool], Callable[..., EngineAdapter]]] = [
    ("deepspeed", _lazy("deepspeed", "matches"), _lazy("deepspeed", "DeepSpeedAdapter")),
    ("fsdp2", _lazy("fsdp2", "matches"), _lazy("fsdp2", "FSDP2Adapter")),
    ("ddp", _lazy("ddp", "matches"), _lazy("ddp", "DDPAdapter")),
    ("accelerate", _lazy("accelerate", "matches"), _lazy("accelerate", "accelerate_adapter")),
    ("zerowatch", zerowatch_engine.matches, zerowatch_engine.ZeroWatchEngineAdapter),
]

#: Keyword options of `instrument()` that go to an adapter, by adapter name.
ADAPTER_OPTIONS: dict[str, tuple[str, ...]] = {
    "fsdp2": ("optimizer",),
    "ddp": ("optimizer",),
    "accelerate": ("optimizer",),
}


def select_adapter(obj: Any, **options: Any) -> EngineAdapter:
    """The adapter for `obj` (an adapter passes through as-is).

    Args:
        obj: the engine (or FSDP2 root module) given to `instrument()`.
        **options: adapter options from `instrument()` (`optimizer=` for FSDP2 and DDP,
            and to pick another than the first one an Accelerator prepared).

    Raises:
        TypeError: naming the type when no adapter understands `obj`, or naming an
            option the matching adapter does not take.
    """
    if isinstance(obj, EngineAdapter):
        return obj
    for name, matches, factory in ADAPTERS:
        if matches(obj):
            taken = ADAPTER_OPTIONS.get(name, ())
            for key, value in options.items():
                if key not in taken and value is not None:
                    raise TypeError(f"{key}: a {name} engine takes no {key}= in instrument()")
            return factory(obj, **{k: v for k, v in options.items() if k in taken})
    known = ", ".join(name for name, _, _ in ADAPTERS)
    raise TypeError(
        f"engine: zerowatch.instrument() does not know how to instrument a "
        f"{type(obj).__module__}.{type(obj).__qualname__}; supported: {known} "
        f"(the engine returned by zerowatch.initialize or deepspeed.initialize, a model "
        f"wrapped by torch.distributed.fsdp.fully_shard or DistributedDataParallel, or an "
        f"accelerate.Accelerator after prepare)"
    )


__all__ = ["ADAPTERS", "ADAPTER_OPTIONS", "EngineAdapter", "JobInfo", "StepStats", "select_adapter"]
