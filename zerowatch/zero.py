"""The `deepspeed.zero` names that training scripts use, for `import zerowatch as deepspeed`:
`GatheredParameters` (whole parameters outside the step, see zerowatch/engine/gathered.py)
and `Init` (accepted; zerowatch shards the model in `initialize`). Imports torch."""

from __future__ import annotations

from zerowatch.engine.gathered import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
