"""Replicated parameters (stages 0-2, and stage 3's persistent parameters).

Every rank holds every parameter, in one flat buffer per segment; each `nn.Parameter`'s data
is a view into it, so the module runs unchanged. With sharded segments (stages 1-2) the
optimizer updates only this rank's part (`segment.param_shard`, a view into the same
buffer) and `after_step` all-gathers the parts back into the full buffer, in place.
"""

from __future__ import annotations

import torch

from zerowatch.engine.comm import Comm
from zerowatch.engine.flat import Segment
from zerowatch.engine.phases import Phases


class ReplicatedParams:
    """Owns the full parameters of `segments` as views into one flat buffer."""

    def __init__(self, segments: list[Segment], comm: Comm, phases: Phases, *,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        self.segments, self.comm, self.phases = segments, comm, phases
        self.flat_param = torch.empty(sum(s.padded for s in segments), device=device, dtype=dtype)
        self._flat: dict[int, torch.Tensor] = {}
        base = 0
        for seg in segments:
            flat = self.flat_param.narrow(0, base, seg.padded)
            base += seg.padded
            self._flat[seg.index] = flat
            with torch.no_grad():
                seg.flatten_into(flat, [s.param.data for s in seg.slots])
            for s, view in zip(seg.slots, seg.views(flat), strict=True):
                s.param.data = view
            seg.param_shard = seg.shard_of(flat)

    def full(self, seg: Segment) -> torch.Tensor:
        """The segment's full (padded) flat parameters."""
        return self._flat[seg.index]

    def begin_pass(self, mode: str) -> None:
        return

    def end_pass(self, mode: str) -> None:
        return

    def after_step(self) -> None:
        """Stages 1-2: all-gather the updated parts into every rank's full buffer."""
        sharded = [seg for seg in self.segments if seg.sharded]
        if not sharded:
            return
        with self.phases.phase("param_gather"):
            handles = [self.comm.all_gather(self._flat[seg.index], seg.param_shard,
                                            purpose="optimizer_gather", async_op=True)
                       for seg in sharded]  # fmt: skip
            for h in handles:
                h.wait()

    def param_tensors(self) -> list[torch.Tensor]:
        return [self.flat_param]

    def remove_hooks(self) -> None:
        """Nothing to take off: replicated parameters need no hooks on the model."""


__all__ = ["ReplicatedParams"]
