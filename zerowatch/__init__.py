"""zerowatch: see what ZeRO-sharded training does, step by step.

The public face. `initialize` builds the bundled ZeRO engine (DeepSpeed-compatible: change
`deepspeed.initialize` to `zerowatch.initialize`), `instrument` attaches the in-process agent
to an engine (the bundled one, DeepSpeed's, or an FSDP2 model). Both are imported lazily so
that `import zerowatch` (and the server) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerowatch.config import ConfigError

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from zerowatch.agent import Run
    from zerowatch.engine import ZeroEngine


def initialize(
    model: Any = None,
    config: Any = None,
    model_parameters: Any = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    **kwargs: Any,
) -> tuple[ZeroEngine, Any, Any, Any]:
    """Build the bundled ZeRO engine; same call and return shape as `deepspeed.initialize`.

    Returns:
        (engine, optimizer, None, lr_scheduler), as DeepSpeed does (its third item is the
        training dataloader, which zerowatch does not build).
    """
    from zerowatch.engine import initialize as _initialize

    return _initialize(
        model=model,
        config=config,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        **kwargs,
    )


def instrument(engine: Any, **kwargs: Any) -> Run:
    """Attach the in-process agent to `engine`; see `zerowatch.agent.instrument`."""
    from zerowatch.agent import instrument as _instrument

    return _instrument(engine, **kwargs)


def init_distributed(*_: Any, **__: Any) -> None:
    """DeepSpeed's `init_distributed`: join the job from torchrun's environment, NCCL with
    CUDA and gloo without, whatever backend is named (`initialize` does this by itself)."""
    from zerowatch.engine.comm import init_distributed as _init

    _init()


def __getattr__(name: str) -> Any:
    # `zerowatch.zero` imports torch: only when a script asks for it (DeepSpeed's
    # `deepspeed.zero.GatheredParameters` after `import zerowatch as deepspeed`).
    if name == "zero":
        import importlib

        return importlib.import_module("zerowatch.zero")
    raise AttributeError(f"module 'zerowatch' has no attribute {name!r}")


__all__ = ["ConfigError", "__version__", "init_distributed", "initialize", "instrument"]
