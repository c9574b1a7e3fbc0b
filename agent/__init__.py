"""zerowatch.agent: the in-process agent. `instrument(engine)` measures every step on every
rank and ships it to the server (or to a local spool) without ever holding up training.

    measure  probes/      phase timer, collective aggregator, offload, memory, clocks
    model    recorder.py  one step's measurements -> events.StepEvent; flops.py (MFU)
    ship     transport.py background shipper; client.py the HTTP ingest client
    store    spool.py     durable on-disk spool; upload.py sends a spool later
    seam     adapters/    one small Protocol, one file per engine: the bundled ZeRO engine,
                          DeepSpeed, FSDP2 (picked by `instrument()` from what it is given)

Importing this package does not import torch; `instrument` does, lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from zerowatch.agent.config import AgentConfig
    from zerowatch.agent.run import Run
    from zerowatch.agent.upload import UploadResult


def instrument(engine: Any, **kwargs: Any) -> Run:
    """Attach the agent to `engine`; see `zerowatch.agent.attach.instrument`."""
    from zerowatch.agent.attach import instrument as _instrument

    return _instrument(engine, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Run":
        from zerowatch.agent.run import Run

        return Run
    if name == "AgentConfig":
        from zerowatch.agent.config import AgentConfig

        return AgentConfig
    if name == "UploadResult":
        from zerowatch.agent.upload import UploadResult

        return UploadResult
    raise AttributeError(f"module 'zerowatch.agent' has no attribute {name!r}")


__all__ = ["AgentConfig", "Run", "UploadResult", "instrument"]
