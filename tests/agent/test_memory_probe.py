"""On CPU the memory probe reads the process RSS (a system call per reading) on every
`memory_every`-th step and repeats the last readings between; the CUDA probe's allocator
peaks are read every step."""

from __future__ import annotations

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
