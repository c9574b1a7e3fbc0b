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
synchronously inside backward. Both reducers leave *sums* over ranks of gradients already
divided (through the loss) by the engine's `predivide`, the world size unless
`gradient_predivide_factor` says otherwise, so that an fp16 sum cannot grow with N; the
optimizer divides by what is left of N together with the loss scale, in one pass.

Collective order must be identical on every rank, and the ranks' graphs need not be: a rank
whose forward skipped some parameters (MoE routing, a conditional block) never gets their
gradients in this backward, while the others do. So each reducer issues its collectives in
one fixed order, the order of its `segments` (the order their gradients usually become
ready), never in the order this rank's autograd happens to finish them: a segment that is
ready waits until every segment before it has been issued, and whatever is not ready when
backward ends is issued then, in the same order, with zeros for the missing gradients (DDP
issues its buckets in order for the same reason). On the graphs every rank shares, ready
order and issue order coincide and nothing waits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerowatch.engine.buffers import BufferPool
from zerowatch.engine.comm import Comm, Handle
from zerowatch.engine.flat import Segment
from zerowatch.engine.forensics import LocalGrads
from zerowatch.engine.phases import Phases

#: Nodes whose backward runs a graph of its own, out of the walk's sight (torch's reentrant
#: activation checkpoint): behind one, any parameter may still get a gradient.
_OPAQUE = frozenset({"CheckpointFunctionBackward"})


def params_in_graph(roots: list[torch.Tensor]) -> set[int] | None:
    """ids of the leaf tensors (parameters) a backward from `roots` will reach: DDP's
    search for unused parameters, a walk of the autograd graph's nodes. None when the graph
    holds a node that runs a backward of its own (reentrant checkpointing): unknown."""
    found: set[int] = set()
    seen: set[object] = set()
    stack: list[Any] = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        if type(fn).__name__ in _OPAQUE:
            return None
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # AccumulateGrad: the parameter it writes
        if leaf is not None:
            found.add(id(leaf))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found


