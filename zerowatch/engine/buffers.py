"""Flat buffers reused within a pass: stage 3's gathered units and staged gradients.

Stage 3 needs a full-size flat buffer for every unit it gathers (twice per micro-batch) and
for every unit whose gradients it reduce-scatters, each for a short while. Allocating them
afresh costs more than the copy into them on the CPU: a buffer of a few MiB comes from a new
mapping, and touching it page-faults every page (measured here: a quarter of a 4-block GPT's
stage-3 step went to `torch.empty`). The pool keeps the buffers a pass gave back and hands
them out again by size, so a pass allocates only as many as it holds at once.

A buffer is taken back only if nothing else refers to its storage: a module may have saved
a view of a gathered weight for its backward (`x @ w.T` saves the transposed view), and
that view must keep the old values, so such a buffer is left to be freed when the view
goes. The owner clears the pool at the end of a backward, so between steps the engine holds
no more than its model states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The count of references to a storage (tensors and views on it); None on an older torch,
#: where nothing is reused.
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    return int(_use_count(t.untyped_storage()._cdata)) if _use_count is not None else -1


#: What a storage referred to by one tensor alone reports (the temporary storage object
#: that asks counts too).
_ALONE = _storage_refs(torch.empty(1)) if _use_count is not None else -2


class BufferPool:
    """Flat tensors of one device and dtype, handed out by element count.

    Args:
        device: where the buffers live.
        dtype: their element type.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, numel: int) -> torch.Tensor:
        """A flat buffer of `numel` elements (contents undefined)."""
        free = self._free.get(numel)
        if free:
            return free.pop()
        return torch.empty(numel, device=self.device, dtype=self.dtype)

    def give(self, t: torch.Tensor) -> None:
        """Take `t` back for reuse, unless a view of it is still alive elsewhere. The
        caller drops its own views (parameters' `.data`) first."""
        if t.is_contiguous() and t.storage_offset() == 0 and _storage_refs(t) == _ALONE:
            self._free.setdefault(t.numel(), []).append(t)

    def clear(self) -> None:
        """Let every held buffer go (the end of a backward)."""
        self._free.clear()

    def held_numel(self) -> int:
        return sum(t.numel() for ts in self._free.values() for t in ts)


__all__ = ["BufferPool"]
