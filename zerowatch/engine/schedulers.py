"""DeepSpeed's learning-rate schedules, with DeepSpeed's parameter names.

`WarmupLR`: from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps` (log or linear),
then constant. `WarmupDecayLR`: the same warm-up, then linear decay to 0 at
`total_num_steps`. `WarmupCosineLR`: ratios of the optimizer's own lr: from
`warmup_min_ratio` to 1 over the warm-up, then a cosine down to `cos_min_ratio`.

The engine calls `step()` after every optimizer step that was not skipped (as DeepSpeed
does). Like DeepSpeed's, a new scheduler sets the lr for iteration -1 (the minimum).
"""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer

from zerowatch.config import ConfigError

WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ConfigError(f"scheduler.params.{name}: expected {len(optimizer.param_groups)} "
                             f"values (one per param group), got {len(value)}")  # fmt: skip
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


class _Schedule:
    """Shared machinery: `last_batch_iteration`, `step`, state dicts."""

    def __init__(self, optimizer: Optimizer, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int) -> None:  # fmt: skip
        if warmup_type not in WARMUP_TYPES:
            raise ConfigError(f"scheduler.params.warmup_type: expected one of {WARMUP_TYPES}, "
                             f"got {warmup_type!r}")  # fmt: skip
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []

    def _warmup_fraction(self) -> float:
        it = self.last_batch_iteration
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._apply()


class WarmupLR(_Schedule):
    def __init__(self, optimizer: Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:  # fmt: skip
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self._apply()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + d * g for lo, d in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:  # fmt: skip
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)  # fmt: skip

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:  # fmt: skip
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._apply()

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            r = self._warmup_fraction()
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        real_last = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total = max(1, self.total_num_steps - self.warmup_num_steps)
        r = (1 + math.cos(math.pi * real_last / real_total)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * r)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(kind: str, optimizer: Optimizer, params: dict[str, Any]) -> _Schedule:
    """The DeepSpeed `scheduler` config section as a scheduler on `optimizer`."""
    cls = SCHEDULERS.get(kind)
    if cls is None:
        raise ConfigError(f"scheduler.type: expected one of {sorted(SCHEDULERS)}, got {kind!r}")
    try:
        return cls(optimizer, **params)
    except TypeError as e:
        raise ConfigError(f"scheduler.params: {e}") from e


__all__ = ["SCHEDULERS", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]
