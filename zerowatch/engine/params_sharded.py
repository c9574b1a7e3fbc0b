"""Sharded parameters (stage 3): each rank keeps 1/N of every large parameter.

A *unit* is the set of large trainable parameters of one submodule (one `Segment` per unit
and param group): those of its whole subtree when they fit `reduce_bucket_size` (a
transformer block: one all-gather and one reduce-scatter for its four linear layers), else
those registered on it directly (`stages.stage3_units`). The unit's buffers come from a
pool reused within a pass (`buffers.BufferPool`). Between uses, each `nn.Parameter` of a unit holds
an empty tensor and the rank keeps only its part of the unit's flat buffer
(`segment.param_shard`, on the host with `offload_param`). Around every use:

    forward:   pre-hook   all-gather the unit (+ prefetch the next units)  -> module runs
               post-hook  release the unit (after registering a pre-backward hook on outputs)
    backward:  pre-hook   (first gradient w.r.t. the module's outputs) all-gather again
               the reducer reduce-scatters the unit's gradients once they are all in, then
               calls `release` (the gathered copy is not needed any more)

so a micro-batch all-gathers every unit twice and reduce-scatters it once: 3Ψ (the ZeRO
paper's stage-3 volume).

One order on every rank: ranks whose forward skips different modules (MoE routing, a
conditional block) must still issue the same gathers in the same order, so gathers follow
a schedule, not this rank's hooks: the units by index in forward, the reverse in backward.
A rank that needs a unit gathers every unit the schedule passes on the way (the ones
another rank's branch uses), and the end of a pass gathers what the schedule has left.
Prefetch issues the next units' gathers asynchronously, up to `stage3_prefetch_bucket_size`
elements ahead along the schedule, while the schedule's window from the unit just reached
holds at most `stage3_max_live_parameters` elements (counted along the schedule, not from
what this rank holds, so every rank prefetches alike). A unit the first forward used again
(a block called twice, a weight tied to the LM head) stays gathered after a use when its
next use comes within `stage3_max_reuse_distance` elements of the schedule; else it is
gathered again where it is needed. Every unit is released at the end of a pass. The
gradient reduce-scatters go on a process group of their own (stages.py): see
docs/gpu.md, "One order of collectives on every rank".

Small parameters (`stage3_param_persistence_threshold`) are not in any unit: they stay
whole on every rank (see `ReplicatedParams`). A module that uses a parameter registered on
another module must run that parameter's module (or be its owner): parameters are gathered
for the module they are registered on.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zerowatch.engine.buffers import BufferPool
from zerowatch.engine.comm import Comm, Handle
from zerowatch.engine.flat import Segment
from zerowatch.engine.phases import Phases
from zerowatch.engine.zero_init import flat_values


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class _Unit:
    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.state = UnitState.SHARDED
        self.full: torch.Tensor | None = None  # gathered flat buffer, padded
        self.src: torch.Tensor | None = None  # the shard being sent (kept alive while async)
        self.handle: Handle | None = None
        self.users = 0  # forward calls currently running that need it


class ShardedParams:
    """Owns stage-3 units: shards them at construction and gathers them around each use.

    Args:
        module: the model (hooks go on its submodules).
        segments: one per unit, built with shards = world size.
        roots: the module each segment is gathered for, by segment index (None: the
            modules that hold its parameters).
        pool: where gathered buffers come from and go back to within a pass (shared with
            the gradient reducer); cleared at the end of each backward.
        offload: keep the shards on the host (`offload_param`), pinned if device is a GPU.
        prefetch_numel: elements to gather ahead of need (0: no prefetch).
        max_live_numel: the most gathered elements that prefetch and reuse may lead to (the
            units a module needs are gathered whatever this is).
        max_reuse_numel: keep a unit gathered after a forward use when the recorded forward
            uses it again with at most this many elements of other units in between.
    """

    def __init__(self, module: nn.Module, segments: list[Segment], comm: Comm, phases: Phases,
                 *, device: torch.device, dtype: torch.dtype, offload: bool,
                 prefetch_numel: int, max_live_numel: int = 10**18,
                 max_reuse_numel: int = 0, roots: list[nn.Module] | None = None,
                 pool: BufferPool | None = None) -> None:  # fmt: skip
        self.segments, self.comm, self.phases = segments, comm, phases
        self.device, self.dtype, self.offload = device, dtype, offload
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        #: Elements of the units gathered or being gathered now.
        self.gathered_numel = 0
        self.pool = pool if pool is not None else BufferPool(device, dtype)
        host = torch.device("cpu")
        home = host if offload else device
        self._empty = torch.empty(0, device=device, dtype=dtype)
        self.units: dict[int, _Unit] = {}
        unit_of: dict[nn.Parameter, _Unit] = {}
        for seg in segments:
            # One tensor per unit, allocated as it is filled: the parts of a model built
            # under zero.Init are freed as their units take them (one buffer for every unit
            # would hold the model's parts twice at the start).
            seg.param_shard = torch.empty(seg.shard_numel, device=home, dtype=dtype,
                                          pin_memory=offload and device.type == "cuda")  # fmt: skip
            with torch.no_grad():
                self._fill_shard(seg)
            for s in seg.slots:
                s.param.data = self._empty
            unit = _Unit(seg)
            self.units[seg.index] = unit
            for s in seg.slots:
                unit_of[s.param] = unit
        # Each unit is gathered for its root module (the module holding its parameters, or
        # the block whose subtree they fill), and for any module outside that subtree that
        # uses one of its parameters (a weight tied to the LM head).
        rooted: dict[nn.Module, list[_Unit]] = {}
        inside: dict[_Unit, set[nn.Module]] = {}
        for seg in segments:
            unit = self.units[seg.index]
            root = roots[seg.index] if roots is not None else None
            if root is not None:
                rooted.setdefault(root, []).append(unit)
                inside[unit] = set(root.modules())
        self._module_units: dict[nn.Module, list[_Unit]] = {}
        self._hooks: list[Any] = []
        for m in module.modules():
            needed: list[_Unit] = list(rooted.get(m, ()))
            for p in m.parameters(recurse=False):
                u = unit_of.get(p)  # type: ignore[call-overload]
                if u is not None and u not in needed and m not in inside.get(u, ()):
                    needed.append(u)
            if needed:
                self._module_units[m] = needed
                self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(m.register_forward_hook(self._post_forward))
        for seg in segments:
            seg.param_shard_on_host = offload
        # The schedule every rank walks (see "One order on every rank" in the module
        # docstring): units by index in forward, the reverse in backward.
        forward = [self.units[seg.index] for seg in sorted(segments, key=lambda s: s.index)]
        self._schedule = {"forward": forward, "backward": forward[::-1]}
        self._place = {mode: {u: i for i, u in enumerate(units)}
                       for mode, units in self._schedule.items()}  # fmt: skip
        self._cursor = {"forward": 0, "backward": 0}  # schedule positions passed this pass
        #: Told of each unit the backward's schedule reaches (stage 3's gradient reducer).
        self.on_backward_gather: Callable[[Segment], None] | None = None
        #: Elements of the forward schedule before each position.
        self._schedule_prefix = list(
            itertools.accumulate((u.seg.numel for u in forward), initial=0)
        )
        # The first forward's uses, and the schedule position at each: where a unit is
        # needed again (reuse).
        self._recorded = False
        self._uses: list[tuple[_Unit, int]] = []
        self._use_cursor = 0
        self._forward_uses: dict[_Unit, list[int]] = {}

    def _fill_shard(self, seg: Segment) -> None:
        """This rank's part of the unit, parameter by parameter: the slice of each that
        falls in it. A parameter built under zero.Init (zero_init.py) is all-gathered
        alone into a transient buffer (every rank's part of the unit takes slices of
        other ranks' parts), so the peak is one parameter, never the whole model."""
        lo_unit, hi_unit = seg.shard_offset, seg.shard_offset + seg.shard_numel
        seg.param_shard.zero_()  # the padding
        for s in seg.slots:
            values = flat_values(s.param, self.comm, self.device)
            lo, hi = max(s.offset, lo_unit), min(s.offset + s.numel, hi_unit)
            if lo < hi:
                seg.param_shard[lo - lo_unit : hi - lo_unit].copy_(
                    values[lo - s.offset : hi - s.offset])  # fmt: skip
            del values

    # -- hooks -----------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, _args: Any) -> None:
        units = self._module_units[module]
        for u in units:
            u.users += 1
        self._fetch(units, "forward")

    def _post_forward(self, module: nn.Module, _args: Any, output: Any) -> None:
        # The management after a module's forward (the hook that gathers its units again for
        # backward, their release) is parameter management like the gather before it, and is
        # announced as param_gather: not the module's compute (the step's parts, and the
        # doctor's measure of stage 3's path, which zerowatch/rehearse counts alike).
        with self.phases.phase("param_gather"):
            if torch.is_grad_enabled():
                leaves, _ = tree_flatten(output)
                tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, partial(self._pre_backward, module), mode="any")  # fmt: skip
            for u in self._module_units[module]:
                u.users -= 1
                if u.users == 0 and not self._reused_soon(u):
                    self.release(u.seg)

    def _pre_backward(self, module: nn.Module, *_grads: Any) -> None:
        self._fetch(self._module_units[module], "backward")

    # -- gather / release ------------------------------------------------------------------

    def _fetch(self, units: list[_Unit], mode: str) -> None:
        """Make `units` gathered: walk the schedule up to them (gathering what it passes),
        then issue the next ones' gathers ahead (prefetch)."""
        with self.phases.phase("param_gather"):
            place, schedule = self._place[mode], self._schedule[mode]
            for u in sorted(units, key=place.__getitem__):
                at = place[u]
                if at >= self._cursor[mode]:
                    for passed in schedule[self._cursor[mode] : at + 1]:
                        self._pass(passed, mode)
                    self._cursor[mode] = at + 1
                elif u.state is UnitState.SHARDED:  # needed again: outside the schedule
                    self._start(u)
            self._prefetch(mode)
            if mode == "forward":
                self._note_use(units)
            for u in units:
                self._wait(u)

    def _prefetch(self, mode: str) -> None:
        """Gather the units after the cursor, up to `prefetch_numel` elements, while the
        schedule's window from the unit just reached stays within `max_live_numel`. Both
        are counted along the schedule, not from what this rank holds, so every rank
        prefetches the same units."""
        schedule, cursor = self._schedule[mode], self._cursor[mode]
        budget = self.prefetch_numel
        window = schedule[cursor - 1].seg.numel if cursor > 0 else 0
        for nxt in itertools.islice(schedule, cursor, None):
            if budget <= 0:
                break
            budget -= nxt.seg.numel
            window += nxt.seg.numel
            if nxt.state is UnitState.SHARDED and window > self.max_live_numel:
                break
            self._pass(nxt, mode)

    def _pass(self, u: _Unit, mode: str) -> None:
        """The schedule reaches `u` (needed, passed on the way, or prefetched): gathered
        if it is not, and in backward its gradient reducer told (`on_backward_gather`)."""
        if u.state is UnitState.SHARDED:
            self._start(u)
        if mode == "backward" and self.on_backward_gather is not None:
            self.on_backward_gather(u.seg)

    def _note_use(self, units: list[_Unit]) -> None:
        """Record the first forward's uses (with the schedule position of each); in later
        forwards, follow them."""
        if not self._recorded:
            self._uses.extend((u, self._cursor["forward"]) for u in units)
            return
        for u in units:  # to just past the next recorded use of u (a branch may skip some)
            uses = self._forward_uses.get(u, [])
            i = bisect.bisect_left(uses, self._use_cursor)
            if i < len(uses):
                self._use_cursor = uses[i] + 1

    def _reused_soon(self, unit: _Unit) -> bool:
        """Whether the recorded forward needs `unit` again before the schedule has passed
        `max_reuse_numel` more elements. Counted along the schedule, so every rank that
        needs it again decides alike."""
        if self.max_reuse_numel <= 0 or not self._recorded:
            return False
        uses = self._forward_uses.get(unit, [])
        i = bisect.bisect_left(uses, self._use_cursor)
        if i == len(uses):
            return False
        then = self._uses[uses[i]][1]
        now = self._cursor["forward"]
        between = self._schedule_prefix[then] - self._schedule_prefix[min(now, then)]
        return between <= self.max_reuse_numel

    def hold(self, params: list[nn.Parameter]) -> list[_Unit]:
        """Gather the units holding `params` for use outside a pass (GatheredParameters),
        until `unhold`; the hooks leave them gathered meanwhile."""
        ids = {id(p) for p in params}
        units = [u for u in self.units.values() if any(id(s.param) in ids for s in u.seg.slots)]
        for u in units:
            u.users += 1
            if u.state is UnitState.SHARDED:
                self._start(u, purpose="other")
        for u in units:
            self._wait(u)
        return units

    def unhold(self, units: list[_Unit]) -> None:
        for u in units:
            u.users -= 1
            if u.users == 0:
                self.release(u.seg)
        self.pool.clear()

    def _start(self, u: _Unit, purpose: str = "param_fetch") -> None:
        src = u.seg.param_shard
        if self.offload:
            nbytes = src.numel() * src.element_size()
            with self.phases.offload("h2d", nbytes):
                copy = self.pool.take(src.numel())
                copy.copy_(src, non_blocking=True)
                src = copy
        u.src = src
        u.full = self.pool.take(u.seg.padded)
        u.handle = self.comm.all_gather(u.full, src, purpose=purpose, async_op=True)
        u.state = UnitState.GATHERING
        self.gathered_numel += u.seg.numel

    def _wait(self, u: _Unit) -> None:
        if u.state is not UnitState.GATHERING:
            return
        assert u.handle is not None and u.full is not None
        u.handle.wait()
        for s, view in zip(u.seg.slots, u.seg.views(u.full), strict=True):
            s.param.data = view
        if self.offload and u.src is not None:  # the device copy of the shard, sent
            self.pool.give(u.src)
        u.handle, u.src = None, None
        u.state = UnitState.GATHERED

    def release(self, seg: Segment) -> None:
        """Drop the gathered copy of `seg`'s unit (its parameters go back to empty)."""
        u = self.units[seg.index]
        if u.state is UnitState.SHARDED:
            return
        self._wait(u)
        for s in seg.slots:
            s.param.data = self._empty
        full, u.full = u.full, None
        if full is not None:
            self.pool.give(full)  # (kept by the pool only if no saved view still uses it)
        u.state = UnitState.SHARDED
        self.gathered_numel -= u.seg.numel

    # -- pass boundaries -------------------------------------------------------------------

    def begin_pass(self, mode: str) -> None:
        self._cursor[mode] = 0
        if mode == "forward":
            self._use_cursor = 0

    def end_pass(self, mode: str) -> None:
        """After a forward or backward: release what prefetch gathered and nobody used
        (parameter management: announced as param_gather, as in `_post_forward`)."""
        with self.phases.phase("param_gather"):
            # The rest of the schedule: what this rank's pass did not reach, its peers' did.
            for u in self._schedule[mode][self._cursor[mode] :]:
                self._pass(u, mode)
            self._cursor[mode] = len(self._schedule[mode])
            for u in self.units.values():
                if u.users == 0:
                    self.release(u.seg)
            if mode == "backward" or not torch.is_grad_enabled():
                self.pool.clear()  # between steps the engine holds its model states alone
        if mode == "forward" and self._uses and not self._recorded:
            self._recorded = True
            for i, (u, _) in enumerate(self._uses):
                self._forward_uses.setdefault(u, []).append(i)

    def after_step(self) -> None:
        return

    # -- whole values (checkpoints, consolidated weights) ----------------------------------

    def param_tensors(self) -> list[torch.Tensor]:
        return [seg.param_shard for seg in self.segments]

    def remove_hooks(self) -> None:
        """Take the forward hooks off the model's modules (ZeroEngine.destroy)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


__all__ = ["ShardedParams", "UnitState"]
