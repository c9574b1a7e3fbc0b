"""`zerowatch.instrument(accelerator)`: an Accelerate `Accelerator` after `prepare`.

Accelerate builds no engine of its own: `accelerator.prepare(model, optimizer, ...)` hands
back a DeepSpeed engine, an FSDP2 model, a DDP model or the model itself, and keeps them
(`accelerator._models`, `accelerator._optimizers`; for DDP the module it was given, not the wrapper, which is found
through the garbage collector's referrers). This module picks the adapter for what it built, so that an Accelerate job is recorded exactly like the same engine instrumented
by hand:

    a DeepSpeed engine      -> deepspeed.DeepSpeedAdapter
    an FSDP2 model          -> fsdp2.FSDP2Adapter, with the prepared optimizer
    DDP, or a plain module  -> ddp.DDPAdapter, with the prepared optimizer

The optimizer is the torch optimizer inside Accelerate's `AcceleratedOptimizer` (its step
hooks mark where each step ends). The Hugging Face Trainer prepares its model through an
`Accelerator` too; zerowatch.integrations.transformers instruments that one.
"""

from __future__ import annotations

from typing import Any

from zerowatch.agent.adapters.base import EngineAdapter, loaded_instance


def matches(obj: Any) -> bool:
    """An `accelerate.Accelerator` (checked only if accelerate is loaded)."""
    return loaded_instance(obj, "accelerate", "accelerate", "Accelerator")


def _torch_optimizer(prepared: Any) -> Any:
    """The torch optimizer inside an `AcceleratedOptimizer` (or the object itself)."""
    import torch

    inner = prepared
    # AcceleratedOptimizer is a torch Optimizer itself, but an empty shell around the real
    # one (its step hooks never fire): unwrap while a torch optimizer is inside.
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    return inner


def _ddp_around(module: Any) -> Any:
    """The `DistributedDataParallel` that `prepare` wrapped `module` in, or None.

    Accelerate keeps the model it was given, not the DDP wrapper it returned, and the
    adapter needs the wrapper (its communication hook). The wrapper holds the module in its
    `_modules`: found among the objects that refer to the module, two levels up (once, at
    instrument time).
    """
    import gc

    from torch.nn.parallel import DistributedDataParallel

    level = [module]
    for _ in range(3):
        up = [r for obj in level for r in gc.get_referrers(obj) if r is not level]
        for candidate in up:
            if isinstance(candidate, DistributedDataParallel) and candidate.module is module:
                return candidate
        level = [r for r in up if isinstance(r, dict)]
    return None


def adapter_for(model: Any, optimizer: Any) -> EngineAdapter:
    """The adapter for a prepared model and its (prepared) optimizer.

    Raises:
        TypeError: naming `optimizer` when a non-DeepSpeed model comes without one.
    """
    from zerowatch.agent.adapters import ddp, deepspeed, fsdp2

    if deepspeed.matches(model):
        return deepspeed.DeepSpeedAdapter(model)
    opt = _torch_optimizer(optimizer) if optimizer is not None else None
    if fsdp2.matches(model):
        return fsdp2.FSDP2Adapter(model, opt)
    return ddp.DDPAdapter(model, opt)


def accelerate_adapter(accelerator: Any, optimizer: Any = None) -> EngineAdapter:
    """The adapter for what `accelerator.prepare` built (the first model prepared).

    Args:
        accelerator: an `accelerate.Accelerator` whose `prepare` has run.
        optimizer: the optimizer stepping that model; default: the first one prepared.

    Raises:
        TypeError: naming `engine` when nothing was prepared yet, or `optimizer` when no
            optimizer was prepared for a model that needs one.
    """
    models = list(getattr(accelerator, "_models", None) or [])
    if not models:
        raise TypeError(
            "engine: this Accelerator has prepared no model yet: call "
            "zerowatch.instrument(accelerator) after accelerator.prepare(model, optimizer, ...)"
        )
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    model = engine if engine is not None else (_ddp_around(models[0]) or models[0])
    if optimizer is None:
        prepared = list(getattr(accelerator, "_optimizers", None) or [])
        optimizer = prepared[0] if prepared else None
    return adapter_for(model, optimizer)


__all__ = ["accelerate_adapter", "adapter_for", "matches"]
