"""Gradient reducers: how each stage turns per-rank gradients into reduced gradient shards.

Two strategies, picked by the stage (composition, not flags):

* `BoundaryReducer` (stages 0 and 1; stage 3's persistent parameters). Gradients accumulate
  locally, across micro-batches, in one persistent flat buffer (each `param.grad` is a view
  into it). On the micro-batch that ends an accumulation cycle, each bucket is reduced as
  soon as all its gradients are in, while the rest of backward runs: stage 0 all-reduces
  the bucket (every rank keeps the full sum), stage 1 reduce-scatters it in place (rank r
  keeps the sum of its part r). Communication: once per optimizer step.

* `MicroBatchReducer` (stage 2, and stage 3's sharded units). No full gradient is kept:
  after every micro-batch, each segment's gradients are copied into a staging buffer as soon
  as they are all in, reduce-scattered, and the staging buffer and the `param.grad` tensors
  are dropped; rank r accumulates the sum of its part r in a gradient shard.
  Communication: every micro-batch.

With `overlap_comm` the collectives are issued asynchronously (gloo and NCCL both run them
on their own threads/streams) and waited for at the end of backward; otherwise each runs
synchronously inside backward. Both reducers leave *sums* over ranks: the optimizer divides
by the world size together with the loss scale, in one pass.

Collective order must be identical on every rank. Buckets become ready in the order autograd
finishes them, which is the same on every rank for the same graph; whatever is not ready
when backward ends (parameters unused in this forward) is flushed in segment order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerowatch.engine.buffers import BufferPool
from zerowatch.engine.comm import Comm, Handle
from zerowatch.engine.flat import Segment
from zerowatch.engine.phases import Phases


class _ReadyTracker:
    """Counts gradients per segment in one backward pass and says when a segment is ready."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.segment_of: dict[nn.Parameter, Segment] = {}
        for seg in segments:
            for s in seg.slots:
                self.segment_of[s.param] = seg
        self.remaining: dict[int, int] = {}
        self.launched: set[int] = set()

    def reset(self) -> None:
        self.remaining = {seg.index: len(seg.slots) for seg in self.segments}
        self.launched = set()

    def arrived(self, param: nn.Parameter) -> Segment | None:
        seg = self.segment_of[param]
        self.remaining[seg.index] -= 1
        return seg if self.remaining[seg.index] == 0 and seg.index not in self.launched else None

    def unlaunched(self) -> list[Segment]:
        return [seg for seg in self.segments if seg.index not in self.launched]


