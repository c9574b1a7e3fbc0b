"""Stage 3's parameter management, timed on this job's own parameters at initialization,
without communicating: what a run at stage 0-2 cannot measure in its steps.

At stage 3 the training thread, around every use of a unit (engine/params_sharded.py) and
every reduction of its gradients (reducers.MicroBatchReducer), takes a flat buffer from the
pass's pool, points the unit's parameters at views of it, puts them back to empty and
returns the buffer; it copies the unit's gradients into a staging buffer for the
reduce-scatter; and it registers a gradient hook on the unit's outputs. A stage-1 or -2 run
does none of this, so the doctor cannot see its cost in the run's steps (docs/doctor.md,
"Stage 3's parameter management"). The engine can time it: it lays out stage 3's units with
the function that lays itself out (`stages.stage3_units`, as counts.py does) and goes
through that path for each unit as often as a step does (one gather per forward use and one
in backward, one staging copy per micro-batch: counts._forward_gathers), on the job's own
parameters and device, `PASSES` times, keeping the fastest pass (the least disturbed by
other work on the host).

What it leaves out, and cannot time without running a step: the collectives themselves (the
run measures their calls), the hook dispatch inside the model's forward and backward, and
what the communication threads of an asynchronous gather take from compute on a host whose
cores the ranks hold (docs/doctor.md says how large that is). The parameters' tensors are
put back as they were: training is unchanged.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from zerowatch.config import ZeroConfig
from zerowatch.engine.buffers import BufferPool
from zerowatch.engine.counts import _forward_gathers
from zerowatch.engine.flat import Segment
from zerowatch.engine.stages import ParamList, stage3_units

#: Rehearsals of one step's management; the fastest counts.
PASSES = 3


def _no_grad_hook(*_grads: object) -> None:
    return None


def _unit_path(seg: Segment, pool: BufferPool, saved: list[torch.Tensor], gathers: int,
               reductions: int, empty: torch.Tensor, probe: torch.Tensor) -> None:  # fmt: skip
    """One step's management of one unit: `gathers` times a gathered buffer taken, the
    parameters pointed at it and released, the buffer given back; `reductions` times the
    parameters' values (the gradients' stand-in, same sizes) copied into a staging buffer."""
    for _ in range(gathers):
        full = pool.take(seg.padded)  # (the gather itself writes it: not timed here)
        for s, view in zip(seg.slots, seg.views(full), strict=True):
            s.param.data = view
        torch.autograd.graph.register_multi_grad_hook([probe], _no_grad_hook, mode="any")
        for s in seg.slots:
            s.param.data = empty
        pool.give(full)
    for _ in range(reductions):
        staging = pool.take(seg.padded)
        seg.flatten_into(staging, list(saved))
        pool.give(staging)


def stage3_management_s(module: nn.Module, params: ParamList, zc: ZeroConfig, *,
                        world_size: int, gradient_accumulation_steps: int,
                        device: torch.device, dtype: torch.dtype) -> float | None:  # fmt: skip
    """Seconds of stage 3's parameter management per optimizer step on the training thread
    (the fastest of PASSES rehearsals), or None where it is not timed: one rank, no sharded
    parameter, or a GPU (the host runs ahead of the device there and the doctor does not
    price it), or a run at stage 3 itself (its steps measure the real thing: predict.py
    reads the rehearsal only for a run below stage 3).

    Must run before the engine lays out stage 3 (which empties the parameters).
    """
    if world_size <= 1 or device.type != "cpu" or int(zc.stage) >= 3:
        return None
    threshold = int(zc.stage3_param_persistence_threshold)
    big = {id(t[1]): t for t in params if t[1].numel() >= threshold}
    if not big:
        return None
    units, roots = stage3_units(module, big, world_size, 0,
                                max_numel=max(int(zc.reduce_bucket_size), 1))  # fmt: skip
    ga = max(gradient_accumulation_steps, 1)
    forward = _forward_gathers(module, units, roots, zc) / max(len(units), 1)
    pool = BufferPool(device, dtype)
    empty = torch.empty(0, device=device, dtype=dtype)
    probe = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
    best = float("inf")
    for _ in range(PASSES):
        start = time.perf_counter()
        for seg in units:
            saved = [s.param.data for s in seg.slots]
            try:
                _unit_path(seg, pool, saved, gathers=round(ga * (forward + 1)),
                           reductions=ga, empty=empty, probe=probe)  # fmt: skip
            finally:
                for s, data in zip(seg.slots, saved, strict=True):
                    s.param.data = data
        pool.clear()
        best = min(best, time.perf_counter() - start)
    return best


__all__ = ["PASSES", "stage3_management_s"]