class _ReadyTracker:
    """Counts gradients per segment in one backward pass and says which segments may be
    issued: the ready ones at the head of the fixed order (see the module docstring)."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.segment_of: dict[nn.Parameter, Segment] = {}
        for seg in segments:
            for s in seg.slots:
                self.segment_of[s.param] = seg
        self.remaining: dict[int, int] = {}
        self.untouched: set[int] = set()  # segments no parameter of which is in the graph
        self.issued = 0  # segments[:issued] have been issued in this pass

    def reset(self, in_graph: set[int] | None = None) -> None:
        """A new backward. `in_graph`: ids of the parameters this backward will reach (the
        others count as arrived, with no gradient; a segment with none of them waits for
        `passed` instead); None: all of them."""
        self.untouched = set()
        if in_graph is None:
            self.remaining = {seg.index: len(seg.slots) for seg in self.segments}
        else:
            self.remaining = {seg.index: sum(id(s.param) in in_graph for s in seg.slots)
                              for seg in self.segments}  # fmt: skip
            self.untouched = {i for i, n in self.remaining.items() if n == 0}
            self.remaining.update(dict.fromkeys(self.untouched, 1))
        self.issued = 0

    def passed(self, seg: Segment) -> list[Segment]:
        """An untouched segment's turn has come (its owner gathered it for this backward):
        the segments that may be issued now."""
        if seg.index not in self.untouched:
            return []
        self.untouched.discard(seg.index)
        self.remaining[seg.index] = 0
        return self._issuable()

    def arrived(self, param: nn.Parameter) -> tuple[Segment | None, list[Segment]]:
        """The segment `param` completed (None if still incomplete), and the segments that
        may be issued now, in order."""
        seg = self.segment_of[param]
        if self.remaining[seg.index] <= 0:
            name = next((s.name for s in seg.slots if s.param is param), "a parameter")
            raise RuntimeError(
                f"zerowatch: the gradient of {name} arrived after its segment was reduced "
                "(the walk of the autograd graph did not see it: a custom autograd node that "
                "runs its own backward?); it would be lost"
            )
        self.remaining[seg.index] -= 1
        done = seg if self.remaining[seg.index] == 0 else None
        return done, self._issuable() if done is not None else []

    def _issuable(self) -> list[Segment]:
        start = self.issued
        while self.issued < len(self.segments) and \
                self.remaining[self.segments[self.issued].index] == 0:  # fmt: skip
            self.issued += 1
        return self.segments[start : self.issued]

    def rest(self) -> list[Segment]:
        """Every segment not issued yet, in order (the end of backward)."""
        out = self.segments[self.issued :]
        self.issued = len(self.segments)
        return out


class BoundaryReducer:
    """Stages 0 and 1: local accumulation, one reduction per optimizer step.

    Args:
        segments: the buckets, in the order they are issued on every rank (the order they
            usually become ready).
        op: "all_reduce" (stage 0: shards == 1) or "reduce_scatter" (stage 1).
        in_backward: issue each bucket as soon as it may go (False: all of them at the end
            of backward; stage 3's small parameters, whose reductions share a process group
            with the units' reduce-scatters and must not interleave with them by timing).
    """

    def __init__(self, segments: list[Segment], comm: Comm, phases: Phases, *, op: str,
                 overlap: bool, device: torch.device, dtype: torch.dtype,
                 in_backward: bool = True) -> None:  # fmt: skip
        if op not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"op: expected all_reduce or reduce_scatter, got {op!r}")
        self.segments, self.comm, self.phases = segments, comm, phases
        self.op, self.overlap, self.in_backward = op, overlap, in_backward
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
        #: Notes each bucket's local gradients before its collective (the engine sets it).
        self.local_grads: LocalGrads | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._views]
        self._attach_grads()

    def _attach_grads(self) -> None:
        # Someone may have set .grad to None (model.zero_grad()); point it back at the buffer.
        for p, view in self._views.items():
            if p.grad is not view:
                p.grad = view

    def begin_backward(self, sync: bool, roots: list[torch.Tensor] | None = None) -> None:
        del roots  # every bucket waits for its turn; nothing else shares its group's order
        self._attach_grads()
        self.sync = sync
        self.tracker.reset()

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.sync or not self.in_backward:
            return
        for seg in self.tracker.arrived(param)[1]:
            self._launch(seg)

    def _launch(self, seg: Segment) -> None:
        flat = self._flat[seg.index]
        if self.local_grads is not None:
            self.local_grads.add(seg, flat)
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
        for seg in self.tracker.rest():
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
        segments: the segments whose gradients this reduces, in the order their
            reduce-scatters are issued on every rank.
        on_copied: called with a segment once its gradients are in the staging buffer (stage
            3 releases the gathered parameters there).
        pool: where staging buffers come from; each goes back once its reduce-scatter is
            done (stage 3 shares it with the gathered parameters).
        max_inflight_numel: with overlap, at most this many staged elements wait for their
            collective at once (older ones are waited for first), bounding the staging memory.
        find_unused: at the start of each backward, walk the autograd graph for the
            parameters it will not reach; a segment with none of them is issued (zeros)
            once its owner has gathered it for this backward (`passed`), not at the end.
            Stage 3 needs it: its reduce-scatters share the backward with parameter
            gathers on another group, so a rank must never wait for a reduce-scatter that
            a peer can only issue after a gather this rank has not issued yet, nor hold one
            back that a peer waits for. Issued where a peer using the unit issues its own
            (after the unit's gather, in the same fixed order), neither happens.
    """

    def __init__(self, segments: list[Segment], comm: Comm, phases: Phases, *, overlap: bool,
                 device: torch.device, dtype: torch.dtype, max_inflight_numel: int,
                 on_copied: Callable[[Segment], None] | None = None,
                 pool: BufferPool | None = None, find_unused: bool = False) -> None:  # fmt: skip
        self.segments, self.comm, self.phases = segments, comm, phases
        self.find_unused = find_unused
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
        #: Segments whose gradients are staged and whose turn to be issued has not come.
        self.staged: dict[int, torch.Tensor] = {}
        #: Notes each segment's local gradients before its collective (the engine sets it).
        self.local_grads: LocalGrads | None = None
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._on_grad)
                       for seg in segments for s in seg.slots]  # fmt: skip

    def begin_backward(self, sync: bool, roots: list[torch.Tensor] | None = None) -> None:
        in_graph = params_in_graph(roots) if self.find_unused and roots is not None else None
        self.tracker.reset(in_graph)

    def _on_grad(self, param: nn.Parameter) -> None:
        done, issuable = self.tracker.arrived(param)
        if done is None:
            return
        with self.phases.phase("grad_reduce"):
            self._stage(done)
            for seg in issuable:
                self._issue(seg)

    def passed(self, seg: Segment) -> None:
        """The owner gathered `seg` for this backward (see `find_unused`)."""
        issuable = self.tracker.passed(seg)
        if issuable:
            with self.phases.phase("grad_reduce"):
                for s in issuable:
                    self._issue(s)

    def _stage(self, seg: Segment, *, arrived: bool = True) -> None:
        """Copy the segment's gradients (None: zeros) into a staging buffer and drop them.
        `arrived`: this backward produced them (else the parameters' owner is not told:
        what it gathered for them is not this reducer's to release)."""
        staging = self.pool.take(seg.padded)
        seg.flatten_into(staging, [s.param.grad for s in seg.slots])
        for s in seg.slots:
            s.param.grad = None
        if self.on_copied is not None and arrived:
            self.on_copied(seg)
        self.staged[seg.index] = staging

    def _issue(self, seg: Segment) -> None:
        if seg.index not in self.staged:  # no gradient in this backward: zeros
            self._stage(seg, arrived=False)
        staging = self.staged.pop(seg.index)
        if self.local_grads is not None:
            self.local_grads.add(seg, staging)
        out = seg.grad_shard if self.fresh else torch.empty_like(seg.grad_shard)
        h = self.comm.reduce_scatter(out, staging, purpose="grad_reduce", async_op=self.overlap)
        self.pending.append((h, staging, out, seg))
        while sum(p[1].numel() for p in self.pending) > self.max_inflight and len(self.pending) > 1:
            self._finish(self.pending.pop(0))

    def _finish(self, item: tuple[Handle, torch.Tensor, torch.Tensor, Segment]) -> None:
        h, staging, out, seg = item
        h.wait()
        if out is not seg.grad_shard:
            seg.grad_shard.add_(out)
        self.pool.give(staging)

    def end_backward(self) -> None:
        with self.phases.phase("grad_reduce"):
            for seg in self.tracker.rest():
                self._issue(seg)
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


__all__ = ["BoundaryReducer", "MicroBatchReducer", "params_in_graph"]
