"""The one module that calls torch.distributed collectives.

Everything the engine sends between ranks goes through `Comm`: the ZeRO reducers and
parameter owners never touch `torch.distributed` themselves. That gives one place to

* tell observers (`hooks.ObserverRegistry`) about each collective as a `CollectiveRecord`
  with its nccl-tests size (all-gather output, reduce-scatter input, all-reduce buffer), its
  wall-clock start and end and, for asynchronous work, how long the training thread was
  actually blocked in `wait()` (the *exposed* communication time);
* time GPU collectives with CUDA events that are read later (never a synchronize per op),
  recorded only on the streams the engine itself uses: one on the launching stream at the
  launch and two on the waiting stream around the engine's own `wait()`; the latency runs
  from the first to the last, the exposed time between the last two (docs/timing.md). No
  other stream waits for the collective and nothing but the engine's `wait()` waits on its
  work: from torch 2.8 a NCCL work's `wait()` releases the tensors it kept alive
  (docs/gpu.md, "The agent and a collective's lifetime");
* make a one-rank job a no-op: with world size 1 nothing is sent and nothing is reported;
* number the collectives of each process group (1, 2, ... on every rank alike, whichever
  `Comm` issues them) and announce each one as it is issued, before it can block
  (`on_collective_launch`): the agent's flight recorder (agent/probes/flight.py) knows which
  collective a rank is stuck in, the one whose record never comes.

Asynchronous work returns a `Handle`. On the host (gloo) its completion time comes from the
work's future callback, so `end - start` is the real latency even when nobody waited for
it; `exposed_s` is only the time spent in `wait()`. On CUDA the record goes out at the
engine's `wait()`, with its events.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zerowatch.engine import launch
from zerowatch.engine.hooks import CollectiveRecord, ObserverRegistry

#: Seconds a collective may wait for a peer before the job fails (a dead rank must make the
#: others fail, not hang). Override with ZEROWATCH_COMM_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 1800.0
#: Entries torch's flight recorder keeps per process group when the job does not say.
FLIGHT_RECORDER_ENTRIES = 2000


def comm_timeout() -> timedelta:
    """The process-group timeout: ZEROWATCH_COMM_TIMEOUT_S, else 30 minutes."""
    raw = os.environ.get("ZEROWATCH_COMM_TIMEOUT_S")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError as e:
        raise ValueError(f"ZEROWATCH_COMM_TIMEOUT_S: expected seconds, got {raw!r}") from e
    return timedelta(seconds=seconds)


def init_distributed() -> None:
    """Join the job the launcher describes (engine/launch.py: torchrun, Open MPI or SLURM),
    if there is one and torch.distributed is not initialised yet; a plain `python train.py`
    runs as a single rank and joins nothing.

    With CUDA the group is "cpu:gloo,cuda:nccl" (NCCL for CUDA tensors, gloo for CPU ones,
    which a plain "nccl" group has no backend for: a script's own CPU collectives, the gloo
    ring) and this process's GPU is made current first; without CUDA it is gloo. The
    rendezvous is torch's env:// with the launcher's rank and size; a SLURM or Open MPI
    job's MASTER_ADDR and MASTER_PORT are put in os.environ for it when they are not there,
    and torch's flight recorder keeps `FLIGHT_RECORDER_ENTRIES` entries unless the job set
    `TORCH_FR_BUFFER_SIZE` itself.

    Raises:
        launch.LaunchError: the environment describes the job only in part.
    """
    if dist.is_initialized():
        return
    place = launch.placement()
    if place.world_size <= 1:
        return
    addr, port = launch.rendezvous(place)
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        launch.bind_device(place)
    if not any(v in os.environ for v in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        # torch's own flight recorder of the group's collectives (a ring of entries), which a
        # stalled rank's heartbeat carries (agent/heartbeat.py); read when the group is made.
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
                            init_method="env://", rank=place.rank,
                            world_size=place.world_size, timeout=comm_timeout())  # fmt: skip


def device_backends(group: Any = None) -> dict[str, str]:
    """{device type: backend name} of `group` (None: the default group), as torch records
    it: "nccl" -> {"cuda": "nccl"}, "gloo" -> {"cpu": "gloo", "cuda": "gloo"},
    "cpu:gloo,cuda:nccl" as written, and a group made with no backend gets the backend of
    the machine's accelerator only (torch 2.13: {"cuda": "nccl"} with CUDA)."""
    get_config = getattr(dist, "get_backend_config", None)
    if get_config is not None:
        config = str(get_config(group))
    else:  # older torch: the backend name alone
        name = str(dist.get_backend(group))
        devices = dist.Backend.backend_capability.get(name, ["cpu", "cuda"])
        config = name if ":" in name else ",".join(f"{d}:{name}" for d in devices)
    return dict(pair.split(":", 1) for pair in config.lower().split(",") if ":" in pair)


