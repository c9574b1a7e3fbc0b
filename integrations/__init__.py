"""zerowatch where people already train: callbacks for the Hugging Face Trainer and for
Lightning's Trainer (`zerowatch.integrations.transformers`, `zerowatch.integrations.lightning`).

Each module imports its library (install `zerowatch[transformers]` or `zerowatch[lightning]`);
this package and `import zerowatch` import none of them. An Accelerate `Accelerator` needs no
callback: `zerowatch.instrument(accelerator)` after `prepare` (agent/adapters/accelerate.py).
"""

from __future__ import annotations

__all__: list[str] = []
