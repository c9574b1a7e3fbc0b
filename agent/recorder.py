"""The step recorder: the engine's observer, turning one step's measurements into a StepEvent.

Life of a step on one rank:

1. `step` starts (the first forward of a gradient-accumulation cycle): the previous step's
   draft stops taking `run.log()` values and is emitted once its timings are known.
2. Phases, collectives and offload copies arrive from the engine and go to the probes.
3. `step` ends (the end of `engine.step()` on the boundary): the probes hand over their
   windows, memory and the optimizer's view (grad norm, loss scale, lr; for the bundled
   engine its record of the step, read on the shipper thread) are taken, and a
   *draft* is kept open: `run.log(loss=...)` called right after `engine.step()` still lands
   on this step.
4. The draft is handed to the shipper (with its seq) once its timings are known: on CUDA
   that waits until the step's CUDA events have completed (a step later); nothing here
   ever synchronizes the device.
5. On the shipper thread the draft becomes a StepEvent — phases with the `other` gap, so
   that forward + backward + optimizer_step + other = step time; the exclusive parts (each
   instant of the step in the innermost phase running then: they add up to the step time)
   and the communication compute hid beside them; collective stats; exposed communication;
   offload; memory; throughput and MFU; user scalars; raw spans on sampled steps.

On the host clock (compute on the CPU, in the training thread alone) the step also carries
its CPU time: the training thread's, and the process's other threads' (the communication
threads) - four clock reads a step, at its start and its end (~2.5 us), none per callback.
The doctor prices with them what communication that overlaps compute costs it on a host
whose cores both share (docs/doctor.md).

Why the assembly runs on the shipper thread: between the engine's kernels, which evict the
CPU's caches, the same work costs the training thread two to three times what it costs
warm. The training thread's share of a step's end is therefore only to take the step's
phase log and collective records out of the probes (each list handed over whole, a new one
in its place); pairing the boundaries, folding the records and building the event happen
on the shipper, for all the steps of a flush interval one after another, the same on both
clocks. The training thread only asks whether a waiting step's timings are known (the
clock: at once on the host, its CUDA events on a GPU).

The callbacks the engine calls most are small closures: a nested phase's boundary is a
dict lookup and two appends to the phase log (`_boundary_callback`; the clock's mark: the
time itself on the host, a pooled CUDA event recorded on a GPU), a collective one append
and the flight recorder's store (`_collective_callback`). `step` and the top-level phases take the long way (`_other_phase_*`),
which also reads memory, only on the steps that read it (`_route_top_level`).

Every engine callback is guarded: an error is counted and logged once, never raised into
the engine (which would count it too, but training must not even notice).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from zerowatch.agent import flops
from zerowatch.agent import forensics as fx
from zerowatch.agent.adapters.base import EngineAdapter, JobInfo, StepStats
from zerowatch.agent.config import AgentConfig
from zerowatch.agent.errors import AgentHealth
from zerowatch.agent.probes import (
    TOP_LEVEL,
    Clock,
    CollectiveAggregator,
    CollectiveWindow,
    HostClock,
    MemoryProbe,
    OffloadProbe,
    OffloadWindow,
    PhaseTimer,
    PhaseWindow,
)
from zerowatch.agent.probes.flight import FlightRecorder
from zerowatch.agent.probes.gpu import GpuProbe, NullGpuProbe

from zerowatch import events as ev

#: Where this process runs (torchrun sets LOCAL_RANK): ranks group by node on the server.
_HOST = socket.gethostname()
_LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "-1") or -1)
#: A step's draft waits this long after its end for `run.log()` values, then the shipper
#: sends it even though the next step has not begun (a rank stuck before it).
_OPEN_DRAFT_S = 1.0
#: Step durations kept for the heartbeat's stall threshold.
_STEP_TIMES_KEPT = 32


def launcher_node(environ: dict[str, str] | None = None) -> int:
    """This process's node index from its launcher: torchrun's GROUP_RANK, SLURM's
    SLURM_NODEID; -1 when neither says (the host name alone names the node then)."""
    env = os.environ if environ is None else environ
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        value = env.get(key, "")
        if value.strip().isdigit():
            return int(value)
    return -1


_NODE = launcher_node()

_STEP_OR_TOP = frozenset(("step", *TOP_LEVEL))
#: Ended steps whose CUDA timings are not in yet, kept at most.
_MAX_WAITING = 256


@dataclass
class UserScalars:
    """What `run.log()` gave for one step: `tokens` and `samples` are summed over the
    micro-batches, `loss` is averaged, `lr` and `grad_norm` are the step's learning rate
    and gradient norm (in place of the optimizer's view), any other key keeps its last
    value."""

    loss_sum: float = 0.0
    loss_n: int = 0
    loss_nonfinite: bool = False
    tokens: int = 0
    samples: int = 0
    lr: float | None = None
    grad_norm: float | None = None
    #: (Made by the first other key: a new UserScalars at every step's end builds nothing.)
    other: dict[str, float] | None = None
    #: `run.log(batch_ids=...)`: kept in the event of a flagged step only.
    batch_ids: list[Any] | None = None
    #: Checkpoint saves and loads before the step (agent/checkpoints.py).
    checkpoints: list[ev.CheckpointTiming] | None = None

    def add(self, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            if key in ("lr", "grad_norm"):
                if math.isfinite(value):
                    setattr(self, key, value)
            elif key == "loss":
                if math.isfinite(value):
                    self.loss_sum += value
                    self.loss_n += 1
                else:
                    self.loss_nonfinite = True
            elif key == "tokens":
                self.tokens += int(value)
            elif key == "samples":
                self.samples += int(value)
            elif math.isfinite(value):
                if self.other is None:
                    self.other = {}
                self.other[key] = value


@dataclass(slots=True)
class StepDraft:
    """One ended step whose event is not out yet."""

    step: int
    #: The step's phase boundaries, with its first and last clock marks.
    phases: PhaseWindow
    collectives: CollectiveWindow
    offload: OffloadWindow
    offload_spans: list[tuple[str, int, float, float]] | None
    memory: ev.MemoryStats | None
    #: The optimizer's view, or what reads it when the event is built (an adapter's
    #: `step_stats_later`).
    stats: StepStats | Callable[[], StepStats]
    sampled: bool
    user: UserScalars
    #: (training thread, other threads) CPU seconds of the step; None: not measured.
    cpu: tuple[float, float] | None = None
    #: perf_counter -> unix seconds on rank 0's clock, as the offset stood when it ended.
    unix_offset: float = 0.0
    #: The first module whose forward output was not finite (traced on a step after a
    #: flagged one: agent/forensics.py); None.
    forward_module: str | None = None

    def ready(self) -> bool:
        """Whether the step's timings are known (on the host clock: when it ended)."""
        return self.phases.ready() and self.collectives.ready() and self.offload.ready()


class StepRecorder:
    """Observer of one engine (via its adapter); hands each ended step to `emit` as a
    callable that builds its StepEvent (None if that fails: counted and dropped), for the
    shipper to call."""

    def __init__(
        self,
        *,
        adapter: EngineAdapter,
        job: JobInfo,
        config: AgentConfig,
        health: AgentHealth,
        clock: Clock,
        memory: MemoryProbe,
        emit: Callable[[Callable[[], ev.StepEvent | None]], None],
        next_seq: Callable[[], int],
        gpu: GpuProbe | None = None,
        mfu: flops.MfuMeter | None = None,
    ) -> None:
        self._adapter = adapter
        self._job = job
        self._cfg = config
        self._health = health
        self._clock = clock
        self._memory = memory
        self._emit = emit
        self._next_seq = next_seq
        #: The rank's GPU (NVML, sampled on its own thread); read when a step is built.
        self.gpu: GpuProbe = gpu if gpu is not None else NullGpuProbe()
        self._timer = PhaseTimer(clock)
        #: An adapter that can be asked about the step later (`step_stats_later`, optional)
        #: is, on the shipper thread.
        self._step_stats_later: Callable[[], StepStats | Callable[[], StepStats]] | None = getattr(
            adapter, "step_stats_later", None
        )
        #: The step's CPU clocks are read where the training thread is the compute (on the
        #: host clock: on a GPU the device computes).
        self._cpu_clocks = isinstance(clock, HostClock) and _compute_in_one_thread()
        self._cpu_start: tuple[float, float] | None = None
        self._collectives = CollectiveAggregator(config.max_spans_per_step)
        self._offload = OffloadProbe(config.max_spans_per_step)
        self._lock = threading.Lock()  # run.log() vs the engine's callbacks
        self._step = job.global_step
        self._step_start: Any = None
        self._sampled = False
        self._user = UserScalars()
        self._open: StepDraft | None = None
        self._waiting: list[StepDraft] = []
        self._model_state: dict[str, int] = {}
        #: MFU of a step from its tokens/s (attach.py builds it from the device and model).
        self._mfu = mfu if mfu is not None else _hand_mfu(config, job, health)
        # perf_counter -> unix seconds on rank 0's clock, for span and event timestamps.
        self._host_unix = time.time() - time.perf_counter()
        self.clock_offset_s = 0.0
        self._unix_offset = self._host_unix
        #: Estimates the offset again (over the job's group), every `clock_sync_every` steps.
        self.resync_clock: Callable[[], float] | None = None
        self.steps_emitted = 0
        #: Traces a NaN born in the forward on the step after a flagged one (attach.py
        #: gives it the model); `_trace_next`: a flagged step asks for it.
        self.tracer: fx.ForwardTracer | None = None
        self._trace_next = False
        #: Called with (error, phase, step) when an exception leaves the engine (Run.crash).
        self.on_crash: Callable[[BaseException, str, int | None], None] | None = None
        self._step_nonfinite: Callable[[], bool] | None = getattr(adapter, "step_nonfinite", None)
        #: The last collectives of each process group (the heartbeat's evidence of a hang).
        self.flight = FlightRecorder()
        #: The engine announces each collective before it can block: straight to the ring.
        self.on_collective_launch = self.flight.on_collective_launch
        #: perf_counter when the last step ended (or the recorder started), its number, and
        #: the durations of the last steps (the stall threshold follows them).
        self.last_step_end = time.perf_counter()
        self.last_step: int | None = None
        self.step_times: list[float] = []
        self._step_t0 = 0.0
        self._open_at = 0.0
        self._make_callbacks()

    # -- engine callbacks (training thread; collectives maybe another) -----------------

    #: The callbacks the engine calls most, made once (`_make_callbacks`).
    on_phase_start: Callable[[str, float], None]
    on_phase_end: Callable[[str, float], None]
    on_collective: Callable[[Any], None]

    def _make_callbacks(self) -> None:
        """The phase-boundary and collective callbacks: a nested phase's boundary goes
        straight to the phase log (`_boundary_callback`); `step` and the top-level phases
        take the long way (`_other_phase_*`: step assembly, memory readings) unless
        `_route_top_level` sends them the short way on steps that read no memory."""
        codes = self._timer.codes
        #: Phase -> the boundary code the callbacks log, or -1 for the long way.
        self._start_codes = {n: -1 if n in _STEP_OR_TOP else c for n, c in codes.start.items()}
        self._end_codes = {n: -1 if n in _STEP_OR_TOP else c for n, c in codes.end.items()}
        for name in _STEP_OR_TOP:
            self._start_codes[name] = self._end_codes[name] = -1
        self._long_way = True  # (the top-level phases' route now)
        self.on_phase_start = _boundary_callback(self._start_codes, self._timer,
                                                 self._other_phase_start, self._health, "start")  # fmt: skip
        self.on_phase_end = _boundary_callback(self._end_codes, self._timer,
                                               self._other_phase_end, self._health, "end")  # fmt: skip
        self.on_collective = _collective_callback(self._collectives, self.flight)

    def set_clock_offset(self, offset_s: float) -> None:
        """This host's clock minus rank 0's (`zerowatch.clocks`): every time sent from now
        on (step ends, spans) is on rank 0's clock."""
        self.clock_offset_s = float(offset_s)
        self._unix_offset = self._host_unix - self.clock_offset_s

    def tidy(self) -> None:
        """Housekeeping on the shipper thread, at each of its wake-ups: the collective
        records of a step (or of the time between steps) that have piled up past the
        aggregator's bound are folded (the training thread's callback only appends); a
        step that ended `_OPEN_DRAFT_S` ago and whose next step has not begun (a rank
        stuck in its data loader) is sent without waiting for that start."""
        self._collectives.fold_if_full()
        if self._open is None:
            return
        with self._lock:
            draft = self._open
            if (draft is None or self._waiting
                    or time.perf_counter() - self._open_at < _OPEN_DRAFT_S
                    or not draft.ready()):  # fmt: skip
                return
            self._open = None
            self._emit_one(draft)

    def phase_now(self) -> str:
        """The phase the training thread is in (read from another thread: the innermost
        boundary logged last), "step" inside a step between phases, "between_steps"."""
        if self._step_start is None:
            return "between_steps"
        log = self._timer.log
        try:
            if len(log) >= 2:
                code = log[-2]
                if isinstance(code, int) and code % 2 == 0:
                    return str(self._timer.codes.names[code // 2])
        except (IndexError, TypeError):  # the list changed under us: no worse than "step"
            pass
        return "step"

    def current_step(self) -> int:
        """The number of the step in progress (or of the next one, between steps)."""
        return self._step

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds since this rank last finished a step (since the recorder started, before
        its first)."""
        return (time.perf_counter() if now is None else now) - self.last_step_end

    def unix_of(self, t: float) -> float:
        """A perf_counter reading as unix seconds on rank 0's clock."""
        return t + self._unix_offset

    def _route_top_level(self, long_way: bool) -> None:
        """Send the top-level phases' boundaries the long way (`_other_phase_*`: memory
        readings) on steps that read memory, and the nested phases' way (two appends) on
        the others: between the engine's kernels the long way's three calls cost the
        training thread ~25 us a boundary, the short one ~1 us."""
        if long_way == self._long_way:
            return
        self._long_way = long_way
        codes = self._timer.codes
        for name in TOP_LEVEL:
            self._start_codes[name] = -1 if long_way else codes.start[name]
            self._end_codes[name] = -1 if long_way else codes.end[name]

    def _other_phase_start(self, phase: str, t: float) -> None:
        """`step`, the top-level phases (their memory is read) and names not seen before."""
        try:
            if phase == "step":
                self._begin_step(t)
                return
            self._timer.start(phase, t)
            if phase in _STEP_OR_TOP:
                self._memory.phase_start(phase)
        except Exception as e:
            self._health.error(f"recording the start of phase {phase!r}", e)

    def _other_phase_end(self, phase: str, t: float) -> None:
        try:
            if phase == "step":
                self._end_step(t)
                return
            self._timer.end(phase, t)
            if phase in _STEP_OR_TOP:
                self._memory.phase_end(phase)
        except Exception as e:
            self._health.error(f"recording the end of phase {phase!r}", e)

    def on_error(self, error: BaseException, phase: str, step: int | None) -> None:
        """An exception is leaving the engine (training thread): the run's last event."""
        if self.on_crash is not None:
            self.on_crash(error, phase, step)

    def on_offload(self, direction: str, nbytes: int, start: float, end: float,
                   cuda_events: Any = None) -> None:  # fmt: skip
        try:
            if not self._offload.record(direction, nbytes, start, end, cuda_events):
                self._health.warn_once(
                    f"offload-dir:{direction}",
                    "zerowatch agent: unknown offload direction %r ignored",
                    direction,
                )
        except Exception as e:
            self._health.error("recording an offload copy", e)

    # -- user scalars ----------------------------------------------------------------

    def log(self, scalars: dict[str, float], batch_ids: list[Any] | None = None) -> None:
        """Add validated scalars to the step in progress, or to the one that just ended."""
        with self._lock:
            if self._step_start is None and self._open is not None:
                user = self._open.user
            else:
                user = self._user
            user.add(scalars)
            if batch_ids is not None:
                user.batch_ids = (user.batch_ids or []) + batch_ids
            if user.loss_nonfinite:
                self._trace_next = True

    def note_checkpoint(self, timing: ev.CheckpointTiming) -> None:
        """A checkpoint call (between steps): it goes out with the next step's event, or
        the rank's EndEvent (`take_checkpoints`). After a load the steps are numbered from
        the step it restored."""
        with self._lock:
            user = self._user
            user.checkpoints = [*(user.checkpoints or ()), timing]
            if timing.op == "load" and self._step_start is None:
                self._step = timing.step

    def take_checkpoints(self) -> list[ev.CheckpointTiming]:
        """The checkpoint calls no step event carries (at close)."""
        with self._lock:
            out, self._user.checkpoints = self._user.checkpoints or [], None
        return out

    # -- step assembly ---------------------------------------------------------------

    def _begin_step(self, t: float) -> None:
        with self._lock:
            draft, self._open = self._open, None
        if draft is not None:
            self._waiting.append(draft)
        self._emit_ready()
        # Anything that ran between steps (checkpointing, evaluation) is not part of one.
        self._timer.reset()
        self._collectives.discard()
        self._offload.take()
        every, n = self._cfg.spans_every, self._step - self._job.global_step
        self._sampled = bool(every) and n % every == 0
        self._memory.begin_step(n)
        self._route_top_level(self._memory.reading)
        self._collectives.sample_next(self._sampled)
        self._offload.sample_next(self._sampled)
        self._step_start = self._clock.mark(t)
        self._step_t0 = t
        if self._trace_next and self.tracer is not None:
            self._trace_next = False
            self.tracer.arm()
        if self._cpu_clocks:
            self._cpu_start = (time.thread_time(), time.process_time())

    def _end_step(self, t: float) -> None:
        if self._step_start is None:
            self._health.warn_once(
                "step-no-start",
                "zerowatch agent: a step ended that was not seen starting (instrumented "
                "mid-step?); it is not recorded",
            )
            return
        end = self._clock.mark(t)
        cpu, began = None, self._cpu_start
        if began is not None:
            thread, process = time.thread_time() - began[0], time.process_time() - began[1]
            cpu, self._cpu_start = (thread, max(process - thread, 0.0)), None
        phases = self._timer.take(self._step_start, end)
        window = self._collectives.take_later()
        offload, offload_spans = self._offload.take()
        n = self._step - self._job.global_step
        if n % self._cfg.memory_every == 0 or not self._model_state:
            try:
                self._model_state = self._adapter.model_state_bytes()
            except Exception as e:
                self._health.error("reading the engine's model-state bytes", e)
        memory = self._memory.take(self._model_state)
        later = self._step_stats_later
        stats = later() if later is not None else self._adapter.step_stats()
        forward_module = None
        if self.tracer is not None:
            if self.tracer.armed:
                forward_module = self.tracer.take()
            flagged = self._step_nonfinite
            if flagged is not None and flagged():
                self._trace_next = True
        with self._lock:
            draft = StepDraft(
                step=self._step, phases=phases,
                collectives=window, offload=offload, offload_spans=offload_spans,
                memory=memory, stats=stats, sampled=self._sampled, user=self._user, cpu=cpu,
                unix_offset=self._unix_offset, forward_module=forward_module,
            )  # fmt: skip
            self._user = UserScalars()
            if self._open is not None:  # two step ends without a start between: keep both
                self._waiting.append(self._open)
            self._open = draft
            self._open_at = t
            self._step_start = None
        times = self.step_times
        times.append(t - self._step_t0)
        if len(times) > _STEP_TIMES_KEPT:
            del times[0]
        self.last_step, self.last_step_end = self._step, t
        self._step += 1
        self._emit_ready()
        every, done = self._cfg.clock_sync_every, self._step - self._job.global_step
        if every and done % every == 0 and self.resync_clock is not None:
            # Between two steps (not inside one's time), on every rank at the same step:
            # the round trips are collectives of all ranks; their records are discarded
            # with whatever else runs between steps.
            self.set_clock_offset(self.resync_clock())

    def _emit_ready(self, *, force: bool = False) -> None:
        if len(self._waiting) > _MAX_WAITING:  # a device that never finishes: stay bounded
            n = len(self._waiting) - _MAX_WAITING
            for dropped in self._waiting[:n]:
                dropped.phases.discard()
            del self._waiting[:n]
            self._health.drop(n, "step timings never completed on the device")
        while self._waiting:
            draft = self._waiting[0]
            # (Nothing is paired or folded here: a window only asks its clock and events.)
            if not force and not draft.ready():
                return
            self._waiting.pop(0)
            self._emit_one(draft)

    def _emit_one(self, draft: StepDraft) -> None:
        # The event is built where it is shipped (`_assemble`); its seq is taken here, so
        # the events and the run's EndEvent keep the order the steps ended in.
        self._emit(partial(self._assemble, draft, self._next_seq()))
        self.steps_emitted += 1

    def _assemble(self, draft: StepDraft, seq: int) -> ev.StepEvent | None:
        """The draft's StepEvent (on the shipper thread); None, counted, if it fails. The
        probes' lists for coming steps are made here too (`probes/room.py`), off the
        training thread."""
        try:
            self._timer.make_room()
            self._collectives.make_room()
            return self._build(draft, seq)
        except Exception as e:
            self._health.error("assembling a step event", e)
            self._health.drop(1, "a step event could not be assembled")
            return None

    def flush(self) -> None:
        """Emit every ended step (at close). On CUDA this waits for the device once."""
        with self._lock:
            if self._open is not None:
                self._waiting.append(self._open)
                self._open = None
        if self._waiting and not all(d.ready() for d in self._waiting):
            try:
                import torch

                torch.cuda.synchronize()
            except Exception as e:
                self._health.error("waiting for the device at close", e)
        self._emit_ready(force=True)

    def _build(self, d: StepDraft, seq: int) -> ev.StepEvent:
        clock, job = self._clock, self._job
        step_time = d.phases.step_s
        phases = d.phases.totals()
        top = sum(phases.get(p, 0.0) for p in TOP_LEVEL)
        phases["other"] = max(step_time - top, 0.0)
        user = d.user
        loss = user.loss_sum / user.loss_n if user.loss_n else None
        samples = user.samples or job.micro_batch_size * job.gradient_accumulation_steps
        tokens = user.tokens
        samples_per_s = samples / step_time if step_time > 0 else None
        tokens_per_s = tokens / step_time if tokens and step_time > 0 else None
        stats = d.stats if isinstance(d.stats, StepStats) else d.stats()
        nonfinite = stats.nonfinite or user.loss_nonfinite
        grad_norm = user.grad_norm if user.grad_norm is not None else stats.grad_norm
        start_unix = clock.host_time(d.phases.start) + d.unix_offset
        end_unix = clock.host_time(d.phases.end) + d.unix_offset
        collectives = d.collectives.stats()
        exposed = d.collectives.exposed_s
        # The time some collective was running (concurrent ones counted once) beyond what the
        # training thread waited for them ran under compute: beside the parts, not in them.
        hidden = max(d.collectives.wall_s - exposed, 0.0)
        return ev.StepEvent(
            rank=job.rank,
            seq=seq,
            step=d.step,
            time=end_unix,
            step_time_s=step_time,
            phases=phases,
            collectives=collectives,
            exposed_comm_s=exposed,
            parts=d.phases.parts(),
            hidden_comm_s=hidden,
            offload=d.offload.stats(),
            memory=d.memory,
            grad_norm=None if nonfinite else grad_norm,
            clipped=stats.clipped,
            loss=loss,
            loss_scale=stats.loss_scale,
            skipped=stats.skipped,
            nonfinite=nonfinite,
            lr=user.lr if user.lr is not None else stats.lr,
            samples=samples,
            tokens=tokens,
            samples_per_s=samples_per_s,
            tokens_per_s=tokens_per_s,
            mfu=self._mfu(tokens_per_s, tokens / user.samples if user.samples else None),
            scalars=dict(user.other) if user.other else {},
            spans=self._spans(d, start_unix, step_time) if d.sampled else None,
            host=_HOST,
            local_rank=_LOCAL_RANK,
            node=_NODE,
            thread_cpu_s=d.cpu[0] if d.cpu else None,
            other_cpu_s=d.cpu[1] if d.cpu else None,
            gpu=self.gpu.window(start_unix, end_unix),
            forensics=fx.step_forensics(
                stats.local_grads,
                nonfinite=nonfinite,
                forward_module=d.forward_module,
                batch_ids=user.batch_ids,
            ),
            checkpoints=user.checkpoints or [],
        )

    def _spans(self, d: StepDraft, start_unix: float, step_time: float) -> list[ev.Span]:
        off = d.unix_offset
        cap = self._cfg.max_spans_per_step
        # Positional arguments (name, cat, start, end, args): a sampled step builds hundreds
        # of spans on the training thread, and keywords cost a dataclass twice as much.
        span = ev.Span
        spans = [span("step", "phase", start_unix, start_unix + step_time)]
        for phase, t0, t1 in d.phases.spans():
            spans.append(span(phase, "phase", t0 + off, t1 + off))
        for op, purpose, nbytes, async_op, t0, t1 in d.collectives.spans or ():
            spans.append(
                span(op, "collective", t0 + off, t1 + off,
                     {"op": op, "purpose": purpose, "bytes": nbytes, "async": async_op})
            )  # fmt: skip
        for direction, nbytes, t0, t1 in d.offload_spans or ():
            spans.append(
                span(f"offload_{direction}", "offload", t0 + off, t1 + off, {"bytes": nbytes})
            )  # fmt: skip
        return spans[:cap]


def _hand_mfu(config: AgentConfig, job: JobInfo, health: AgentHealth) -> flops.MfuMeter:
    """The MFU meter of what was given by hand: 6·N (+ 12·L·H·T) over `peak_flops`."""
    model = flops.ModelFlops(
        params=config.flops_params if config.flops_params is not None else job.param_count,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        seq_len=config.seq_len,
    )
    return flops.MfuMeter(model=model, peak_flops=config.peak_flops,
                          flops_per_token=config.flops_per_token, warn_once=health.warn_once)  # fmt: skip


def _boundary_callback(codes: dict[str, int], timer: PhaseTimer,
                       long_way: Callable[[str, float], None], health: AgentHealth,
                       what: str) -> Callable[[str, float], None]:  # fmt: skip
    """The engine's phase-start (or phase-end) callback: a nested phase's boundary is its
    code (`codes`) and its clock mark appended to the timer's log (two appends, no
    allocation on the host clock); `step`, names mapped to -1 (the top-level phases on
    steps that read memory: the recorder changes `codes`) and names not seen yet go to
    `long_way`. An error is counted (`what`: "start" or "end"), never raised into the
    engine."""
    mark = timer.clock.mark

    def on_boundary(phase: str, t: float) -> None:
        try:
            code = codes[phase]
        except KeyError:
            code = -1
        if code < 0:
            long_way(phase, t)
            return
        try:
            log = timer.log  # (another list after each step's end)
            log.append(code)
            log.append(mark(t))
        except Exception as e:
            health.error(f"recording the {what} of phase {phase!r}", e)

    return on_boundary


def _collective_callback(collectives: CollectiveAggregator,
                         flight: FlightRecorder) -> Callable[[Any], None]:  # fmt: skip
    """The engine's collective callback (any thread): the record is kept for the step's
    window (one append: the bound on a long step is kept on the shipper thread, `tidy`) and
    counted completed by the flight recorder."""
    completed = flight.on_collective

    def on_collective(record: Any) -> None:
        collectives.pending.append(record)  # (another list after each step's end)
        completed(record)

    return on_collective


def _compute_in_one_thread() -> bool:
    """Whether the training thread alone computes (torch's intra-op pool is one thread), so
    that the process's other threads are its communication and the agent's, not compute.
    An engine without torch (tests' fakes) has no intra-op pool."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    try:
        return int(torch.get_num_threads()) == 1
    except Exception:
        return False


__all__ = ["StepDraft", "StepRecorder", "UserScalars", "launcher_node"]