class BoundaryReducer:
    """Stages 0 and 1: local accumulation, one reduction per optimizer step.

    Args:
        segments: the buckets, in the order they usually become ready.
        op: "all_reduce" (stage 0: shards == 1) or "reduce_scatter" (stage 1).
    """

    def __init__(self, segments: list[Segment], comm: Comm, phases: Phases, *, op: str,
                 overlap: bool, device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        if op not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"op: expected all_reduce or reduce_scatter, got {op!r}")
        self.segments, self.comm, self.phases = segments, comm, phases
        self.op, self.overlap = op, overlap
        self.flat_grad = torch.zeros(sum(s.padded for s in segments), device=device, dtype=dtype)
        self._flat: dict[int, torch.Tensor] = {}
        base = 0
        for seg in segments:
            flat = self.flat_grad.narrow(0, base, seg.padded)
            base += seg.padded
            self._flat[seg.index] = flat
            seg.grad_shard = flat if op == "all_reduce" else seg.shard_of(flat)
        self._views = {s.param: v for seg in segments
                       for s, v in zip(seg.slots, seg.views(self._flat[seg.index]), strict=True)}  # fmt: skip
        self.tracker = _ReadyTracker(segments)
        self.sync = False
        self.pending: list[tuple[Handle, torch.Tensor | None, Segment]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._views]
        self._attach_grads()

    def _attach_grads(self) -> None:
        # Someone may have set .grad to None (model.zero_grad()); point it back at the buffer.
        for p, view in self._views.items():
            if p.grad is not view:
                p.grad = view

    def begin_backward(self, sync: bool) -> None:
        self._attach_grads()
        self.sync = sync
        self.tracker.reset()

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        seg = self.tracker.arrived(param)
        if seg is not None:
            self._launch(seg)

    def _launch(self, seg: Segment) -> None:
        self.tracker.launched.add(seg.index)
        flat = self._flat[seg.index]
        with self.phases.phase("grad_reduce"):
            if self.op == "all_reduce":
                h = self.comm.all_reduce(flat, purpose="grad_reduce", async_op=self.overlap)
                self.pending.append((h, None, seg))
            else:
                # Out of place: gloo's in-place reduce-scatter is ~3x slower (measured).
                out = torch.empty_like(seg.grad_shard)
                h = self.comm.reduce_scatter(out, flat, purpose="grad_reduce",
                                             async_op=self.overlap)  # fmt: skip
                self.pending.append((h, out, seg))

    def end_backward(self) -> None:
        if not self.sync:
            return
        for seg in self.tracker.unlaunched():
            self._launch(seg)
        with self.phases.phase("grad_reduce"):
            for h, out, seg in self.pending:
                h.wait()
                if out is not None:
                    seg.grad_shard.copy_(out)
        self.pending.clear()

    def zero_grad(self) -> None:
        self.flat_grad.zero_()

    def grad_tensors(self) -> list[torch.Tensor]:
        return [self.flat_grad]

    def remove_hooks(self) -> None:
        """Take the gradient hooks off the parameters (ZeroEngine.destroy)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


class MicroBatchReducer:
    """Stages 2 and 3: reduce-scatter every micro-batch into accumulated gradient shards.

    Args:
        segments: the segments whose gradients this reduces.
        on_copied: called with a segment once its gradients are in the staging buffer (stage
            3 releases the gathered parameters there).
        pool: where staging buffers come from; each goes back once its reduce-scatter is
            done (stage 3 shares it with the gathered parameters).
        max_inflight_numel: with overlap, at most this many staged elements wait for their
            collective at once (older ones are waited for first), bounding the staging memory.
    """

    def __init__(self, segments: list[Segment], comm: Comm, phases: Phases, *, overlap: bool,
                 device: torch.device, dtype: torch.dtype, max_inflight_numel: int,
                 on_copied: Callable[[Segment], None] | None = None,
                 pool: BufferPool | None = None) -> None:  # fmt: skip
        self.segments, self.comm, self.phases = segments, comm, phases
        self.pool = pool if pool is not None else BufferPool(device, dtype)
        self.overlap, self.device, self.dtype = overlap, device, dtype
        self.max_inflight = max(max_inflight_numel, 1)
        self.on_copied = on_copied
        self.grad_buffer = torch.zeros(sum(s.shard_numel for s in segments), device=device,
                                       dtype=dtype)  # fmt: skip
        base = 0
        for seg in segments:
            seg.grad_shard = self.grad_buffer.narrow(0, base, seg.shard_numel)
            base += seg.shard_numel
        self.tracker = _ReadyTracker(segments)
        self.fresh = True  # the next reduction starts a new accumulation cycle
        self.pending: list[tuple[Handle, torch.Tensor, torch.Tensor, Segment]] = []
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._on_grad)
                       for seg in segments for s in seg.slots]  # fmt: skip

    def begin_backward(self, sync: bool) -> None:
        self.tracker.reset()

    def _on_grad(self, param: nn.Parameter) -> None:
        seg = self.tracker.arrived(param)
        if seg is not None:
            self._launch(seg)

    def _launch(self, seg: Segment) -> None:
        self.tracker.launched.add(seg.index)
        with self.phases.phase("grad_reduce"):
            staging = self.pool.take(seg.padded)
            seg.flatten_into(staging, [s.param.grad for s in seg.slots])
            for s in seg.slots:
                s.param.grad = None
            if self.on_copied is not None:
                self.on_copied(seg)
            out = seg.grad_shard if self.fresh else torch.empty_like(seg.grad_shard)
            h = self.comm.reduce_scatter(out, staging, purpose="grad_reduce",
                                         async_op=self.overlap)  # fmt: skip
            self.pending.append((h, staging, out, seg))
            while (
                sum(p[1].numel() for p in self.pending) > self.max_inflight
                and len(self.pending) > 1
            ):
                self._finish(self.pending.pop(0))

    def _finish(self, item: tuple[Handle, torch.Tensor, torch.Tensor, Segment]) -> None:
        h, staging, out, seg = item
        h.wait()
        if out is not seg.grad_shard:
            seg.grad_shard.add_(out)
        self.pool.give(staging)

    def end_backward(self) -> None:
        for seg in self.tracker.unlaunched():
            self._launch(seg)
        with self.phases.phase("grad_reduce"):
            for item in self.pending:
                self._finish(item)
        self.pending.clear()
        self.pool.clear()
        self.fresh = False

    def zero_grad(self) -> None:
        # The next micro-batch's reduce-scatter overwrites the shards: nothing to clear.
        self.fresh = True

    def grad_tensors(self) -> list[torch.Tensor]:
        return [self.grad_buffer]

    def remove_hooks(self) -> None:
        """Take the gradient hooks off the parameters (ZeroEngine.destroy)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


__all__ = ["BoundaryReducer", "MicroBatchReducer"]
