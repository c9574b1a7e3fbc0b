"""On CPU the memory probe reads the process RSS (a system call per reading) on every
`memory_every`-th step and repeats the last readings between; the CUDA probe's allocator
peaks are read every step."""

from __future__ import annotations

import types

import pytest
from zerowatch.agent.probes import MemoryProbe


def test_rss_is_read_every_nth_step_and_repeated_between() -> None:
    probe = MemoryProbe({"params": 1}, every=3)
    readings = iter(range(1000, 100000, 1000))
    reads: list[int] = []

    def rss() -> int:
        reads.append(1)
        return next(readings)

    real, probe._rss = probe._rss, rss  # type: ignore[assignment]
    events = []
    for n in range(7):
        probe.begin_step(n)
        for phase in ("forward", "backward", "optimizer_step"):
            probe.phase_end(phase)
        events.append(probe.take({"params": 4}))
    assert len(reads) == 3 * 3  # steps 0, 3 and 6
    assert events[1].peak_by_phase == events[2].peak_by_phase == events[0].peak_by_phase
    assert events[3].peak_by_phase != events[0].peak_by_phase
    assert events[3].peak_by_phase["forward"] == 4000
    for e in events:
        assert set(e.peak_by_phase) == {"forward", "backward", "optimizer_step"}
        assert e.rss_peak_bytes >= max(e.peak_by_phase.values())
        assert e.model_state == {"params": 4} and e.model_state_theory == {"params": 1}
    # The same model-state bytes on a step that reads nothing: the last step's stats again.
    state = {"params": 4}
    probe.begin_step(7)
    first = probe.take(state)
    probe.begin_step(8)
    assert probe.take(state) is first
    probe.begin_step(9)
    assert probe.take({"params": 5}).model_state == {"params": 5}
    probe._rss = real
    probe.close()


def test_a_probe_without_a_reading_yet_reads_whatever_the_step() -> None:
    probe = MemoryProbe({}, every=10)
    probe.begin_step(5)  # instrumented mid-cycle: no reading to repeat
    probe.phase_end("forward")
    assert probe.take({}).peak_by_phase["forward"] > 0
    probe.close()


class _Allocator:
    """A scripted CUDA caching allocator's statistics: allocated bytes now, their peak since
    the last reset, and the bytes ever allocated and freed."""

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def alloc(self, n: int) -> None:
        self.current += n
        self.allocated += n
        self.peak = max(self.peak, self.current)

    def free(self, n: int) -> None:
        self.current -= n
        self.freed += n

    def nested(self, device: object = None) -> dict[str, object]:
        allocated = {"current": self.current, "peak": self.peak,
                     "allocated": self.allocated, "freed": self.freed}  # fmt: skip
        return {"allocated_bytes": {"all": allocated}, "num_alloc_retries": 0, "num_ooms": 0,
                "reserved_bytes": {"all": {"current": 1 << 30}}}  # fmt: skip

    def reset_peak(self, device: object = None) -> None:
        self.peak = self.current


def test_cuda_peaks_per_phase_leave_the_users_own_peak_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The user's script reads torch.cuda.max_memory_allocated() (the allocator's peak since
    # its own last reset) around a run the agent instruments: the agent must not reset it.
    # Per phase the probe reports the exact peak wherever the readings at the phase's two
    # ends prove it (the phase raised the allocator's high-water mark; it only allocated;
    # it only freed), else the larger of the allocated bytes at its two ends, a lower bound.
    import torch
    from zerowatch.agent.probes.memory import CudaMemoryProbe

    mem = _Allocator()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", mem.nested)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", mem.reset_peak)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem.peak)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(total_memory=80 << 30))  # fmt: skip
    mem.alloc(1000)  # the user's own work before the run: their peak is 1000
    mem.free(800)
    probe = CudaMemoryProbe({}, "cuda:0")
    peaks = []
    for step in range(2):
        probe.begin_step(step)
        probe.phase_start("forward")  # at 200
        mem.alloc(500)
        mem.alloc(600 if step == 0 else 100)  # step 0: 1300, a new high; step 1: 800
        mem.free(400 if step == 0 else 100)
        probe.phase_end("forward")  # at 900 / 700
        mem.alloc(50)  # the loss, outside any phase
        mem.free(50)
        probe.phase_start("backward")
        mem.alloc(200)  # 1100 / 900: below the high-water mark
        mem.free(500)
        probe.phase_end("backward")  # at 600 / 400
        probe.phase_start("optimizer_step")
        mem.alloc(300)  # only allocates: 900 / 700
        probe.phase_end("optimizer_step")
        mem.free(700 if step == 0 else 500)  # back to 200 between steps
        peaks.append(probe.take({}).peak_by_phase)
    assert torch.cuda.max_memory_allocated() == 1300  # the user's peak, never reset
    assert peaks[0] == {"forward": 1300, "backward": 900, "optimizer_step": 900}
    assert peaks[1] == {"forward": 700, "backward": 700, "optimizer_step": 700}
    # Exact: step 0's forward (a new high) and both optimizer steps (allocations only).
    # The true peaks of the backwards (1100, 900) and of step 1's forward (800) are below
    # the high-water mark, and both allocated and freed: their lower bounds are reported.
    # The user resetting their own peak mid-run is theirs to do, and the probe copes.
    mem.reset_peak()
    probe.begin_step(2)
    probe.phase_start("forward")
    mem.alloc(400)
    mem.free(100)
    probe.phase_end("forward")
    assert probe.take({}).peak_by_phase["forward"] == 600