#: Backends that can take CUDA tensors but move them through host memory (gloo) or only in
#: CUDA-aware builds (MPI): a group that gives CUDA tensors to one trains on the CPU.
_HOST_STAGED = frozenset({"gloo", "mpi"})


def carries_cuda(group: Any = None) -> bool:
    """Whether `group` reduces CUDA tensors on the device: its CUDA backend is NCCL (or
    another device backend, e.g. torch's fake one in tests), not gloo or MPI."""
    backend = device_backends(group).get("cuda")
    return backend is not None and backend not in _HOST_STAGED


def _is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
        dst.copy_(src.view_as(dst))


class Handle:
    """An in-flight collective. `wait()` blocks until it is done and counts the blocked
    time as exposed; the record reaches observers when the work completes."""

    def __init__(self, comm: Comm, work: Any, op: str, purpose: str, nbytes: int, start: float,
                 cuda_launched: Any = None, seq: int = 0) -> None:  # fmt: skip
        self._comm = comm
        self._seq = seq
        self._work = work
        self._op, self._purpose, self._nbytes, self._start = op, purpose, nbytes, start
        #: On CUDA, the event recorded on the launching stream at the launch.
        self._cuda = cuda_launched
        self._end: float | None = None
        self._exposed = 0.0
        self._wait_start = start
        self._reported = False
        self._waited = False
        self._has_future = False
        self._lock = threading.Lock()
        # Not on CUDA: NCCL marks a work's future complete at the launch, and a callback on
        # it runs on a pool stream made to wait for the collective, which also records the
        # output's memory on that stream (a wait and a lifetime the engine did not ask for).
        if work is not None and cuda_launched is None:
            try:
                fut = work.get_future()
            except (RuntimeError, AttributeError):
                fut = None
            if fut is not None:
                self._has_future = True
                fut.add_done_callback(self._on_done)

    def _on_done(self, _fut: Any) -> None:
        # Runs on the backend's thread when the work completes.
        self._end = time.perf_counter()
        if self._waited:
            self._report()

    def wait(self) -> None:
        """Block until the collective has completed (idempotent)."""
        if self._waited:
            return
        if self._cuda is not None and self._work is not None:
            self._wait_cuda()
            return
        t0 = time.perf_counter()
        if self._work is not None:
            self._work.wait()
            self._work = None  # hold no backend object past completion
        t1 = time.perf_counter()
        self._exposed = t1 - t0
        self._wait_start = t0
        if self._end is None and not self._has_future:
            self._end = t1
        self._waited = True
        if self._end is not None:
            self._report()

    def _wait_cuda(self) -> None:
        """The engine's wait: the current stream waits for the collective (NCCL: the host
        does not), bracketed by events on that stream. The one after it is the
        collective's end as the engine sees it: exact when the stream stalled there, an
        upper bound when the collective had finished before the stream got there."""
        before = _cuda_event()
        before.record()
        t0 = time.perf_counter()
        self._work.wait()
        self._work = None  # (the work's tensors are the engine's from here on)
        t1 = time.perf_counter()
        after = _cuda_event()
        after.record()
        self._exposed, self._wait_start, self._end, self._waited = t1 - t0, t0, t1, True
        self._report((self._cuda, after), (before, after))

    def _report(self, cuda_events: Any = None, cuda_exposed: Any = None) -> None:
        with self._lock:  # the future callback and wait() may race to report
            if self._reported:
                return
            self._reported = True
        end = self._end if self._end is not None else time.perf_counter()
        # Exposed = the part of the latency the training thread spent waiting: from the
        # start of wait() to completion (not the thread's wake-up delay after it).
        exposed = min(self._exposed, max(0.0, end - self._wait_start))
        self._comm._emit(self._op, self._purpose, self._nbytes, self._start, end, True,
                         exposed, cuda_events, cuda_exposed, self._seq)  # fmt: skip


