"""What each ZeRO stage is made of: a parameter owner and a gradient reducer per segment set.

    stage   parameters (owner)              gradients (reducer)                    segments
    0       ReplicatedParams                BoundaryReducer(all_reduce)            buckets, 1 shard
    1       ReplicatedParams (+ all-gather) BoundaryReducer(reduce_scatter)        buckets, N shards
    2       ReplicatedParams (+ all-gather) MicroBatchReducer                      buckets, N shards
    3       ShardedParams                   MicroBatchReducer                      units, N shards
            + ReplicatedParams              + BoundaryReducer(all_reduce)          small params, 1 shard

The optimizer side (optim.MasterWeights) is the same for every stage: it updates whatever
part of each segment this rank owns.

Config keys that shape this: `reduce_bucket_size` (bucket elements, stages 0-2, and the
bound on staged gradients in flight), `overlap_comm`, `stage3_param_persistence_threshold`,
`stage3_prefetch_bucket_size`, the two offload devices. Accepted and not needed here:
`contiguous_gradients` (gradients are always contiguous), `reduce_scatter` (stages 1-3
always reduce-scatter), `allgather_partitions` / `allgather_bucket_size` (parameters are
gathered per reduce bucket), `sub_group_size` (one optimizer step over all parts),
`stage3_max_live_parameters` / `stage3_max_reuse_distance` (a unit is released right after
its forward and after its gradients are reduced, i.e. reuse distance 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerowatch.config import ConfigError, ZeroConfig
from zerowatch.engine.buffers import BufferPool
from zerowatch.engine.comm import Comm
from zerowatch.engine.flat import Segment, bucket
from zerowatch.engine.params_replicated import ReplicatedParams
from zerowatch.engine.params_sharded import ShardedParams
from zerowatch.engine.phases import Phases
from zerowatch.engine.reducers import BoundaryReducer, MicroBatchReducer

#: (qualified name, parameter, param-group index), in the module's registration order.
ParamList = list[tuple[str, nn.Parameter, int]]


@dataclass
class Composition:
    """The parts that make up one stage."""

    owners: list[Any]  # ReplicatedParams | ShardedParams
    reducers: list[Any]  # BoundaryReducer | MicroBatchReducer
    segments: list[Segment]
    persistent_numel: int = 0
    params_on_host: bool = False

    def remove_hooks(self) -> None:
        """Take every hook the parts registered on the model off it (idempotent)."""
        for part in (*self.owners, *self.reducers):
            part.remove_hooks()


def compose(stage: int, module: nn.Module, params: ParamList, zc: ZeroConfig, comm: Comm,
            phases: Phases, *, device: torch.device, dtype: torch.dtype,
            grad_comm: Comm | None = None) -> Composition:  # fmt: skip
    """Build the owner(s) and reducer(s) of `stage` over the trainable `params`.

    Stage 3 gathers parameters on `comm` and reduces gradients on `grad_comm` (a group of
    its own, `Comm.twin`): where gathers and reductions interleave in backward depends on
    each rank's graph, and ranks whose graphs differ must still agree on each group's order.
    """
    n, rank = comm.world_size, comm.rank
    bucket_numel = max(int(zc.reduce_bucket_size), 1)
    overlap = bool(zc.overlap_comm)
    common: dict[str, Any] = {"device": device, "dtype": dtype}
    # Backward produces the last layers' gradients first: lay buckets out in reverse.
    backward_order = list(reversed(params))
    if stage in (0, 1, 2):
        segs = bucket(backward_order, bucket_numel, 1 if stage == 0 else n, rank)
        owner = ReplicatedParams(segs, comm, phases, **common)
        reducer: Any
        if stage == 2:
            reducer = MicroBatchReducer(segs, comm, phases, overlap=overlap,
                                        max_inflight_numel=2 * bucket_numel, **common)  # fmt: skip
        else:
            op = "all_reduce" if stage == 0 else "reduce_scatter"
            reducer = BoundaryReducer(segs, comm, phases, op=op, overlap=overlap, **common)
        return Composition([owner], [reducer], segs)
    if stage != 3:
        raise ConfigError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got {stage!r}")

    threshold = int(zc.stage3_param_persistence_threshold)
    persistent = [t for t in params if t[1].numel() < threshold]
    big = {id(t[1]): t for t in params if t[1].numel() >= threshold}
    units, roots = stage3_units(module, big, n, rank, max_numel=bucket_numel)
    pool = BufferPool(device, dtype)  # gathered units and staged gradients, one pass
    sharded = ShardedParams(module, units, comm, phases, roots=roots, pool=pool,
                            offload=zc.offload_param.device == "cpu",
                            prefetch_numel=int(zc.stage3_prefetch_bucket_size),
                            max_live_numel=int(zc.stage3_max_live_parameters),
                            max_reuse_numel=int(zc.stage3_max_reuse_distance), **common)  # fmt: skip
    grads = grad_comm if grad_comm is not None else comm
    # Backward reaches the units from the last to the first: reduce them in that order.
    unit_reducer = MicroBatchReducer(list(reversed(units)), grads, phases, overlap=overlap,
                                     max_inflight_numel=2 * bucket_numel,
                                     on_copied=sharded.release, pool=pool, find_unused=True,
                                     **common)  # fmt: skip
    sharded.on_backward_gather = unit_reducer.passed
    owners: list[Any] = [sharded]
    reducers: list[Any] = [unit_reducer]
    small = bucket(list(reversed(persistent)), bucket_numel, 1, rank, start_index=len(units))
    if small:
        owners.append(ReplicatedParams(small, comm, phases, **common))
        # At the end of backward, after the units' reduce-scatters on the same group.
        reducers.append(BoundaryReducer(small, grads, phases, op="all_reduce", overlap=overlap,
                                        in_backward=False, **common))  # fmt: skip
    return Composition(owners, reducers, units + small,
                       persistent_numel=sum(t[1].numel() for t in persistent),
                       params_on_host=zc.offload_param.device == "cpu")  # fmt: skip


def stage3_units(module: nn.Module, big: dict[int, tuple[str, nn.Parameter, int]], n: int,
                 rank: int, *, max_numel: int) -> tuple[list[Segment], list[nn.Module]]:  # fmt: skip
    """Stage 3's units and the module each is gathered for (its root).

    A submodule whose whole subtree holds at most `max_numel` elements of sharded
    parameters (`reduce_bucket_size`), and at most half of them all, is one unit: its
    parameters are gathered with one all-gather before it runs and reduce-scattered with
    one collective (a transformer block instead of its four linear layers: a quarter of the
    collectives and hooks). Anything larger is split: the parameters registered on a module
    itself are one unit, and its children are visited in turn. The model itself and module
    containers that never run (ModuleList, ModuleDict) are never roots. A unit never mixes
    param groups (one per group, same root).

    Args:
        big: id(param) -> (name, param, group) of the sharded parameters; emptied.
    """
    total = sum(p.numel() for _, p, _ in big.values())
    segments: list[Segment] = []
    roots: list[nn.Module] = []
    seen: set[int] = set()

    def add(root: nn.Module, entries: list[tuple[str, nn.Parameter, int]]) -> None:
        by_group: dict[int, list[tuple[str, nn.Parameter]]] = {}
        for name, p, group in entries:
            by_group.setdefault(group, []).append((name, p))
        for group, members in sorted(by_group.items()):
            segments.append(Segment(len(segments), members, group, n, rank))
            roots.append(root)

    def visit(m: nn.Module, top: bool) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        runs = not isinstance(m, (nn.ModuleList, nn.ModuleDict))
        if not top and runs and next(m.children(), None) is not None:
            inside = list(dict.fromkeys(id(p) for p in m.parameters() if id(p) in big))
            numel = sum(big[i][1].numel() for i in inside)
            if inside and numel <= max_numel and 2 * numel <= total:
                add(m, [big.pop(i) for i in inside])
                seen.update(id(sub) for sub in m.modules())
                return
        own = [big.pop(id(p)) for p in m.parameters(recurse=False) if id(p) in big]
        if own:
            add(m, own)
        for child in m.children():
            visit(child, False)

    visit(module, True)
    return segments, roots


__all__ = ["Composition", "ParamList", "compose", "stage3_units"]
