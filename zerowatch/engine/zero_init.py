"""Building a model already partitioned (DeepSpeed's `deepspeed.zero.Init`), and loading
full weights into a partitioned engine one parameter at a time.

    torch.manual_seed(0)                          # not needed for agreement (see below)
    with zerowatch.zero.Init(config_dict_or_path=ds_config):
        model = MyModel()                         # one parameter whole at a time, at most
    engine, *_ = zerowatch.initialize(model=model, config=ds_config)      # stage 3
    zerowatch.zero.load_full_state_dict(engine, "pytorch_model.bin")      # optional

While an `Init` is active, every `nn.Module` that is constructed has its own parameters
(`recurse=False`) partitioned as soon as its `__init__` returns (the most derived class's:
a module's children are built, and partitioned, inside its `__init__`, before it). The
hook is DeepSpeed's: the `__init__` of every `nn.Module` subclass, and of any subclass
defined inside the block, is wrapped for the block's life and restored after it.

Partitioning one parameter of Ψ_p elements on N ranks:

    flat   [ p ......................................... | pad ]   padded to a multiple of N
    shards [  rank 0  |  rank 1  |  ...   |  rank N-1          ]   ceil(Ψ_p / N) each

1. the module's `__init__` computed the whole value (one parameter, transiently; on the
   meta device nothing is computed and the part is a meta tensor too);
2. rank 0's value is broadcast to every rank through `comm.Comm` (DeepSpeed does the
   same), so the ranks agree whatever their random state;
3. the rank keeps part r, in `dtype` (else the config's precision; integer parameters keep
   theirs), on the host with `offload_param`, else on the training device;
4. the parameter's data becomes a placeholder of its full shape that holds one element
   (a stride-0 view of one NaN): shapes, `numel()` and the engine's layout code see the
   real parameter, and a forward outside the engine gives NaN rather than quiet numbers.

The parts are kept in a table keyed by the parameter (nothing is hung on it). In-place
initialisation of a parameter after its module was built (Hugging Face's `post_init`, a
parent re-initialising its children) is applied to the whole parameter, gathered for that
write, and rank 0's result is kept (`_Writes`); a write to part of one is dropped, as
DeepSpeed drops every such write (it writes to an empty tensor). Load trained weights with
`load_full_state_dict`; change parts of parameters with `GatheredParameters`, which works
before `initialize` too (`hold_whole` / `release_whole`). On a GPU the modules are built
there inside the block, unless the script chose a device itself (`torch.device("meta")`).

`initialize` (stage 3 only; a clear ConfigError otherwise) adopts the parts without making
the model whole: a stage-3 unit lays its parameters out back to back, so rank r's part of
the unit is not made of the parameters' parts r; `ShardedParams` all-gathers one parameter
at a time into a transient buffer and keeps the slice that falls in its part of the unit
(`flat_values`): the peak is one parameter, not the model. Parameters the engine keeps
whole (frozen ones, those under `stage3_param_persistence_threshold`) are gathered whole
(`materialise`). Buffers are not partitioned: the engine broadcasts them from rank 0.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from zerowatch.config import ZeroWatchConfig, load_config
from zerowatch.engine.comm import Comm
from zerowatch.engine.hooks import ObserverRegistry
from zerowatch.engine.precision import DTYPES

if TYPE_CHECKING:  # pragma: no cover
    from zerowatch.engine.engine import ZeroEngine


@dataclass(eq=False)
class Partition:
    """This rank's part of one parameter built under `Init`."""

    shard: torch.Tensor  # (ceil(numel / world_size),) elements [rank * len, (rank+1) * len)
    shape: torch.Size
    world_size: int
    rank: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


#: Parameter -> its part, for the parameters partitioned by an Init and not yet adopted.
_PARTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: data_ptr of a placeholder -> its parameter (weakly): in-place writes find their target.
_BY_PTR: dict[int, weakref.ref[nn.Parameter]] = {}


