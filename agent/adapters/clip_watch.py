"""See the gradient norm a script's own `torch.nn.utils.clip_grad_norm_` call computes.

FSDP2 computes no gradient norm of its own; scripts clip with
`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, which works on DTensor
gradients and returns the total norm (pre-clip). While a run is open that function is
replaced, in `torch.nn.utils` and in `torch.nn.utils.clip_grad` (the module it is defined
in; both names are the same function), by a wrapper that calls it unchanged and hands
`(total_norm, max_norm)` to whoever watches. Closing the last watcher puts the original
back, the way `dist_wrap` restores torch.distributed's collectives.

The wrapper adds no collective and no device synchronisation: it keeps the returned tensor.
`norm_value` reads it when the step's stats are taken. In torch 2.13 the total norm of
DTensor gradients comes back as a replicated DTensor (the user's call already all-reduced
it), whose local tensor is the norm; only a norm that is not replicated is gathered with
`full_tensor()`. On CUDA reading the norm waits for the device (`.item()`), once per step,
after the optimizer step.

Code that bound the function before the run began (`from torch.nn.utils import
clip_grad_norm_`) keeps calling the original and is not seen.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from zerowatch.agent.adapters.base import StepStats
from zerowatch.agent.adapters.zerowatch_engine import _finite_or_none

log = logging.getLogger("zerowatch.agent")

Watcher = Callable[[Any, Any], None]

_NAMESPACES = (torch.nn.utils, torch.nn.utils.clip_grad)
_NAME = "clip_grad_norm_"


class _Hub:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watchers: tuple[Watcher, ...] = ()
        #: namespace -> (original, wrapper)
        self.installed: dict[Any, tuple[Any, Any]] = {}
        self.errors = 0

    def wrap(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            total_norm = orig(*args, **kwargs)
            watchers = hub.watchers
            if watchers:
                try:
                    max_norm = args[1] if len(args) > 1 else kwargs["max_norm"]
                    for watcher in watchers:
                        watcher(total_norm, max_norm)
                except Exception:  # watching must never break training
                    hub.errors += 1
                    if hub.errors == 1:
                        log.exception("zerowatch: reading clip_grad_norm_ failed (not raised)")
            return total_norm

        clip_grad_norm_.__name__ = getattr(orig, "__name__", _NAME)
        clip_grad_norm_.__qualname__ = getattr(orig, "__qualname__", _NAME)
        clip_grad_norm_.__doc__ = getattr(orig, "__doc__", None)
        clip_grad_norm_.__wrapped__ = orig  # type: ignore[attr-defined]
        clip_grad_norm_.__zerowatch__ = True  # type: ignore[attr-defined]
        return clip_grad_norm_

    def install(self) -> None:
        made: dict[int, Any] = {}  # one wrapper per original, shared by both names
        for ns in _NAMESPACES:
            orig = getattr(ns, _NAME, None)
            if orig is None or getattr(orig, "__zerowatch__", False):
                continue
            wrapper = made.get(id(orig))
            if wrapper is None:
                wrapper = made[id(orig)] = self.wrap(orig)
            setattr(ns, _NAME, wrapper)
            self.installed[ns] = (orig, wrapper)

    def uninstall(self) -> None:
        for ns, (orig, wrapper) in self.installed.items():
            if getattr(ns, _NAME, None) is wrapper:
                setattr(ns, _NAME, orig)
            else:  # someone wrapped over us: leave theirs, ours passes through when idle
                log.warning("zerowatch: %s.%s was replaced while wrapped; leaving the "
                            "replacement in place", ns.__name__, _NAME)  # fmt: skip
        self.installed.clear()


_HUB = _Hub()


def watch(watcher: Watcher) -> None:
    """Call `watcher(total_norm, max_norm)` after every clip_grad_norm_ call, until
    `unwatch(watcher)`; the first watcher installs the wrapper."""
    with _HUB.lock:
        if not _HUB.watchers:
            _HUB.install()
        _HUB.watchers = (*_HUB.watchers, watcher)


def unwatch(watcher: Watcher) -> None:
    """Stop calling `watcher`; the last one gone puts the original function back."""
    with _HUB.lock:
        if watcher not in _HUB.watchers:
            return
        _HUB.watchers = tuple(w for w in _HUB.watchers if w != watcher)
        if not _HUB.watchers:
            _HUB.uninstall()


def installed() -> bool:
    """Whether the wrapper is in place now."""
    return bool(_HUB.installed)


def norm_value(total_norm: Any) -> float | None:
    """The total norm clip_grad_norm_ returned, as a float (None when it is not a number).

    A DTensor whose placements are all `Replicate` holds the norm on every rank already;
    any other DTensor (a partial norm) is gathered with `full_tensor()`."""
    if isinstance(total_norm, (int, float)):
        return float(total_norm)
    if not isinstance(total_norm, torch.Tensor):
        return None
    t = total_norm.detach()
    if type(t).__name__ == "DTensor":
        from torch.distributed.tensor import Replicate

        replicated = all(isinstance(p, Replicate) for p in t.placements)  # type: ignore[attr-defined]
        t = t.to_local() if replicated else t.full_tensor()  # type: ignore[attr-defined]
    if t.numel() != 1:
        return None
    return float(t.item())


def step_stats(optimizer: Any, clip: tuple[Any, float] | None) -> StepStats:
    """A step's learning rate (the optimizer's first group) and, where the script clipped,
    the norm `clip_grad_norm_` returned (`clip`: (total_norm, max_norm) of the step)."""
    groups = getattr(optimizer, "param_groups", None) or []
    lr = _finite_or_none(groups[0].get("lr")) if groups else None
    if clip is None:
        return StepStats(lr=lr)
    total_norm, max_norm = clip
    raw = norm_value(total_norm)
    norm = _finite_or_none(raw)
    return StepStats(
        grad_norm=norm,
        clipped=norm is not None and norm > max_norm,
        lr=lr,
        nonfinite=raw is not None and norm is None,
    )


__all__ = [
    "installed",
    "norm_value",
    "step_stats",
    "unwatch",
    "watch",
]
