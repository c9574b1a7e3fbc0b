"""Each stage's communication path on the training thread, rehearsed on the job's own
process group with its parameters' layout: what a run cannot measure in its steps for the
stages it does not run.

At stage 3 the training thread, around every use of a unit (engine/params_sharded.py) and
every reduction of its gradients (reducers.MicroBatchReducer), takes a flat buffer from the
pass's pool, issues the unit's all-gather to the communication backend (and the next
units' ahead of need: prefetch), waits for it, points the unit's parameters at views of the
buffer, registers a gradient hook on the unit's outputs, puts the parameters back to empty
and lets the buffer go; in backward it gathers the unit again, copies its gradients into a
staging buffer, issues their reduce-scatter and waits for the older ones beyond the
in-flight bound. Stages 0-2 have a lighter path of their own: per reduce bucket, stage 0
all-reduces and stage 1 reduce-scatters on the step's last micro-batch, waited for at the
end of backward; stage 2 stages and reduce-scatters every micro-batch within its in-flight
bound; stages 1-2 all-gather the updated parts after the optimizer step. A run measures its
own stage's path as the time of its communication phases not spent blocked in a
collective's wait (`comm_phase_host_s`, docs/doctor.md), and not the other stages'.

The rehearsal goes through every stage's path with the same definition. It lays the stages
out with the engine's own functions over the job's layout (layout.py: stand-in parameters
of the trained ones' shapes) and goes through one optimizer step of each, as often as a
step does (stage 3: every unit gathered in each forward, counts.forward_gathers, and once
in backward, with its prefetch, `stage3_prefetch_bucket_size` and
`stage3_max_live_parameters`, its in-flight bound, twice `reduce_bucket_size`, and its
persistent parameters' all-reduces; stages 0-2: their buckets), issuing the real
collectives on the job's process group, asynchronously, through a `Comm` of its own whose
one observer sums each call's exposed seconds (blocked in `wait()`, up to the call's end:
the thread's wake-up after it is not exposed, as for the agent). A unit gathered in forward
stays referenced until its backward, as the weights a module saves for its backward keep
the gathered buffer (buffers.BufferPool), so forward gathers get fresh buffers as in a
step: stage 3's rehearsal holds the whole model gathered once. Stages 0-2's calls read and
write one scratch buffer of a bucket (their values do not matter, and the ring runs one
call at a time). A stage's figure is its step's wall time less the calls' exposed seconds:
the bookkeeping, the issuing of the calls, and the wake-ups after the waits that blocked.
Round by round, every stage once a round; the first round fills the pools (a run's warm-up
steps) and the median of the other `PASSES` counts (a run's figure is a median over its
steps), fewer past `BUDGET_S`. Every rank runs the same rehearsal (the same calls, in the
same order, and the same number of rounds), so the collectives match; nothing reaches the
engine's observers.

What it leaves out: the hook dispatch inside the model's forward and backward, and the
compute that runs in a step between a call's issue and its wait. That cuts both ways:
where a step's calls complete during compute (stage 1's reduce-scatters, issued in
backward and waited for after it) the rehearsal's waits block where the step's do not and
it overstates the path; where compute keeps the cores busy when a wait ends (stage 3,
gathering just ahead of use) a step's wake-ups take longer and it understates it.

On a GPU the host does this bookkeeping ahead of the device's queue and it costs the step
only where the host falls behind; the doctor does not price it there, and it is not
rehearsed (None).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Any

import torch
from torch import nn

from zerowatch.engine.buffers import BufferPool
from zerowatch.engine.comm import Comm, Handle
from zerowatch.engine.flat import Segment, bucket
from zerowatch.engine.hooks import CollectiveRecord, ObserverRegistry
from zerowatch.engine.stages import ParamList
from zerowatch.rehearse.counts import forward_gathers
from zerowatch.rehearse.layout import Layout

#: Rehearsed steps after a first one (which fills the pools, as a run's warm-up steps do):
#: their median counts, as the run's own figure is a median over its steps.
PASSES = 5
#: Seconds of rehearsal after which no further round starts (one measured round at least).
BUDGET_S = 2.0
#: How long to wait for the last calls' reports after a pass (they come from the backend's
#: thread just after the calls complete).
REPORT_TIMEOUT_S = 1.0


class _Exposed:
    """Sums what the run's agent would count as exposed: each collective's `exposed_s` (the
    time the training thread was blocked in its `wait()`, up to the collective's end, not
    the thread's wake-up after it), as reported to the observers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds = 0.0
        self.calls = 0

    def on_collective(self, rec: CollectiveRecord) -> None:
        with self.lock:
            self.seconds += rec.exposed_s
            self.calls += 1


def _no_grad_hook(*_grads: object) -> None:
    return None


class _Stage3:
    """One rehearsed optimizer step of stage 3's path on the training thread: the path of
    ShardedParams and MicroBatchReducer over the units, with the collectives issued for
    real, and the persistent (small) parameters' all-reduces (BoundaryReducer)."""

    def __init__(self, layout: Layout, units: list[Segment], roots: list[nn.Module], comm: Comm,
                 *, persistent: _Bucketed) -> None:  # fmt: skip
        zc, device, dtype = layout.zc, layout.device, layout.dtype
        self.units, self.comm, self.persistent = units, comm, persistent
        self.prefetch_numel = int(zc.stage3_prefetch_bucket_size)
        self.max_live_numel = int(zc.stage3_max_live_parameters)
        self.max_inflight = max(2 * int(zc.reduce_bucket_size), 1)
        extra = max(forward_gathers(layout, units, roots) - len(units), 0)
        # Forward: every unit in layout order (the module tree's), then the units that
        # modules outside their own subtree use again (a tied LM head), as counts.py counts.
        self.forward_order = list(range(len(units))) + list(range(min(extra, len(units))))
        self.saved = [[s.param.data for s in seg.slots] for seg in units]
        # Each rank's part of every unit, the gradients' reduced parts, and the gradients
        # copied into staging in backward (views of one buffer: their values do not matter).
        self.sources = [torch.zeros(seg.shard_numel, device=device, dtype=dtype) for seg in units]
        self.outputs = [torch.empty(seg.shard_numel, device=device, dtype=dtype) for seg in units]
        grads = torch.zeros(max((seg.padded for seg in units), default=0), device=device,
                            dtype=dtype)  # fmt: skip
        self.grads: list[list[torch.Tensor | None]] = [list(seg.views(grads)) for seg in units]
        self.pool = BufferPool(device, dtype)
        self.empty = torch.empty(0, device=device, dtype=dtype)
        self.probe = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
        self.issued = 0
        self.live = 0
        self.inflight: dict[int, tuple[torch.Tensor, Handle]] = {}

    def _start(self, i: int) -> None:
        if i in self.inflight:
            return
        seg = self.units[i]
        full = self.pool.take(seg.padded)
        h = self.comm.all_gather(full, self.sources[i], purpose="param_fetch", async_op=True)
        self.issued += 1
        self.inflight[i] = (full, h)
        self.live += seg.numel

    def _fetch(self, order: list[int], pos: int) -> torch.Tensor:
        """Gather order[pos] (issue it and the next ones within the prefetch budget), wait,
        and point its parameters at the buffer; the buffer."""
        i = order[pos]
        self._start(i)
        budget = self.prefetch_numel
        for nxt in order[pos + 1 :]:
            if budget <= 0:
                break
            budget -= self.units[nxt].numel
            if nxt not in self.inflight:
                if self.live + self.units[nxt].numel > self.max_live_numel:
                    break
                self._start(nxt)
        full, h = self.inflight.pop(i)
        h.wait()
        for s, view in zip(self.units[i].slots, self.units[i].views(full), strict=True):
            s.param.data = view
        return full

    def _release(self, i: int, full: torch.Tensor, *, keep: bool) -> None:
        for s in self.units[i].slots:
            s.param.data = self.empty
        self.live -= self.units[i].numel
        if not keep:
            self.pool.give(full)

    def _micro_batch(self) -> None:
        held: dict[int, list[torch.Tensor]] = {}
        for pos, i in enumerate(self.forward_order):
            full = self._fetch(self.forward_order, pos)
            torch.autograd.graph.register_multi_grad_hook([self.probe], _no_grad_hook,
                                                          mode="any")  # fmt: skip
            held.setdefault(i, []).append(full)  # a module's saved weights keep it
            self._release(i, full, keep=True)
        backward = list(reversed(range(len(self.units))))
        pending: deque[tuple[torch.Tensor, Handle]] = deque()
        for pos, i in enumerate(backward):
            full = self._fetch(backward, pos)
            staging = self.pool.take(self.units[i].padded)
            self.units[i].flatten_into(staging, self.grads[i])
            self._release(i, full, keep=False)
            held.pop(i, None)
            h = self.comm.reduce_scatter(self.outputs[i], staging, purpose="grad_reduce",
                                         async_op=True)  # fmt: skip
            self.issued += 1
            pending.append((staging, h))
            while sum(p[0].numel() for p in pending) > self.max_inflight and len(pending) > 1:
                done, h_old = pending.popleft()
                h_old.wait()
                self.pool.give(done)
        while pending:
            done, h_old = pending.popleft()
            h_old.wait()
            self.pool.give(done)
        self.pool.clear()

    def run(self, micro_batches: int) -> float:
        """Wall seconds of one optimizer step's path (the collectives' waits included); the
        stand-ins are put back as they were."""
        start = time.perf_counter()
        try:
            for _ in range(micro_batches):
                self._micro_batch()
        finally:
            for seg, values in zip(self.units, self.saved, strict=True):
                for s, data in zip(seg.slots, values, strict=True):
                    s.param.data = data
        issued = self.persistent.issued
        took = time.perf_counter() - start + self.persistent.run(1)
        self.issued += self.persistent.issued - issued
        return took


class _Bucketed:
    """One rehearsed optimizer step of stages 0-2's communication path on the training
    thread (reducers.BoundaryReducer, MicroBatchReducer; params_replicated.ReplicatedParams):
    per reduce bucket, stage 0 all-reduces and stage 1 reduce-scatters out of place on the
    step's last micro-batch (issued as the buckets fill, waited for at the end of backward,
    stage 1 copying each result into its shard); stage 2 copies each bucket's gradients into
    a staging buffer and reduce-scatters it every micro-batch, waiting for the older ones
    beyond the in-flight bound; after the optimizer step stages 1 and 2 all-gather the
    updated parts. The collectives read and write one scratch buffer (their values do not
    matter, and the ring runs one call at a time), so the rehearsal holds a bucket, not a
    second copy of the model."""

    def __init__(self, stage: int, buckets: list[Segment], comm: Comm, *, max_inflight_numel: int,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        self.stage, self.buckets, self.comm = stage, buckets, comm
        self.max_inflight = max(max_inflight_numel, 1)
        self.device, self.dtype = device, dtype
        size = max((b.padded for b in buckets), default=0)
        self.scratch = torch.zeros(size, device=device, dtype=dtype)
        self.gathered = torch.zeros(size, device=device, dtype=dtype)
        self.shard = torch.zeros(max((b.shard_numel for b in buckets), default=0),
                                 device=device, dtype=dtype)  # fmt: skip
        self.pool = BufferPool(device, dtype)
        #: Each bucket's gradients, copied into staging every micro-batch at stage 2
        #: (views of one buffer: their values do not matter).
        self.grads: list[list[torch.Tensor | None]] = [list(b.views(self.gathered))
                                                       for b in buckets]  # fmt: skip
        self.issued = 0

    def _boundary(self) -> None:
        pending: list[tuple[Handle, torch.Tensor | None, Segment]] = []
        for seg in self.buckets:
            flat = self.scratch.narrow(0, 0, seg.padded)
            if self.stage == 0:
                pending.append((self.comm.all_reduce(flat, purpose="grad_reduce", async_op=True),
                                None, seg))  # fmt: skip
            else:
                out = torch.empty(seg.shard_numel, device=self.device, dtype=self.dtype)
                pending.append((self.comm.reduce_scatter(out, flat, purpose="grad_reduce",
                                                         async_op=True), out, seg))  # fmt: skip
            self.issued += 1
        for h, result, seg in pending:
            h.wait()
            if result is not None:
                self.shard.narrow(0, 0, seg.shard_numel).copy_(result)

    def _micro_batch(self, fresh: bool) -> None:
        pending: deque[tuple[Handle, torch.Tensor, torch.Tensor, Segment]] = deque()

        def finish(item: tuple[Handle, torch.Tensor, torch.Tensor, Segment]) -> None:
            h, staging, out, seg = item
            h.wait()
            shard = self.shard.narrow(0, 0, seg.shard_numel)
            if out is not shard:
                shard.add_(out)
            self.pool.give(staging)

        for seg, grads in zip(self.buckets, self.grads, strict=True):
            staging = self.pool.take(seg.padded)
            seg.flatten_into(staging, grads)
            shard = self.shard.narrow(0, 0, seg.shard_numel)
            out = shard if fresh else torch.empty_like(shard)
            h = self.comm.reduce_scatter(out, staging, purpose="grad_reduce", async_op=True)
            self.issued += 1
            pending.append((h, staging, out, seg))
            while sum(p[1].numel() for p in pending) > self.max_inflight and len(pending) > 1:
                finish(pending.popleft())
        while pending:
            finish(pending.popleft())
        self.pool.clear()

    def _after_step(self) -> None:
        handles = []
        for seg in self.buckets:
            handles.append(self.comm.all_gather(self.gathered.narrow(0, 0, seg.padded),
                                                self.shard.narrow(0, 0, seg.shard_numel),
                                                purpose="optimizer_gather", async_op=True))  # fmt: skip
            self.issued += 1
        for h in handles:
            h.wait()

    def run(self, micro_batches: int) -> float:
        """Wall seconds of one optimizer step's path (the collectives' waits included)."""
        start = time.perf_counter()
        if self.stage == 2:
            for micro in range(micro_batches):
                self._micro_batch(fresh=micro == 0)
        else:
            self._boundary()
        if self.stage in (1, 2):
            self._after_step()
        return time.perf_counter() - start


def management_s(layout: Layout, comm: Comm) -> dict[int, float] | None:
    """{stage: seconds per optimizer step of that stage's communication path on the training
    thread, outside the collectives' waits} for stages 0-2 and, where some parameter is
    sharded at stage 3, stage 3 (the median of its rehearsals: module
    docstring); None where nothing is rehearsed: one rank, or a GPU (the host runs ahead of
    the device there and the doctor does not price it). Every rank must call it alike: it
    communicates, on `comm`'s process group.
    """
    world_size, rank, device, dtype = layout.world_size, layout.rank, layout.device, layout.dtype
    if world_size <= 1 or device.type != "cpu" or not layout.params:
        return None
    bucket_numel = max(int(layout.zc.reduce_bucket_size), 1)
    ga = max(layout.gradient_accumulation_steps, 1)
    backward_order = list(reversed(layout.params))
    # The job's process group, through a Comm of its own: the calls reach this
    # rehearsal's observer only (their exposed seconds, as the agent would count them).
    exposed = _Exposed()
    registry = ObserverRegistry()
    registry.add(exposed)
    quiet = Comm(registry, group=comm.group)
    inflight = 2 * bucket_numel  # stages.compose: the staged gradients in flight

    def bucketed(stage: int, entries: ParamList) -> _Bucketed:
        segs = bucket(entries, bucket_numel, 1 if stage == 0 else world_size, rank)
        return _Bucketed(stage, segs, quiet, max_inflight_numel=inflight, device=device,
                         dtype=dtype)  # fmt: skip

    paths: dict[int, Any] = {stage: bucketed(stage, backward_order) for stage in (0, 1, 2)}
    units, roots = layout.stage3_units(bucket_numel, rank)
    if units:
        paths[3] = _Stage3(layout, units, roots, quiet,
                           persistent=bucketed(0, list(reversed(layout.persistent()))))  # fmt: skip
    # Round by round, every stage once, so that a spell of other work on the host falls on
    # the stages alike; the first round fills the pools (a run's warm-up steps).
    seconds: dict[int, list[float]] = {stage: [] for stage in paths}
    started = time.perf_counter()
    for done in range(PASSES + 1):
        # A large model's rounds take long (each is a step's communication of every
        # stage): past BUDGET_S after a measured round, no more, decided by every rank
        # together (a sum of their votes) so that their calls keep matching.
        if done >= 2:
            vote = torch.tensor([float(time.perf_counter() - started > BUDGET_S)])
            quiet.all_reduce(vote, purpose="other")
            if vote.item() > 0:
                break
        for stage, path in paths.items():
            with exposed.lock:
                exposed.seconds, exposed.calls = 0.0, 0
            issued_before = path.issued
            took = path.run(ga)
            # An async call is reported once both its wait and its completion callback (on
            # the backend's thread) have happened: the last ones may come just after.
            deadline = time.perf_counter() + REPORT_TIMEOUT_S
            while exposed.calls < path.issued - issued_before and time.perf_counter() < deadline:
                time.sleep(0.001)
            with exposed.lock:
                seconds[stage].append(took - exposed.seconds)
    return {stage: max(statistics.median(got[1:]), 0.0) for stage, got in seconds.items()}


__all__ = ["BUDGET_S", "PASSES", "management_s"]
