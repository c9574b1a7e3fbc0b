"""Engine adapters: `select_adapter(obj)` picks the one that understands `obj`.

One file per engine; each exposes `matches(obj) -> bool` and an adapter class satisfying
`EngineAdapter`. DeepSpeed and FSDP2 adapters slot in here as `deepspeed.py` and
`fsdp2.py` (tried before the bundled engine's duck-typed match).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerowatch.agent.adapters import zerowatch_engine
from zerowatch.agent.adapters.base import EngineAdapter, JobInfo, StepStats

#: (name, matches, adapter class), tried in order.
ADAPTERS: list[tuple[str, Callable[[Any], bool], Callable[[Any], EngineAdapter]]] = [
    ("zerowatch", zerowatch_engine.matches, zerowatch_engine.ZeroWatchEngineAdapter),
]


def select_adapter(obj: Any) -> EngineAdapter:
    """The adapter for `obj` (an adapter passes through as-is).

    Raises:
        TypeError: naming the type when no adapter understands `obj`.
    """
    if isinstance(obj, EngineAdapter):
        return obj
    for _name, matches, factory in ADAPTERS:
        if matches(obj):
            return factory(obj)
    known = ", ".join(name for name, _, _ in ADAPTERS)
    raise TypeError(
        f"engine: zerowatch.instrument() does not know how to instrument a "
        f"{type(obj).__module__}.{type(obj).__qualname__}; supported: {known} "
        f"(the engine returned by zerowatch.initialize)"
    )


__all__ = ["ADAPTERS", "EngineAdapter", "JobInfo", "StepStats", "select_adapter"]
