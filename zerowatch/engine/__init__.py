"""The bundled ZeRO engine (stages 0-3, CPU offload, bf16/fp16, DeepSpeed config).

Public API: `initialize` (what `zerowatch.initialize` calls), `ZeroEngine`, `StepStats`, and
the observer interface in `hooks` (`CollectiveRecord`, `ObserverRegistry`). Files, one
concept each: comm (the only caller of torch.distributed collectives), phases (the only
announcer of phase boundaries), flat (segments), params_replicated / params_sharded
(parameter owners), reducers (gradient reducers), stages (which parts make each stage),
optim (master weights and the step), precision (loss scaling), schedulers, checkpoint,
engine (the facade).
"""

from zerowatch.engine.engine import ZeroEngine, initialize
from zerowatch.engine.hooks import CollectiveRecord, CommObserver, ObserverRegistry, PhaseObserver
from zerowatch.engine.optim import StepStats

__all__ = [
    "CollectiveRecord",
    "CommObserver",
    "ObserverRegistry",
    "PhaseObserver",
    "StepStats",
    "ZeroEngine",
    "initialize",
]
