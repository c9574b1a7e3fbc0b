"""How many collective calls each stage makes per optimizer step, counted from the engine's
own layout rules (nothing is run: pure arithmetic over the parameters' shapes).

The doctor prices another stage or bucket size by its calls as well as its bytes (each call
pays a latency), and the calls depend on things the server does not know: how the
parameters' sizes fall into reduce buckets (a parameter larger than the bucket is a bucket
of its own), and how stage 3 cuts the module tree into units. The engine knows both, so
they are counted with the very functions that lay it out (`flat.bucket`,
`stages.stage3_units`), over the job's layout (layout.py), for every stage and a range of
`reduce_bucket_size` values, and the agent sends the table in the run's
`engine_info["collective_calls"]`.

Per optimizer step with N > 1 ranks and A micro-batches (gradient accumulation), B the
reduce buckets of the stage's layout, U stage 3's units, S the buckets of stage 3's
persistent (small) parameters:

    stage   all_reduce            reduce_scatter   all_gather
    0       B                     -                -
    1       1 (the grad norm)     B                B (the updated parts, after the step)
    2       1                     A x B            B
    3       S + 1                 A x U            A x (forward uses + 1 backward) per unit

A stage-3 unit is gathered once in each forward it runs in and once in backward (held
until all its gradients are in); a unit that several modules use (a tied weight) is
gathered once per forward when the reuse distance covers the rest of the model
(`stage3_max_reuse_distance`, 1e9 by default), else once per use. Calls for other
purposes (checkpoints, GatheredParameters, the set-up broadcasts) are not per step and not
counted.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zerowatch.config import ZeroConfig
from zerowatch.engine.flat import Segment, bucket
from zerowatch.rehearse.layout import Layout

#: The smallest bucket size of the table (elements) and how many sizes it holds at most.
SMALLEST_BUCKET = 256
MAX_SIZES = 40


def stage_calls(stage: int, layout: Layout, *, reduce_bucket_size: int) -> dict[str, int]:
    """Collective calls of each op per optimizer step at `stage` with buckets of
    `reduce_bucket_size` elements (the table of the module docstring)."""
    n, ga = layout.world_size, max(layout.gradient_accumulation_steps, 1)
    params = layout.params
    if n <= 1 or not params:
        return {}
    b = max(int(reduce_bucket_size), 1)
    backward_order = list(reversed(params))
    if stage in (0, 1, 2):
        buckets = len(bucket(backward_order, b, 1 if stage == 0 else n, 0))
        if stage == 0:
            return {"all_reduce": buckets}
        return {"all_reduce": 1, "reduce_scatter": buckets * (ga if stage == 2 else 1),
                "all_gather": buckets}  # fmt: skip
    units, roots = layout.stage3_units(b, 0)
    small = len(bucket(list(reversed(layout.persistent())), b, 1, 0))
    gathers = forward_gathers(layout, units, roots) + len(units)
    out = {"all_reduce": small + (1 if units else 0), "reduce_scatter": ga * len(units),
           "all_gather": ga * gathers}  # fmt: skip
    return {op: c for op, c in out.items() if c}


def forward_gathers(layout: Layout, units: list[Segment], roots: list[nn.Module]) -> int:
    """All-gathers in one forward: one per unit and module that needs it, as ShardedParams
    hooks them (its root, and any module outside the root's subtree that holds one of its
    parameters), a unit used by several modules once when the reuse distance spans the
    rest of the model."""
    unit_of = {layout.real_id(s.param): i for i, seg in enumerate(units) for s in seg.slots}
    inside = [{id(m) for m in root.modules()} for root in roots]
    uses = [1] * len(units)
    for m in layout.module.modules():
        for p in m.parameters(recurse=False):
            i = unit_of.get(id(p))
            if i is not None and m is not roots[i] and id(m) not in inside[i]:
                uses[i] += 1
    total = sum(seg.numel for seg in units)
    reuse = int(layout.zc.stage3_max_reuse_distance)
    return sum(1 if k > 1 and reuse >= total - units[i].numel else k
               for i, k in enumerate(uses))  # fmt: skip


def bucket_sizes(reduce_bucket_size: int, num_params: int) -> list[int]:
    """The sizes the table is counted at: powers of two from SMALLEST_BUCKET up to the
    first that holds the whole model, and the run's own."""
    sizes = {max(int(reduce_bucket_size), 1)}
    size = SMALLEST_BUCKET
    while len(sizes) < MAX_SIZES:
        sizes.add(size)
        if size >= num_params:
            break
        size *= 2
    return sorted(sizes)


def collective_calls(layout: Layout) -> dict[str, Any]:
    """The table the agent sends as `engine_info["collective_calls"]`:

    {"world_size": N, "gradient_accumulation_steps": A,
     "reduce_bucket_size": the run's,
     "bucket_sizes": [b0 < b1 < ...],
     "calls": {"0".."3": {op: [calls per step at b0, b1, ...]}}}
    """
    zc: ZeroConfig = layout.zc
    num_params = sum(t[1].numel() for t in layout.params)
    sizes = bucket_sizes(int(zc.reduce_bucket_size), num_params)
    calls: dict[str, dict[str, list[int]]] = {}
    for stage in range(4):
        per_op: dict[str, list[int]] = {}
        for i, size in enumerate(sizes):
            for op, c in stage_calls(stage, layout, reduce_bucket_size=size).items():
                per_op.setdefault(op, [0] * len(sizes))[i] = c
        calls[str(stage)] = per_op
    return {"world_size": layout.world_size,
            "gradient_accumulation_steps": layout.gradient_accumulation_steps,
            "reduce_bucket_size": int(zc.reduce_bucket_size), "bucket_sizes": sizes,
            "calls": calls}  # fmt: skip


__all__ = ["bucket_sizes", "collective_calls", "forward_gathers", "stage_calls"]