class _Done(Handle):
    """The handle of work that has already completed (synchronous calls, one rank)."""

    def __init__(self) -> None:
        self._waited = True

    def wait(self) -> None:
        return


DONE: Handle = _Done()


class Comm:
    """Collectives on one process group, each reported to the observers.

    Args:
        observers: who hears about each collective.
        group: the process group (None: the default group, or no group at all when
            torch.distributed is not initialised, i.e. a single rank).
    """

    def __init__(self, observers: ObserverRegistry, group: Any = None) -> None:
        self.observers = observers
        self.group = group
        self._owns_group = False  # made by `twin`: `close` destroys it
        self.enabled = dist.is_available() and dist.is_initialized()
        #: The group's name, the same on every rank ("0" for the default group).
        self.group_name = group_name(group) if self.enabled else "0"
        #: The group's collective counter, shared by every Comm of the group in the process.
        self._seq = _SEQS.setdefault(self.group_name, [0])
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world_size = dist.get_world_size(group) if self.enabled else 1
        self.ring = (
            _ring_for(self) if self.enabled and self.world_size > 1 and _use_ring(group) else None
        )
        #: A group made with "nccl" (or with no backend on a CUDA machine) has no backend for
        #: CPU tensors: one handed to all_reduce or broadcast goes by the GPU. (The engine's
        #: per-step collectives are all on the device, offloaded or not.)
        self.cpu_through_gpu = (self.enabled and self.world_size > 1
                                and "cpu" not in device_backends(group)
                                and torch.cuda.is_available())  # fmt: skip

    def twin(self) -> Comm:
        """A Comm with the same observers on a new process group of the same ranks (a
        collective: every rank calls it at the same point). Two kinds of collective whose
        relative timing depends on each rank's autograd graph (stage 3's parameter gathers
        and gradient reductions) each get a group of their own, so that each group sees
        one order on every rank."""
        if not self.enabled or self.world_size == 1:
            return Comm(self.observers, self.group)
        ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        twin = Comm(self.observers, dist.new_group(ranks))
        twin._owns_group = True
        return twin

    def close(self) -> None:
        """Let go of a group this Comm made (`twin`): its gloo ring's thread and, on NCCL,
        its communicator. Idempotent; a Comm over the caller's group keeps it."""
        if not self._owns_group or self.group is None:
            return
        ring = _RINGS.pop(id(self.group), None)
        if ring is not None:
            ring.pool.shutdown(wait=True)
        if dist.is_initialized():
            dist.destroy_process_group(self.group)
        self._owns_group = False

    # -- reporting -------------------------------------------------------------------------

    def _emit(self, op: str, purpose: str, nbytes: int, start: float, end: float,
              async_op: bool, exposed: float, cuda_events: Any,
              cuda_exposed: Any = None, seq: int = 0) -> None:  # fmt: skip
        if self.observers:
            rec = CollectiveRecord(op=op, purpose=purpose, nbytes=nbytes,
                                   world_size=self.world_size, start=start, end=end,
                                   async_op=async_op, exposed_s=exposed,
                                   cuda_events=cuda_events, cuda_exposed=cuda_exposed,
                                   group=self.group_name, seq=seq)  # fmt: skip
            self.observers.call("on_collective", rec)

    def _run(self, op: str, purpose: str, nbytes: int, async_op: bool, device_tensor: torch.Tensor,
             launch: Callable[[bool], Any], local: Callable[[], Any] | None = None) -> Handle:  # fmt: skip
        if self.world_size == 1:
            if local is not None:  # one rank: the result is the input itself
                local()
            return DONE
        launched = None
        if _is_cuda(device_tensor):
            # The collective can start once the compute stream reaches this point.
            launched = _cuda_event()
            launched.record()
        counter = self._seq
        counter[0] += 1
        seq = counter[0]
        start = time.perf_counter()
        if self.observers:
            self.observers.call("on_collective_launch", self.group_name, seq, op,
                                device_tensor.numel(), device_tensor.dtype, start)  # fmt: skip
        if async_op:
            return Handle(self, launch(True), op, purpose, nbytes, start, launched, seq)
        work = launch(False)
        if isinstance(work, _RingWork):
            work.wait()
        end = time.perf_counter()
        cuda_events = None
        if launched is not None:
            # Synchronous: the compute stream waited from the launch to the end, so the
            # collective's time and the stall are the same interval.
            done = _cuda_event()
            done.record()
            cuda_events = (launched, done)
        self._emit(op, purpose, nbytes, start, end, False, end - start, cuda_events,
                   cuda_events, seq)  # fmt: skip
        return DONE

    # -- collectives -----------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, *, purpose: str = "other",
                   async_op: bool = False) -> Handle:  # fmt: skip
        """Sum `tensor` across ranks, in place (a CPU tensor on a group without a CPU backend
        goes through this process's GPU, synchronously)."""
        if self.cpu_through_gpu and tensor.device.type == "cpu":
            staged = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            self.all_reduce(staged, purpose=purpose)
            tensor.copy_(staged)
            return DONE
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_reduce", purpose, nbytes, async_op, tensor,
                         lambda a: dist.all_reduce(tensor, group=self.group, async_op=a))  # fmt: skip

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       purpose: str = "grad_reduce", async_op: bool = False) -> Handle:  # fmt: skip
        """Sum `input` (N equal parts) across ranks; rank r receives part r in `output`.
        `output` may be part r of `input` itself (in place). `input` is scratch: its other
        parts are undefined afterwards."""
        nbytes = input.numel() * input.element_size()
        ring = self.ring if self.ring is not None and input.device.type == "cpu" else None
        return self._run("reduce_scatter", purpose, nbytes, async_op, input,
                         (lambda a: ring.submit(ring.reduce_scatter, output, input)) if ring else
                         (lambda a: _reduce_scatter(output, input, group=self.group, async_op=a)),
                         lambda: _copy_unless_same(output, input))  # fmt: skip

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   purpose: str = "param_fetch", async_op: bool = False) -> Handle:  # fmt: skip
        """Concatenate every rank's `input` into `output` (rank order). `input` may be part
        r of `output` itself (in place)."""
        nbytes = output.numel() * output.element_size()
        ring = self.ring if self.ring is not None and output.device.type == "cpu" else None
        return self._run("all_gather", purpose, nbytes, async_op, output,
                         (lambda a: ring.submit(ring.all_gather, output, input)) if ring else
                         (lambda a: _all_gather(output, input, group=self.group, async_op=a)),
                         lambda: _copy_unless_same(output, input))  # fmt: skip

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, purpose: str = "other") -> None:
        """Copy rank `src`'s `tensor` to every rank, in place (by the GPU like `all_reduce`
        where the group has no CPU backend)."""
        if self.cpu_through_gpu and tensor.device.type == "cpu":
            staged = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            self.broadcast(staged, src, purpose=purpose)
            tensor.copy_(staged)
            return
        nbytes = tensor.numel() * tensor.element_size()
        self._run("broadcast", purpose, nbytes, False, tensor,
                  lambda a: dist.broadcast(tensor, src=src, group=self.group))  # fmt: skip

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    # -- objects ---------------------------------------------------------------------------

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj`, on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        self._run("broadcast", "other", len(pickle.dumps(obj)) if self.rank == src else 0,
                  False, torch.empty(0),
                  lambda a: dist.broadcast_object_list(box, src=src, group=self.group))  # fmt: skip
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._run("all_gather", "other", len(pickle.dumps(obj)) * self.world_size, False,
                  torch.empty(0),
                  lambda a: dist.all_gather_object(out, obj, group=self.group))  # fmt: skip
        return out


#: Collectives issued so far per process group name (a one-element list, shared by the
#: group's Comms): the number of the next is the same on every rank of the group.
_SEQS: dict[str, list[int]] = {}


def group_name(group: Any = None) -> str:
    """A process group's name, the same on every rank: torch's own (groups are named in
    the order they are made, which every rank follows), "0" for the default group."""
    pg = group if group is not None else dist.group.WORLD
    name = getattr(pg, "group_name", None)
    return str(name) if name else "0"


# -- gloo: ring reduce-scatter and all-gather over point-to-point ------------------------------


def _use_ring(group: Any) -> bool:
    """Gloo's flat reduce-scatter and all-gather cost about as much as a whole all-reduce
    each (measured on 2 ranks, 16 MB: reduce_scatter_tensor 12 ms, all_gather_into_tensor
    7 ms, all_reduce 5-10 ms), so ZeRO's reduce-scatter + all-gather would cost twice DDP's
    all-reduce. The same ring over gloo's send/recv moves the same bytes in 3-4 ms each.
    The ring serves CPU tensors wherever gloo carries them ("gloo", "cpu:gloo,cuda:nccl");
    CUDA tensors never take it. ZEROWATCH_GLOO_RING=0 turns it off."""
    if os.environ.get("ZEROWATCH_GLOO_RING", "1") == "0":
        return False
    return device_backends(group).get("cpu") == "gloo"


class _RingWork:
    """An in-flight ring collective: `wait()` and `get_future()` like a c10d Work."""

    def __init__(self, fut: concurrent.futures.Future[None]) -> None:
        self._fut = fut

    def wait(self) -> bool:
        self._fut.result()  # raises what the ring raised (a dead peer, a timeout)
        return True

    def get_future(self) -> concurrent.futures.Future[None]:
        return self._fut


_RINGS: dict[int, _Ring] = {}


def _ring_for(comm: Comm) -> _Ring:
    """One ring (one worker thread, one tag sequence) per process group, shared by every
    engine of the process, so two engines never reuse each other's message tags."""
    pg = comm.group if comm.group is not None else dist.group.WORLD
    ring = _RINGS.get(id(pg))
    if ring is None or ring.pg is not pg:
        ring = _RINGS[id(pg)] = _Ring(comm, pg)
    return ring


class _Ring:
    """Ring reduce-scatter / all-gather over gloo send/recv (N-1 steps of 1/N each).

    Ring collectives run one at a time, in issue order, on one worker thread, so every
    rank runs them in the same order and each can overlap the training thread's compute.
    """

    def __init__(self, comm: Comm, pg: Any) -> None:
        self.pg = pg
        n, r, g = comm.world_size, comm.rank, comm.group
        self.n, self.r, self.group = n, r, g
        ranks = [dist.get_global_rank(g, i) if g is not None else i for i in range(n)]
        self.next, self.prev = ranks[(r + 1) % n], ranks[(r - 1) % n]
        self.seq = 0
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerowatch-ring")

    def submit(self, fn: Callable[..., None], *args: Any) -> _RingWork:
        with self.lock:
            self.seq += 1
            tag = (self.seq % (1 << 20)) * 64
        return _RingWork(self.pool.submit(fn, *args, tag))

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> None:
        reqs = [dist.isend(send, self.next, group=self.group, tag=tag),
                dist.irecv(recv, self.prev, group=self.group, tag=tag)]  # fmt: skip
        for q in reqs:
            if q is not None:
                q.wait()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> None:
        n, r = self.n, self.r
        chunks = input.view(n, -1)  # chunk i ends up summed on rank i
        recv = torch.empty_like(chunks[0])
        for s in range(n - 1):
            # Send the partial sum of chunk r-s-1, add the neighbour's into chunk r-s-2.
            self._exchange(chunks[(r - s - 1) % n], recv, tag + s % 64)
            chunks[(r - s - 2) % n].add_(recv)
        _copy_unless_same(output, chunks[r])

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int) -> None:
        n, r = self.n, self.r
        chunks = output.view(n, -1)
        _copy_unless_same(chunks[r], input)
        for s in range(n - 1):
            self._exchange(chunks[(r - s) % n], chunks[(r - s - 1) % n], tag + s % 64)


__all__ = [
    "DONE",
    "Comm",
    "Handle",
    "carries_cuda",
    "comm_timeout",
    "device_backends",
    "group_name",
    "init_distributed",
]
