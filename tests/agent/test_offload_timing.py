"""Offload bandwidth on a GPU comes from CUDA events around the copy on its stream, read a
step later; on CPU from the host clock, as before (scripted device: no GPU here).

A `non_blocking` copy from pinned memory returns to the host in microseconds while the
device takes milliseconds: host time around it would give a PCIe figure thousands of times
too high, and `ZeroWatchOffloadBandwidthLow` could never fire.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from support import scripted_cuda
from zerowatch.agent.probes.offload import OffloadProbe
from zerowatch.agent.spool import read_events, segments

import zerowatch
from zerowatch.engine.hooks import ObserverRegistry
from zerowatch.engine.phases import Phases

MS = 1e-3
MIB = 1 << 20


class _Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_offload(self, *args: Any) -> None:
        self.calls.append(args)


def _phases(cuda: bool) -> tuple[Phases, _Seen]:
    observers, seen = ObserverRegistry(), _Seen()
    observers.add(seen)
    phases = Phases(observers)
    phases.cuda = cuda
    return phases, seen


def test_a_gpu_copy_is_bracketed_by_events_on_its_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 ms of compute queued, then a 2 ms host-to-device copy queued on the same stream (the
    # host is through at once): the events give the copy's 2 ms, not the host's microseconds
    # nor the compute before it. A copy issued on a side stream is bracketed there.
    device = scripted_cuda.install(monkeypatch)
    phases, seen = _phases(cuda=True)
    device.kernel(3 * MS)
    with phases.offload("h2d", 8 * MIB):
        device.kernel(2 * MS)  # the copy
    side = scripted_cuda.Stream(device, "copy")
    with device.use(side), phases.offload("d2h", 4 * MIB):
        device.kernel(5 * MS)
    (d1, n1, _, _, (a, b)), (d2, n2, _, _, (c, d)) = seen.calls
    assert (d1, n1, d2, n2) == ("h2d", 8 * MIB, "d2h", 4 * MIB)
    assert a.elapsed_time(b) == pytest.approx(2.0) and (a.stream, b.stream) == ("compute",) * 2
    assert c.elapsed_time(d) == pytest.approx(5.0) and (c.stream, d.stream) == ("copy",) * 2
    assert device.calls("stream_wait") == [] and device.calls("work_wait") == []


def test_a_cpu_copy_is_timed_on_the_host_as_before() -> None:
    phases, seen = _phases(cuda=False)
    with phases.offload("d2h", MIB):
        time.sleep(0.002)
    ((direction, nbytes, t0, t1),) = seen.calls
    assert (direction, nbytes) == ("d2h", MIB) and t1 - t0 >= 0.002


def test_the_probe_waits_for_the_copys_events_and_divides_by_their_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = scripted_cuda.install(monkeypatch)
    probe = OffloadProbe()
    a, b = scripted_cuda.Event(device), scripted_cuda.Event(device)
    a.record()
    device.kernel(4 * MS)
    t = time.perf_counter()
    assert probe.record("h2d", 8 * MIB, t, t + 1e-6, (a, b))
    assert probe.record("d2h", 2 * MIB, t, t + 0.001)  # a host-timed copy beside it
    window, _ = probe.take()
    assert not window.ready()  # the copy's end event has not completed: read a step later
    b.record()
    assert window.ready()
    by = {s.direction: s for s in window.stats()}
    assert by["h2d"].seconds == pytest.approx(4 * MS)
    assert by["h2d"].bandwidth_bytes_per_s == pytest.approx(8 * MIB / (4 * MS))
    assert by["d2h"].bandwidth_bytes_per_s == pytest.approx(2 * MIB / 0.001)


def test_the_steps_offload_bandwidth_is_bytes_over_the_copys_device_time(
    fake_engine: Any, spool_root: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine reports a 16 MiB copy that took the host 1 us and the device 5 ms: the
    # step's h2d bandwidth is 16 MiB / 5 ms (the fake engine's own d2h copy is host-timed).
    device = scripted_cuda.install(monkeypatch)
    reg = fake_engine.registry
    run = zerowatch.instrument(fake_engine, spool_dir=spool_root)
    for _ in range(2):
        reg.call("on_phase_start", "step", time.perf_counter())
        reg.call("on_phase_start", "optimizer_step", time.perf_counter())
        a, b = scripted_cuda.Event(device), scripted_cuda.Event(device)
        a.record()
        device.kernel(5 * MS)
        b.record()
        t = time.perf_counter()
        reg.call("on_offload", "h2d", 16 * MIB, t, t + 1e-6, (a, b))
        reg.call("on_phase_end", "optimizer_step", time.perf_counter())
        fake_engine.global_steps += 1
        reg.call("on_phase_end", "step", time.perf_counter())
    run.close()
    steps = [obj for seg in segments(run.spool_path / "rank-00000")
             for _, obj in read_events(seg) if obj["kind"] == "step"]  # fmt: skip
    assert len(steps) == 2
    for e in steps:
        (h2d,) = e["offload"]
        assert h2d["bytes"] == 16 * MIB
        assert h2d["seconds"] == pytest.approx(5 * MS)
        assert h2d["bandwidth_bytes_per_s"] == pytest.approx(16 * MIB / (5 * MS))