def partition_of(param: torch.Tensor) -> Partition | None:
    """The part this rank keeps of `param`, if it was partitioned by an `Init`."""
    return _PARTS.get(param)  # type: ignore[no-any-return]


def partitioned(module: nn.Module) -> list[nn.Parameter]:
    """The module's parameters that an `Init` partitioned (each once)."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if id(p) not in seen and p in _PARTS:
            seen.add(id(p))
            out.append(p)
    return out


def placeholder(shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` that holds one element (NaN where the dtype has it); on the
    meta device, a meta tensor (which holds nothing)."""
    if torch.device(device).type == "meta":
        return torch.empty(shape, device="meta", dtype=dtype)
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((), fill, device=device, dtype=dtype).expand(shape)


def _owner(t: torch.Tensor) -> nn.Parameter | None:
    """The partitioned parameter whose placeholder `t` views, if any."""
    if t.is_meta:  # every meta tensor's data_ptr is 0; writes to them do nothing anyway
        return None
    ref = _BY_PTR.get(t.data_ptr())
    p = ref() if ref is not None else None
    if p is None or p not in _PARTS or p.data_ptr() != t.data_ptr():
        return None
    return p


#: In-place methods that change a tensor's flags or metadata, not its values: they act on
#: the parameter itself (the placeholder), as without Init.
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "detach_",
                         "rename_", "_fix_weakref"})  # fmt: skip


class _Writes(TorchFunctionMode):
    """In-place writes to a placeholder while an Init runs (a parent initialising its
    children, Hugging Face's `post_init`): applied to the whole parameter, gathered for
    the write, and repartitioned from rank 0's result. A write to part of a placeholder
    (`weight[i].zero_()`, `weight[i] = x`) is dropped; flags (`requires_grad_`) are set
    on the parameter."""

    def __init__(self, init: Init) -> None:
        super().__init__()
        self.init = init

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__setitem__":  # `weight[i] = x`, `weight.data[:] = x`: part of it
            target = args[0] if args else None
            if isinstance(target, torch.Tensor) and _owner(target) is not None:
                return None
        elif name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES:
            # A Tensor method gets the tensor first; torch.nn.init passes it as `tensor=`.
            rest, options = (args[1:], kwargs) if args else \
                ((), {k: v for k, v in kwargs.items() if k != "tensor"})  # fmt: skip
            target = args[0] if args else kwargs.get("tensor")
            p = _owner(target) if isinstance(target, torch.Tensor) else None
            if p is not None:
                if target.shape == p.shape:
                    self.init._write(p, func, rest, options)
                return target
        return func(*args, **kwargs)


