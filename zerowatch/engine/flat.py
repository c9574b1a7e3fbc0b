"""Flat segments: how parameters are laid out for communication and sharding.

A `Segment` is a run of parameters of one optimizer param group, laid out back to back in
one flat buffer and padded so that it splits into `shards` equal parts; rank r owns part r:

    flat   [ p0 ........ | p1 ..... | p2 ... | pad ]     numel padded to a multiple of N
    shards [   rank 0     |   rank 1  |  ...  | rank N-1]

Stages 0-2 cut the model's parameters into segments of at most `reduce_bucket_size`
elements (the communication buckets); stage 3 makes one segment per submodule (the unit it
gathers before that submodule runs). Stage 0 uses one shard per segment (every rank owns
everything).

The parameter owner gives each segment its `param_shard` (the compute-dtype values this
rank owns) and the gradient reducer its `grad_shard` (the reduced gradient of that part);
the optimizer keeps fp32 master copies of the shards. Nothing is attached to the
`nn.Parameter` objects themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(eq=False)
class Slot:
    """Where one parameter lives in its segment's flat buffer."""

    param: nn.Parameter
    name: str
    offset: int
    numel: int
    shape: torch.Size


class Segment:
    """A padded flat run of parameters, split into `shards` equal parts.

    Args:
        index: position among the engine's segments (collectives run in this order).
        params: (name, parameter) pairs in layout order.
        group: index of the optimizer param group they all belong to.
        shards: parts the flat buffer splits into (N, or 1 when every rank owns all).
        rank: which part this rank owns.
    """

    def __init__(self, index: int, params: list[tuple[str, nn.Parameter]], group: int,
                 shards: int, rank: int) -> None:  # fmt: skip
        self.index = index
        self.group = group
        self.shards = shards
        self.rank = rank if shards > 1 else 0
        self.slots: list[Slot] = []
        offset = 0
        for name, p in params:
            self.slots.append(Slot(p, name, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel = offset
        self.padded = math.ceil(offset / shards) * shards if offset else 0
        self.shard_numel = self.padded // shards
        self.shard_offset = self.rank * self.shard_numel
        # Filled in by the owner and the reducer.
        self.param_shard: torch.Tensor = torch.empty(0)
        self.grad_shard: torch.Tensor = torch.empty(0)
        #: The owner keeps `param_shard` in host memory (stage 3's offload_param).
        self.param_shard_on_host = False

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of a padded flat buffer of this segment."""
        return flat.narrow(0, self.shard_offset, self.shard_numel)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view (its own shape) into a flat buffer of this segment."""
        return [flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    def flatten_into(self, flat: torch.Tensor, tensors: list[torch.Tensor | None]) -> None:
        """Copy per-parameter tensors (None: zeros) into `flat`, padding zeroed."""
        for s, t in zip(self.slots, tensors, strict=True):
            dst = flat.narrow(0, s.offset, s.numel)
            if t is None:
                dst.zero_()
            else:
                dst.copy_(t.reshape(-1))
        if self.padded > self.numel:
            flat.narrow(0, self.numel, self.padded - self.numel).zero_()

    def __repr__(self) -> str:
        return (f"Segment({self.index}, params={len(self.slots)}, numel={self.numel}, "
                f"shards={self.shards})")  # fmt: skip


def bucket(params: list[tuple[str, nn.Parameter, int]], max_numel: int, shards: int,
           rank: int, start_index: int = 0) -> list[Segment]:  # fmt: skip
    """Cut (name, param, group) triples, in order, into segments of at most `max_numel`
    elements (a larger parameter gets a segment of its own) that never mix param groups."""
    segments: list[Segment] = []
    run: list[tuple[str, nn.Parameter]] = []
    run_group, run_numel = -1, 0
    for name, p, group in params:
        if run and (group != run_group or run_numel + p.numel() > max_numel):
            segments.append(Segment(start_index + len(segments), run, run_group, shards, rank))
            run, run_numel = [], 0
        run.append((name, p))
        run_group = group
        run_numel += p.numel()
    if run:
        segments.append(Segment(start_index + len(segments), run, run_group, shards, rank))
    return segments


__all__ = ["Segment", "Slot", "bucket"]
