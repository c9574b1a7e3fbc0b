"""Precision policy and loss scaling.

fp32 trains the fp32 parameters directly. bf16 and fp16 run the module in 16 bits and keep
fp32 master weights in the optimizer (see optim.py). fp16 also scales the loss so small
gradients survive, with DeepSpeed's dynamic loss scaler:

* the scale starts at 2**initial_scale_power;
* a step whose gradients overflow (inf/nan) is skipped; after `hysteresis` overflows in a
  row the scale halves (never below `min_loss_scale`);
* after `loss_scale_window` overflow-free steps the scale doubles.

`loss_scale` > 0 in the config fixes the scale (static). Off (fp32, bf16) is `NoScaler`, a
do-nothing object with scale 1.
"""

from __future__ import annotations

from typing import Any

import torch

from zerowatch.config import FP16Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class NoScaler:
    """No loss scaling (fp32, bf16)."""

    scale = 1.0
    reported: float | None = None

    def update(self, overflow: bool) -> None:
        return

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        return


class StaticScaler(NoScaler):
    """A fixed loss scale (fp16 `loss_scale` > 0)."""

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    @property
    def reported(self) -> float | None:  # type: ignore[override]
        return self.scale


class DynamicScaler(NoScaler):
    """DeepSpeed's DynamicLossScaler (fp16 `loss_scale` == 0)."""

    def __init__(self, *, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0,
                 consecutive_hysteresis: bool = False) -> None:  # fmt: skip
        self.scale = float(2**initial_scale_power)
        self.window = int(loss_scale_window)
        self.delayed_shift = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.min_scale = float(min_loss_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def reported(self) -> float | None:  # type: ignore[override]
        return self.scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:  # hysteresis counts overflows in a row only
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis,
                "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter}  # fmt: skip

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = sd["scale"]
        self.cur_hysteresis = sd["cur_hysteresis"]
        self.cur_iter = sd["cur_iter"]
        self.last_overflow_iter = sd["last_overflow_iter"]


def make_scaler(precision: str, fp16: FP16Config) -> NoScaler:
    """The loss scaler for a precision and the fp16 config section."""
    if precision != "fp16":
        return NoScaler()
    if fp16.loss_scale and fp16.loss_scale > 0:
        return StaticScaler(fp16.loss_scale)
    return DynamicScaler(initial_scale_power=fp16.initial_scale_power,
                         loss_scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                         min_loss_scale=fp16.min_loss_scale,
                         consecutive_hysteresis=getattr(fp16, "consecutive_hysteresis", False))  # fmt: skip


__all__ = ["DTYPES", "DynamicScaler", "NoScaler", "StaticScaler", "make_scaler"]