class Init:
    """Build the model partitioned; see the module docstring.

    Args:
        module: accepted for DeepSpeed's signature (partitioning an already built model is
            what `initialize` does).
        config_dict_or_path: the DeepSpeed config (dict or JSON path): its precision gives
            the parts' dtype, `zero_optimization.offload_param` puts them on the host.
        enabled: False makes the block do nothing.
        dtype: the parts' dtype (wins over the config's precision).
        config: DeepSpeed's older name for `config_dict_or_path`.
        remote_device: "cpu" keeps the parts on the host (as `offload_param` does).
        **kwargs: DeepSpeed's other arguments (data_parallel_group, pin_memory,
            mem_efficient_linear, mpu, ...), accepted and not needed.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None,
                 **kwargs: Any) -> None:  # fmt: skip
        del module, data_parallel_group, mem_efficient_linear, pin_memory, mpu
        del kwargs
        self.enabled = enabled
        self.source = config_dict_or_path if config_dict_or_path is not None else config
        self.dtype = dtype
        self.remote_device = str(remote_device) if remote_device is not None else None
        self._patched: list[tuple[type, Any]] = []
        self._depth: dict[int, int] = {}
        self._active = False

    # -- the context -----------------------------------------------------------------------

    def __enter__(self) -> Init:
        if not self.enabled or _ACTIVE:
            return self
        from zerowatch.engine.engine import pick_device

        self.comm = Comm(ObserverRegistry())
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.device = pick_device()
        offload = False
        if self.source is not None:
            cfg = self.source if isinstance(self.source, ZeroWatchConfig) else \
                load_config(self.source, world_size=self.world_size)  # fmt: skip
            offload = cfg.zero_optimization.offload_param.device == "cpu"
            self.dtype = self.dtype or DTYPES[cfg.precision]
        offload = offload or self.remote_device == "cpu"
        self.home = torch.device("cpu") if offload else self.device
        self._patch()
        self._writes = _Writes(self)
        self._writes.__enter__()
        # On a GPU, modules are built there (their initialisation is the GPU's work, the
        # broadcast goes straight over NCCL), unless the script chose a device (meta).
        self._on_device: Any = None
        if self.device.type == "cuda" and torch.get_default_device().type == "cpu":
            self._on_device = torch.device(self.device)
            self._on_device.__enter__()
        _ACTIVE.append(self)
        self._active = True
        return self

    def __exit__(self, *_: Any) -> None:
        if not self._active:
            return
        self._active = False
        _ACTIVE.remove(self)
        if self._on_device is not None:
            self._on_device.__exit__(None, None, None)
        self._writes.__exit__(None, None, None)
        _BY_PTR.clear()  # only writes inside the block are redirected
        for cls, original in reversed(self._patched):
            if original is None:
                delattr(cls, "__init_subclass__")
            else:
                cls.__init__ = original  # type: ignore[misc]
        self._patched = []

    # -- the hook --------------------------------------------------------------------------

    def _patch(self) -> None:
        """Wrap the `__init__` of every nn.Module subclass that defines one, and of the
        subclasses defined while the block runs."""
        stack: list[type] = [nn.Module]
        seen: set[type] = set()
        while stack:
            cls = stack.pop()
            if cls in seen:
                continue
            seen.add(cls)
            self._wrap_init(cls)
            stack.extend(cls.__subclasses__())
        init = self

        own = nn.Module.__dict__.get("__init_subclass__")

        def __init_subclass__(cls: type, **kwargs: Any) -> None:
            if own is not None:
                own.__get__(None, cls)(**kwargs)
            elif kwargs:  # object's own, which takes none
                raise TypeError(f"{cls.__name__}.__init_subclass__() takes no keyword arguments")
            init._wrap_init(cls)

        nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
        self._patched.append((nn.Module, own))

    def _wrap_init(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_zerowatch_init", False):
            return

        @functools.wraps(original)
        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            depth = self._depth.get(key, 0)
            self._depth[key] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                if depth:
                    self._depth[key] = depth
                else:
                    del self._depth[key]
            if depth == 0 and self._active:  # the outermost __init__ of this module ended
                self._partition(module)

        __init__._zerowatch_init = True  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[misc]
        self._patched.append((cls, original))

    def _partition(self, module: nn.Module) -> None:
        for p in module._parameters.values():
            if p is not None and p not in _PARTS:
                self._partition_one(p)

    def _partition_one(self, p: nn.Parameter) -> None:
        n, r = self.world_size, self.rank
        numel = p.numel()
        part = math.ceil(numel / n)
        dtype = self.dtype if self.dtype is not None and p.is_floating_point() else p.dtype
        lo, hi = min(r * part, numel), min((r + 1) * part, numel)
        with torch.no_grad():
            if p.is_meta:
                shard = torch.empty(part, device="meta", dtype=dtype)
            else:
                whole = p.data.reshape(-1)
                if n > 1:  # every rank starts from rank 0's values (written over p's own)
                    whole = whole.to(self.device)
                    self.comm.broadcast(whole, src=0, purpose="other")
                shard = torch.zeros(part, device=self.home, dtype=dtype)
                shard[: hi - lo].copy_(whole[lo:hi])
                del whole
            p.data = placeholder(p.shape, p.device, dtype)  # the model reports the parts' dtype
        _PARTS[p] = Partition(shard, p.shape, n, r)
        if not p.is_meta:
            _BY_PTR[p.data_ptr()] = weakref.ref(p)

    def _write(self, p: nn.Parameter, func: Any, args: Any, kwargs: Any) -> None:
        """Apply an in-place write to the whole of `p` (gathered), keep rank 0's result."""
        part = _PARTS[p]
        with torch.no_grad():
            whole = _gathered(part, self.comm, self.device)
            func(whole[: part.numel].view(part.shape), *args, **kwargs)
            if part.world_size > 1:
                self.comm.broadcast(whole, src=0, purpose="other")
            lo = min(part.rank * part.shard.numel(), part.numel)
            hi = min(lo + part.shard.numel(), part.numel)
            part.shard[: hi - lo].copy_(whole[lo:hi])


