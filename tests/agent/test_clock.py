"""The two clocks behind one interface: the same boundaries paired on the host clock and on
CUDA events (the scripted device of tests/support/scripted_cuda.py: no GPU here) give the
same phases, and the CUDA clock reuses its events once a step's timings were read."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch
from support import scripted_cuda
from zerowatch.agent.adapters import select_adapter
from zerowatch.agent.config import AgentConfig
from zerowatch.agent.errors import AgentHealth
from zerowatch.agent.probes import CudaClock, HostClock, MemoryProbe, PhaseTimer
from zerowatch.agent.recorder import StepRecorder

#: One step from 10 s to 12 s: (start?, phase, time), nested phases, one nested in itself.
_BOUNDARIES = [
    (True, "forward", 10.1), (True, "param_gather", 10.2), (False, "param_gather", 10.4),
    (False, "forward", 10.5), (True, "backward", 10.6), (True, "grad_reduce", 10.7),
    (True, "grad_reduce", 10.75), (False, "grad_reduce", 10.8), (False, "grad_reduce", 10.9),
    (False, "backward", 11.2), (True, "optimizer_step", 11.4), (False, "optimizer_step", 11.8),
]  # fmt: skip


class Counted:
    """The scripted device with `torch.cuda.Event` creations counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.device = scripted_cuda.install(monkeypatch)
        self.made = 0
        #: Every event made, in order.
        self.events: list[scripted_cuda.Event] = []
        monkeypatch.setattr(torch.cuda, "Event", self._event)
        # (The clock asks torch's C function which stream is current: the scripted one's.)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentStream",
                            lambda _index: id(self.device.current), raising=False)  # fmt: skip

    def _event(self, enable_timing: bool = True) -> scripted_cuda.Event:
        self.made += 1
        self.events.append(scripted_cuda.Event(self.device))
        return self.events[-1]

    def at(self, t: float) -> None:
        """The compute stream's queued work now completes at device time `t`."""
        self.device.compute.t = t


def _window(timer: PhaseTimer, at: Any = lambda t: None) -> Any:
    """The step of `_BOUNDARIES` through `timer`, the device at each boundary's time (`at`)."""
    at(10.0)
    start = timer.clock.mark(10.0)
    for is_start, phase, t in _BOUNDARIES:
        at(t)
        (timer.start if is_start else timer.end)(phase, t)
    at(12.0)
    return timer.take(start, timer.clock.mark(12.0))


def test_cuda_events_and_the_host_clock_give_the_same_phases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = Counted(monkeypatch)
    on_host = _window(PhaseTimer(HostClock()))
    on_device = _window(PhaseTimer(CudaClock("cuda:0")), cuda.at)
    assert on_device.ready()
    assert on_device.step_s == pytest.approx(on_host.step_s) == pytest.approx(2.0)
    assert on_device.totals() == pytest.approx(on_host.totals())
    assert on_device.parts() == pytest.approx(on_host.parts())
    assert [(p, pytest.approx(a), pytest.approx(b), i) for p, a, b, i in on_host.intervals] == (
        on_device.intervals
    )
    assert on_host.totals()["grad_reduce"] == pytest.approx(0.2)  # the outer interval


def test_a_window_is_not_ready_until_its_events_have_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = Counted(monkeypatch)
    timer = PhaseTimer(CudaClock("cuda:0"))
    start = timer.clock.mark(10.0)
    timer.start("forward", 10.1)
    with cuda.device.use(scripted_cuda.Stream(cuda.device, "side")):
        timer.start("offload_d2h", 10.2)  # a mark on another stream
    timer.end("offload_d2h", 10.3)
    timer.end("forward", 10.5)
    window = timer.take(start, timer.clock.mark(11.0))
    assert window.ready()
    end = window.end[1]
    end.t = None  # (the device has not reached the step's end yet)
    assert not window.ready()
    end.t = 11.0
    on_side = cuda.events[2]  # (start, forward's start, then the copy's start)
    assert on_side.stream == "side"
    on_side.t = None  # the side stream's work not done: the step waits for it too
    assert not window.ready()
    on_side.t = 10.2
    assert window.ready()


def test_events_whose_times_were_read_are_recorded_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = Counted(monkeypatch)
    timer = PhaseTimer(CudaClock("cuda:0"))
    first = _window(timer, cuda.at)
    per_step = cuda.made  # every boundary and the step's two ends
    assert per_step == len(_BOUNDARIES) + 2
    second = _window(timer, cuda.at)  # the first not read yet: new events
    assert cuda.made == 2 * per_step
    first.totals()
    second.totals()
    for _ in range(10):
        _window(timer, cuda.at).totals()
    assert cuda.made == 2 * per_step
    timer.start("forward", 13.0)
    timer.reset()  # a boundary between steps: its event goes back unread
    _window(timer, cuda.at).parts()
    assert cuda.made == 2 * per_step


def test_a_recorder_on_cuda_creates_events_for_the_steps_in_flight_only(
    monkeypatch: pytest.MonkeyPatch, fake_engine: Any
) -> None:
    cuda = Counted(monkeypatch)
    fake_engine.device = "cuda:0"
    adapter = select_adapter(fake_engine)
    job = adapter.info()
    built: list[Any] = []
    recorder = StepRecorder(
        adapter=adapter, job=job, config=AgentConfig(), health=AgentHealth(),
        clock=CudaClock("cuda:0"), memory=MemoryProbe(job.theory), emit=built.append,
        next_seq=itertools.count().__next__,
    )  # fmt: skip
    reg = fake_engine.registry
    reg.add(recorder)
    steps, layers = 40, 8
    device_t = 0.0
    for _ in range(steps):
        reg.call("on_phase_start", "step", time.perf_counter())
        for phase in ("forward", "backward"):
            reg.call("on_phase_start", phase, time.perf_counter())
            for _ in range(layers):
                reg.call("on_phase_start", "param_gather", time.perf_counter())
                device_t += 1e-3
                cuda.at(device_t)
                reg.call("on_phase_end", "param_gather", time.perf_counter())
            reg.call("on_phase_end", phase, time.perf_counter())
        fake_engine.global_steps += 1
        reg.call("on_phase_end", "step", time.perf_counter())
        events = [build() for build in built]  # (the shipper, at its wake-up)
        built.clear()
        for event in events:
            assert event is not None
            assert event.phases["param_gather"] == pytest.approx(2 * layers * 1e-3)
    recorder.flush()
    assert len([build() for build in built]) == 1  # every step went out
    assert recorder.steps_emitted == steps
    per_step = 2 + 2 * (2 + 2 * layers)  # the step's ends, forward and backward, the gathers
    assert cuda.made <= 3 * per_step  # the steps in flight, not one event per boundary
