"""See a foreign engine's collectives by wrapping torch.distributed for the life of a run.

The bundled engine reports its collectives itself (engine/comm.py). DeepSpeed, FSDP2 and
DDP (through `allreduce_seen`, the communication hook the DDP adapter gives it) do not, and zerowatch does not edit them; instead, while a run is attached, the collective
functions of `torch.distributed` are replaced by thin wrappers that time each call, size
it the nccl-tests way and hand a `CollectiveRecord` to whoever listens. Closing the run
puts the original functions back. This is the one module besides engine/comm.py that
touches torch.distributed's collective functions.

What is wrapped, and where: each name below in both `torch.distributed` and
`torch.distributed.distributed_c10d` (code calls either; the deprecated spellings call
the new ones through the latter's globals). Engines that captured a function object before
the run began (DeepSpeed's comm backend keeps `all_gather_into_tensor` and
`reduce_scatter_tensor` from its start-up) still arrive here, because in torch 2.13 those
call `all_gather_single` / `reduce_scatter_single` by global name. A call made from inside
another wrapped call (the deprecated spelling calling the new one, `broadcast_object_list`
calling `broadcast`) is counted once, by the outermost wrapper.

Sizes (nccl-tests "size"): all-gather output, reduce-scatter input, all-reduce buffer,
broadcast buffer; list forms sum their tensors.

Asynchronous calls return a `TimedWork` (a `torch.distributed.Work` subclass, so engines
that check `isinstance(work, Work)` still wait on it): the time the training thread spends
inside `wait()` is the exposed communication time, and the call's end is read at that wait
(see `TimedWork` for why not from a future callback). A synchronous call is all exposed.

The wrappers never wait on a work themselves and never make a stream wait: the only
`wait()` is the engine's own, passed on by `TimedWork.wait`. From torch 2.8 a NCCL work
keeps its tensors alive until `wait()`, and `wait()` releases them after making only the
current stream wait, so a wait of the agent's (on a stream of its own, at the launch) would
let the caching allocator hand an input the engine has already dropped to the compute
stream while NCCL still reads it (docs/gpu.md, "The agent and a collective's lifetime").
On CUDA every event is recorded on a stream the engine uses, when the engine uses it.

The wrappers are process-wide: with two runs open in one process, both see every
collective. Code that bound a function before the run began (`from torch.distributed
import all_reduce`) keeps calling the original and is not seen; DeepSpeed and FSDP2 look
the functions up on the module at each call. An async call is reported when the engine
waits on its work (`work.wait()`, as DeepSpeed and FSDP2 do); work only ever waited on
through its future is not reported.

Each call is numbered per process group (1, 2, ... in the order the rank issues them, the
same on every rank while the ranks agree) and announced to the taps' `launch` before it is
issued, so the agent's flight recorder (agent/probes/flight.py) knows a collective that
never completes; its record carries the same (group, seq).

Not seen: DeepSpeed's shared-memory all-reduce (`deepspeed.comm.inference_all_reduce`,
used by AutoTP inference layers, not by ZeRO training), point-to-point sends, `reduce`,
`all_to_all` and `barrier` (none of them is in zerowatch's vocabulary of collectives).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from zerowatch.engine.hooks import CollectiveRecord

log = logging.getLogger("zerowatch.agent")

#: Decides a call's purpose from its op (the adapter knows the phase it is in).
Classifier = Callable[[str], str]
#: Receives each finished record (any thread).
Sink = Callable[[CollectiveRecord], None]


@dataclass(frozen=True)
class _Spec:
    """How to read one collective function's arguments."""

    op: str
    #: Positional parameter names, in order, as the function declares them.
    params: tuple[str, ...]
    #: The parameter whose tensor (or list of tensors) is the nccl-tests size.
    sized: str


_AG_OUT = ("output_tensor", "input_tensor", "group", "async_op")
_RS = ("output", "input", "op", "group", "async_op")

#: torch.distributed collective functions and how to size them.
SPECS: dict[str, _Spec] = {
    "all_gather_single": _Spec("all_gather", _AG_OUT, "output_tensor"),
    "all_gather_into_tensor": _Spec("all_gather", _AG_OUT, "output_tensor"),
    "_all_gather_base": _Spec("all_gather", _AG_OUT, "output_tensor"),
    "all_gather": _Spec(
        "all_gather", ("tensor_list", "tensor", "group", "async_op"), "tensor_list"
    ),
    "reduce_scatter_single": _Spec("reduce_scatter", _RS, "input"),
    "reduce_scatter_tensor": _Spec("reduce_scatter", _RS, "input"),
    "_reduce_scatter_base": _Spec("reduce_scatter", _RS, "input"),
    "reduce_scatter": _Spec(
        "reduce_scatter", ("output", "input_list", "op", "group", "async_op"), "input_list"
    ),
    "all_reduce": _Spec("all_reduce", ("tensor", "op", "group", "async_op"), "tensor"),
    "all_reduce_coalesced": _Spec("all_reduce", ("tensors", "op", "group", "async_op"), "tensors"),
    "broadcast": _Spec("broadcast", ("tensor", "src", "group", "async_op"), "tensor"),
}