#: The Init blocks running now (the outermost partitions; inner ones do nothing).
_ACTIVE: list[Init] = []


# -- what initialize does with the parts -------------------------------------------------------


def _gathered(part: Partition, comm: Comm, device: torch.device) -> torch.Tensor:
    """The whole flat parameter (padded), all-gathered from every rank's part."""
    if part.world_size != comm.world_size:
        raise ValueError(f"model: built under zerowatch.zero.Init on {part.world_size} ranks, "
                         f"the engine runs on {comm.world_size}")  # fmt: skip
    shard = part.shard.to(device)
    out = torch.empty(shard.numel() * part.world_size, device=device, dtype=shard.dtype)
    comm.all_gather(out, shard, purpose="other").wait()
    return out


def flat_values(param: nn.Parameter, comm: Comm, device: torch.device) -> torch.Tensor:
    """The whole value of `param`, flat: its data, or (built under Init) gathered from the
    ranks' parts into a transient buffer, the part forgotten. A collective for a
    partitioned parameter: every rank calls it for the same parameters in the same order."""
    part = _PARTS.pop(param, None)
    if part is None:
        return param.data.reshape(-1)
    return _gathered(part, comm, device)[: part.numel]


def _comm() -> tuple[Comm, torch.device]:
    from zerowatch.engine.engine import pick_device

    return Comm(ObserverRegistry()), pick_device()


