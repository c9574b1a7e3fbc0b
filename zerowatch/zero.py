"""The `deepspeed.zero` names that training scripts use, for `import zerowatch as deepspeed`:
`GatheredParameters` (whole parameters outside the step, see zerowatch/engine/gathered.py),
`Init` (build the model partitioned, see zerowatch/engine/zero_init.py) and
`load_full_state_dict` (full weights into a running engine, one slice per rank). Imports
torch."""

from __future__ import annotations

from zerowatch.engine.gathered import GatheredParameters
from zerowatch.engine.zero_init import Init, load_full_state_dict

__all__ = ["GatheredParameters", "Init", "load_full_state_dict"]