#: Functions whose inner collectives must not be counted (they are not the engine's).
_OPAQUE = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
           "barrier", "monitored_barrier")  # fmt: skip

_NAMESPACES = (dist, c10d)

#: What a call inside torch's `_coalescing_manager` returns: the op is only queued, and
#: issued with the others at the block's end. Such calls are counted (their bytes) but
#: their latency is just the queueing, and their work is handed back untouched.
_DEFERRED: Any = getattr(c10d, "_IllegalWork", ())


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    """The argument at position `i` named `name`, given either way (None if absent)."""
    return args[i] if len(args) > i else kwargs.get(name)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel()) * int(value.element_size())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class _State(threading.local):
    depth = 0


_local = _State()


class _WorldSizes:
    """Process-group sizes, looked up once per group while the wrappers are installed
    (forgotten at uninstall: the default group of a later run may have another size).
    Each group is held with its size, so that its id cannot be reused by a new group."""

    def __init__(self) -> None:
        self._by_group: dict[int, tuple[Any, int]] = {}

    def __call__(self, group: Any) -> int:
        found = self._by_group.get(id(group))
        if found is None:
            found = self._by_group[id(group)] = (group, int(dist.get_world_size(group)))
        return found[1]

    def clear(self) -> None:
        self._by_group.clear()


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class TimedWork(dist.Work):
    """An async collective's work, timed at `wait()`: its latency ends when the work is
    seen complete, and the time blocked inside `wait()` is its exposed time.

    Completion is read at the wait, not from a future callback: on gloo a Python callback
    on the work's future costs about 0.1 ms of CPU per call (measured: a stage-3 DeepSpeed
    step spent 4-6% more CPU with callbacks, 0-3% without), more than the agent's budget
    at stage 3's call rate. So when the work is still running at the wait, its end is when
    `wait()` returns (exact); when it has already finished, its end is the moment of the
    wait, an upper bound (and nothing was exposed). On CUDA, as in the bundled engine
    (docs/timing.md): an event on the launching stream at the launch and two on the
    waiting stream around the engine's `wait()`, which this passes on unchanged (the only
    wait the work ever sees); the latency from the first to the last, the exposed time
    between the last two; all read a step later.

    It holds the engine's work and nothing else of the collective's: the work's tensors
    live as long as the engine keeps this object (as they would with the work itself) and
    the records hold events only.
    """

    def __init__(self, inner: Any, hub: _Hub, op: str, nbytes: int, world: int, start: float,
                 purpose: str, cuda_launched: Any, group: str = "", seq: int = 0) -> None:  # fmt: skip
        super().__init__()
        self._group, self._seq = group, seq
        self._inner = inner
        self._hub = hub
        self._op, self._nbytes, self._world, self._start = op, nbytes, world, start
        self._purpose = purpose
        #: On CUDA, the event recorded on the launching stream at the launch.
        self._cuda = cuda_launched
        self._waited = False

    def wait(self, timeout: Any = None) -> bool:
        if self._waited:
            return True
        before = None
        if self._cuda is not None:
            before = _cuda_event()
            before.record()
        t0 = time.perf_counter()
        done_before = self._cuda is None and bool(self._inner.is_completed())
        result = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        t1 = time.perf_counter()
        self._waited = True
        cuda_events = cuda_exposed = None
        if before is not None:
            after = _cuda_event()
            after.record()
            cuda_events, cuda_exposed = (self._cuda, after), (before, after)
        end = t0 if done_before else t1
        try:
            self._hub.emit(self._op, self._purpose, self._nbytes, self._world, self._start, end,
                           True, t1 - t0, cuda_events, cuda_exposed, self._group,
                           self._seq)  # fmt: skip
        except Exception:
            self._hub._error(self._op)
        return bool(result) if result is not None else True

    def completed(self) -> None:
        """Report the call as finished now, without waiting on it: for a callback on the
        work's future (DDP's communication hook), where the work is done and waiting on it
        from gloo's thread can block. None of its time was exposed. On CUDA the callback
        runs on the stream the future made wait for the collective (the hook's own
        `then`), so an event recorded there is the collective's end."""
        if self._waited:
            return
        self._waited = True
        cuda_events = None
        if self._cuda is not None:
            end = _cuda_event()
            end.record()
            cuda_events = (self._cuda, end)
        try:
            self._hub.emit(self._op, self._purpose, self._nbytes, self._world, self._start,
                           time.perf_counter(), True, 0.0, cuda_events, None, self._group,
                           self._seq)  # fmt: skip
        except Exception:
            self._hub._error(self._op)

    # Everything else is the inner work's.
    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> Any:
        return self._inner.get_future()

    def get_future_result(self) -> Any:
        return self._inner.get_future_result()