def hold_whole(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Make the partitioned parameters among `params` whole on every rank (their data, on
    the training device) until `release_whole`: `GatheredParameters` on a model built
    under Init that no engine has adopted yet. A collective; the parameters held."""
    held = [p for p in dict.fromkeys(params) if p in _PARTS]
    if held:
        comm, device = _comm()
        with torch.no_grad():
            for p in held:
                part = _PARTS[p]
                p.data = _gathered(part, comm, device)[: part.numel].view(part.shape)
    return held


def release_whole(held: list[nn.Parameter], modifier_rank: int | None) -> None:
    """Back to parts; with `modifier_rank`, that rank's values (broadcast) become them."""
    if not held:
        return
    comm, device = _comm()
    with torch.no_grad():
        for p in held:
            part = _PARTS[p]
            if modifier_rank is not None:
                whole = p.data.reshape(-1).to(device, copy=True)
                if comm.world_size > 1:
                    comm.broadcast(whole, src=modifier_rank, purpose="other")
                lo = min(part.rank * part.shard.numel(), part.numel)
                hi = min(lo + part.shard.numel(), part.numel)
                part.shard[: hi - lo].copy_(whole[lo:hi])
            p.data = placeholder(part.shape, p.device, p.dtype)
            if _ACTIVE:  # inside an Init block: its writes find this placeholder again
                _BY_PTR[p.data_ptr()] = weakref.ref(p)


def materialise(param: nn.Parameter, comm: Comm, device: torch.device) -> None:
    """Make a partitioned parameter whole again on every rank (its data, on `device`)."""
    values = flat_values(param, comm, device)
    param.data = values.clone().view(param.shape)


def move(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)` for a model with partitioned parameters: their placeholders move
    (they hold nothing), every other parameter and buffer moves as `to` moves it."""
    for m in module.modules():
        for p in m._parameters.values():
            if p is None:
                continue
            if p in _PARTS:
                p.data = placeholder(p.shape, device, p.dtype)
            elif p.device != device:
                p.data = p.data.to(device)
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)


# -- loading full weights into a partitioned engine --------------------------------------------


class _Source:
    """Tensors by name from a state dict, a torch.save'd file (memory-mapped: only the
    pages of the slices read come in) or a .safetensors file (rows read on demand)."""

    def __init__(self, source: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> None:
        self._safe: Any = None
        if isinstance(source, Mapping):
            self._dict: Mapping[str, torch.Tensor] = source
        elif Path(source).suffix == ".safetensors":
            from safetensors import safe_open

            self._safe = safe_open(os.fspath(source), framework="pt", device="cpu")
            self._dict = {}
        else:
            self._dict = torch.load(source, map_location="cpu", mmap=True, weights_only=True)

    def keys(self) -> list[str]:
        return list(self._safe.keys()) if self._safe is not None else list(self._dict)

    def flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the tensor, flattened."""
        if self._safe is None:
            return self._dict[name].reshape(-1)[lo:hi]
        piece = self._safe.get_slice(name)
        shape = piece.get_shape()
        if len(shape) < 2:
            return self._safe.get_tensor(name).reshape(-1)[lo:hi]
        row = math.prod(shape[1:])
        first, last = lo // row, math.ceil(hi / row)
        rows = piece[first:last].reshape(-1)
        return rows[lo - first * row : hi - first * row]

    def whole(self, name: str) -> torch.Tensor:
        return self._safe.get_tensor(name) if self._safe is not None else self._dict[name]


def load_full_state_dict(engine: ZeroEngine,
                         source: Mapping[str, torch.Tensor] | str | os.PathLike[str], *,
                         strict: bool = True) -> None:  # fmt: skip
    """Load full weights (a plain model's `state_dict()`) into a running engine, taking
    only this rank's slice of each trained parameter: its parameter part and fp32 master.

    Nothing is communicated (every rank reads the source) and nothing whole is built: from
    a file, a torch.save'd state dict is memory-mapped and a .safetensors file is read by
    rows, so the pages of this rank's slices are what is read. Buffers and parameters the
    engine keeps whole on every rank are copied whole. Call it before training (the
    optimizer's state is not touched).

    Args:
        engine: the engine (any stage).
        source: a state dict, or the path of a torch.save'd one or of a .safetensors file.
        strict: raise when a key is missing or unexpected (else load what matches).

    Raises:
        KeyError: with strict, naming the first missing or unexpected key.
    """
    src = _Source(source)
    current = engine.module.state_dict(keep_vars=True)
    have = set(src.keys())
    if strict:
        missing = [k for k in current if k not in have]
        unexpected = sorted(have - set(current))
        if missing or unexpected:
            what = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
            raise KeyError(f"load_full_state_dict: {what} ({len(missing)} missing, "
                           f"{len(unexpected)} unexpected keys)")  # fmt: skip
    index = engine.slot_index()
    with torch.no_grad():
        for name, t in current.items():
            if name not in have:
                continue
            entry = index.get(id(t))
            if entry is None:  # a buffer or frozen parameter, whole on every rank
                t.copy_(src.whole(name).view_as(t))
                continue
            seg, slot, master = entry
            if t.numel() == slot.numel:  # whole on this rank too (stages 0-2, persistent)
                t.copy_(src.whole(name).view_as(t))
            lo = max(slot.offset, seg.shard_offset)
            hi = min(slot.offset + slot.numel, seg.shard_offset + seg.shard_numel)
            if lo >= hi:
                continue
            values = src.flat(name, lo - slot.offset, hi - slot.offset)
            at = lo - seg.shard_offset
            seg.param_shard[at : at + hi - lo].copy_(values)
            master.param[at : at + hi - lo].copy_(values)


__all__ = [
    "Init",
    "Partition",
    "flat_values",
    "hold_whole",
    "load_full_state_dict",
    "materialise",
    "move",
    "partition_of",
    "partitioned",
    "placeholder",
    "release_whole",
]
