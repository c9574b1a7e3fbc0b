"""The bundled ZeRO engine (stages 0-3, CPU offload, bf16/fp16, DeepSpeed config).

Public API: `initialize` (what `zerowatch.initialize` calls), `ZeroEngine`, `StepStats`, and
the observer interface in `hooks` (`CollectiveRecord`, `ObserverRegistry`). Files, one
concept each: launch (where this process sits in the job: rank, local rank, its GPU, from
torchrun's, Open MPI's or SLURM's variables), comm (the only caller of torch.distributed
collectives), phases (the only announcer of phase boundaries), flat (segments),
params_replicated / params_sharded (parameter owners), reducers (gradient reducers), stages
(which parts make each stage), optim (master weights and the step), precision (loss
scaling), schedulers, checkpoint, zero_init (zero.Init: a model built partitioned, and
full weights loaded one slice per rank), gathered (zero.GatheredParameters), engine (the
facade). What the doctor measures of a job beyond its steps lives outside the engine
(zerowatch/rehearse, run by the agent when it attaches).

Importing this package imports nothing of the engine: the names below load on first use
(module `__getattr__`), so that `zerowatch.engine.hooks`, the observer interface the agent's
DeepSpeed and FSDP2 adapters speak, comes without the engine and its torch modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from zerowatch.engine.engine import ZeroEngine, initialize
    from zerowatch.engine.hooks import (
        CollectiveRecord,
        CommObserver,
        ObserverRegistry,
        PhaseObserver,
    )
    from zerowatch.engine.optim import StepStats

#: Public name -> the module of this package that defines it.
_HOME = {
    "CollectiveRecord": "hooks",
    "CommObserver": "hooks",
    "ObserverRegistry": "hooks",
    "PhaseObserver": "hooks",
    "StepStats": "optim",
    "ZeroEngine": "engine",
    "initialize": "engine",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'zerowatch.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zerowatch.engine.{home}"), name)


__all__ = [
    "CollectiveRecord",
    "CommObserver",
    "ObserverRegistry",
    "PhaseObserver",
    "StepStats",
    "ZeroEngine",
    "initialize",
]