class _Hub:
    """The installed wrappers and the taps listening to them (one set per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taps: tuple[CollectiveTap, ...] = ()
        #: (namespace, name) -> (original, wrapper)
        self.installed: dict[tuple[Any, str], tuple[Any, Any]] = {}
        self.world = _WorldSizes()
        #: id(group) -> [its name, collectives issued on it, the group] while installed.
        self.seqs: dict[int, list[Any]] = {}
        self.errors = 0

    # -- reporting -------------------------------------------------------------------------

    def classify(self, op: str) -> str:
        taps = self.taps
        return taps[0].classify(op) if taps else "other"

    def emit(self, op: str, purpose: str, nbytes: int, world: int, start: float, end: float,
             async_op: bool, exposed: float, cuda_events: Any,
             cuda_exposed: Any = None, group: str = "", seq: int = 0) -> None:  # fmt: skip
        rec = CollectiveRecord(op=op, purpose=purpose, nbytes=nbytes, world_size=world,
                               start=start, end=end, async_op=async_op, exposed_s=exposed,
                               cuda_events=cuda_events, cuda_exposed=cuda_exposed,
                               group=group, seq=seq)  # fmt: skip
        for tap in self.taps:
            try:
                tap.sink(rec)
            except Exception:  # a listener must never break training
                self._error("sink")

    def launch(self, group: Any, op: str, sized: Any, start: float) -> tuple[str, int]:
        """Number the call on its group and announce it to the taps that listen for
        launches; returns (group name, seq)."""
        entry = self.seqs.get(id(group))
        if entry is None or entry[2] is not group:
            pg = group if group is not None else dist.group.WORLD
            entry = self.seqs[id(group)] = [str(getattr(pg, "group_name", "") or "0"), 0, group]
        entry[1] += 1
        name, seq = entry[0], entry[1]
        first = sized[0] if isinstance(sized, (list, tuple)) and sized else sized
        numel = sum(int(t.numel()) for t in sized) if isinstance(sized, (list, tuple)) else (
            int(sized.numel()) if isinstance(sized, torch.Tensor) else 0)  # fmt: skip
        dtype = first.dtype if isinstance(first, torch.Tensor) else None
        for tap in self.taps:
            if tap.launch is not None:
                try:
                    tap.launch(name, seq, op, numel, dtype, start)
                except Exception:  # a listener must never break training
                    self._error("launch")
        return name, seq

    def _error(self, where: str) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("zerowatch: collective wrapper failed in %s (counted, not raised)", where)

    # -- the wrappers ----------------------------------------------------------------------

    def wrap(self, orig: Callable[..., Any], spec: _Spec) -> Callable[..., Any]:
        hub = self
        i_group, i_async = spec.params.index("group"), spec.params.index("async_op")
        i_sized = spec.params.index(spec.sized)

        def collective(*args: Any, **kwargs: Any) -> Any:
            if _local.depth or not hub.taps:
                return orig(*args, **kwargs)
            try:
                group = _arg(args, kwargs, i_group, "group")
                world = hub.world(group)
                sized = _arg(args, kwargs, i_sized, spec.sized)
                nbytes = _nbytes(sized)
                async_op = bool(_arg(args, kwargs, i_async, "async_op"))
                purpose = hub.classify(spec.op)
                first = sized[0] if isinstance(sized, (list, tuple)) and sized else sized
                cuda = isinstance(first, torch.Tensor) and first.device.type == "cuda"
            except Exception:
                hub._error(spec.op)
                return orig(*args, **kwargs)
            if world <= 1:
                return orig(*args, **kwargs)
            cuda_start = None
            if cuda:
                cuda_start = _cuda_event()
                cuda_start.record()
            start = time.perf_counter()
            try:
                name, seq = hub.launch(group, spec.op, sized, start)
            except Exception:
                hub._error(spec.op)
                name, seq = "", 0
            _local.depth += 1
            try:
                work = orig(*args, **kwargs)
            finally:
                _local.depth -= 1
            end = time.perf_counter()
            try:
                if async_op and isinstance(work, dist.Work) and not isinstance(work, _DEFERRED):
                    return TimedWork(work, hub, spec.op, nbytes, world, start, purpose,
                                     cuda_start, name, seq)  # fmt: skip
                cuda_events = None
                if cuda_start is not None:
                    # Synchronous: the launching stream waited from the launch to the end.
                    end_ev = _cuda_event()
                    end_ev.record()
                    cuda_events = (cuda_start, end_ev)
                hub.emit(spec.op, purpose, nbytes, world, start, end, False, end - start,
                         cuda_events, cuda_events, name, seq)  # fmt: skip
            except Exception:
                hub._error(spec.op)
            return work

        collective.__name__ = getattr(orig, "__name__", spec.op)
        collective.__qualname__ = getattr(orig, "__qualname__", spec.op)
        collective.__doc__ = getattr(orig, "__doc__", None)
        collective.__wrapped__ = orig  # type: ignore[attr-defined]
        collective.__zerowatch__ = True  # type: ignore[attr-defined]
        return collective

    def opaque(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            _local.depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                _local.depth -= 1

        call.__name__ = getattr(orig, "__name__", "call")
        call.__qualname__ = getattr(orig, "__qualname__", "call")
        call.__doc__ = getattr(orig, "__doc__", None)
        call.__wrapped__ = orig  # type: ignore[attr-defined]
        call.__zerowatch__ = True  # type: ignore[attr-defined]
        return call

    def install(self) -> None:
        # One wrapper per original function, shared by both namespaces.
        made: dict[int, Any] = {}
        for ns in _NAMESPACES:
            for name in (*SPECS, *_OPAQUE):
                orig = getattr(ns, name, None)
                if orig is None or getattr(orig, "__zerowatch__", False):
                    continue
                wrapper = made.get(id(orig))
                if wrapper is None:
                    spec = SPECS.get(name)
                    wrapper = self.wrap(orig, spec) if spec else self.opaque(orig)
                    made[id(orig)] = wrapper
                setattr(ns, name, wrapper)
                self.installed[(ns, name)] = (orig, wrapper)

    def uninstall(self) -> None:
        for (ns, name), (orig, wrapper) in self.installed.items():
            if getattr(ns, name, None) is wrapper:
                setattr(ns, name, orig)
            else:  # someone wrapped over us: leave theirs, ours passes through when idle
                log.warning("zerowatch: torch.distributed.%s was replaced while wrapped; "
                            "leaving the replacement in place", name)  # fmt: skip
        self.installed.clear()
        self.world.clear()
        self.seqs.clear()

    def add(self, tap: CollectiveTap) -> None:
        with self.lock:
            if not self.taps:
                self.install()
            self.taps = (*self.taps, tap)

    def remove(self, tap: CollectiveTap) -> None:
        with self.lock:
            self.taps = tuple(t for t in self.taps if t is not tap)
            if not self.taps:
                self.uninstall()


_HUB = _Hub()


class CollectiveTap:
    """One listener on torch.distributed's collectives, from `open()` until `close()`.

    Args:
        classify: op -> purpose ("param_fetch", "grad_reduce", "optimizer_gather",
            "other"), asked on the calling thread at the time of the call.
        sink: receives each `CollectiveRecord` once the call has completed.
        launch: called with (group name, seq, op, elements, dtype, start) as each call is
            issued, before it can block (optional: the flight recorder's).
    """

    def __init__(self, classify: Classifier, sink: Sink,
                 launch: Callable[..., None] | None = None) -> None:  # fmt: skip
        self.classify = classify
        self.sink = sink
        self.launch = launch
        self._open = False

    def open(self) -> None:
        if not self._open:
            _HUB.add(self)
            self._open = True

    def close(self) -> None:
        if self._open:
            _HUB.remove(self)
            self._open = False

    @property
    def is_open(self) -> bool:
        return self._open


@contextmanager
def unobserved() -> Iterator[None]:
    """Collectives issued inside this block (the agent's own) are not recorded."""
    _local.depth += 1
    try:
        yield
    finally:
        _local.depth -= 1


def installed() -> bool:
    """Whether the wrappers are in place now."""
    return bool(_HUB.installed)


def allreduce_seen(process_group, bucket):  # type: ignore[no-untyped-def]
    """DDP's built-in gradient all-reduce as a DDP communication hook: average the bucket
    over the group through `torch.distributed.all_reduce`, which this module's wrappers
    time while a run is open (the DDP adapter registers it). The call is reported when its
    future completes (`TimedWork.completed`): DDP waits on the future, never on the work.

    Unannotated on purpose: DDP checks a hook's annotations against the real classes, and
    this module's annotations are strings.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)

    def done(_fut):  # type: ignore[no-untyped-def]
        completed = getattr(work, "completed", None)  # a TimedWork while a run is open
        if completed is not None:
            completed()
        return buffer

    return work.get_future().then(done)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """`obj` from rank `src` on every rank (one rank: `obj`); never recorded."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return obj
    box = [obj]
    with unobserved():
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order (one rank: `[obj]`); never recorded."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    with unobserved():
        dist.all_gather_object(out, obj, group=group)
    return out


__all__ = [
    "SPECS",
    "CollectiveTap",
    "TimedWork",
    "all_gather_object",
    "allreduce_seen",
    "broadcast_object",
    "installed",
    "unobserved",
]
