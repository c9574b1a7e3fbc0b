"""The GPU timing path, run here with a scripted stand-in for CUDA streams and events.

No GPU is lent to these machines, so the arithmetic of `engine/comm.py` on CUDA is checked
against a device model whose timestamps the test sets: each stream is a queue whose work
completes at a known time; an event recorded on a stream completes when the stream's
queued work has; a NCCL collective starts once the stream that launched it reaches the
launch point and its own stream is free, and `work.wait()` makes the *current* stream
wait for it (the host returns at once, as with NCCL). The agent's collective probe then
reads latency and exposed time from the events, as it would on a GPU.

Each scenario's expected latency, exposed and hidden time is worked out in its test. The
events are the engine's own stream's only (docs/gpu.md, "The agent and a collective's
lifetime"): the latency ends where the waiting stream has the result, exact when it
stalled there and an upper bound (the wait point) when the collective was hidden;
tests/agent/test_collective_lifetime.py checks that nothing else waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.probed_comm import probed_comm
from zerowatch.agent.probes.collectives import CollectiveAggregator

from zerowatch.engine import comm as comm_mod

MS = 1e-3


class Stream:
    """A CUDA stream: `t` is when the work queued on it so far completes (seconds)."""

    def __init__(self, name: str) -> None:
        self.name, self.t = name, 0.0


class Device:
    """The scripted device: a compute stream (current by default), NCCL's stream."""

    def __init__(self) -> None:
        self.compute = Stream("compute")
        self.nccl = Stream("nccl")
        self.current = self.compute

    def kernel(self, seconds: float) -> None:
        """Queue `seconds` of compute on the current stream (the host returns at once)."""
        self.current.t += seconds


class Event:
    def __init__(self, device: Device) -> None:
        self.device, self.t = device, None

    def record(self, stream: Stream | None = None) -> None:
        self.t = (stream or self.device.current).t

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, end: Event) -> float:  # milliseconds, as torch's
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3


class Work:
    """A NCCL collective of `seconds`, launched from the current stream."""

    def __init__(self, device: Device, seconds: float) -> None:
        self.device = device
        start = max(device.current.t, device.nccl.t)
        self.end = device.nccl.t = start + seconds

    def wait(self) -> None:  # the current stream waits; the host does not
        s = self.device.current
        s.t = max(s.t, self.end)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Device, Any, CollectiveAggregator]]:
    device = Device()

    @contextlib.contextmanager
    def use(stream: Stream) -> Iterator[None]:
        before, device.current = device.current, stream
        try:
            yield
        finally:
            device.current = before

    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=True: Event(device))
    monkeypatch.setattr(torch.cuda, "Stream", lambda dev=None: Stream("timing"))
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(comm_mod, "_is_cuda", lambda t: True)
    comm, probe = probed_comm()  # the launches are the test's stand-ins
    yield device, comm, probe


def _launch(device: Device, seconds: float) -> Any:
    return lambda async_op: Work(device, seconds)


def _sync_launch(device: Device, seconds: float) -> Any:
    def launch(async_op: bool) -> Work:
        work = Work(device, seconds)
        work.wait()  # a synchronous NCCL call makes the current stream wait before returning
        return work

    return launch


def _measured(probe: CollectiveAggregator) -> tuple[float, float]:
    """(latency summed over the calls, exposed time); the window's wall time (the union of
    the calls' device intervals) is kept in WALL for the hidden-time checks."""
    window = probe.take()
    assert window.ready()
    stats = window.stats()
    WALL[:] = [window.wall_s]
    return sum(s.latency_sum_s for s in stats), window.exposed_s


WALL: list[float] = []


TENSOR = torch.empty(4)


def test_an_overlapped_collective_is_hidden_and_bounded_by_the_wait(gpu):
    # Launched with the compute stream at 0; 25 ms of compute queued after it; the 10 ms
    # collective ends at 10 while compute runs on; the compute stream reaches the wait at
    # 25 and does not stall. Exposed 0. Its end is seen where the compute stream has the
    # result, at 25: latency 25, the upper bound of its 10 (no event can be put on NCCL's
    # stream without a wait of zerowatch's own), and hidden 25.
    device, comm, probe = gpu
    handle = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, _launch(device, 10 * MS))
    device.kernel(25 * MS)
    handle.wait()
    latency, exposed = _measured(probe)
    assert latency == pytest.approx(25 * MS)
    assert exposed == pytest.approx(0.0)
    assert WALL[0] - exposed == pytest.approx(25 * MS)  # hidden
    assert device.compute.t == pytest.approx(25 * MS)


def test_a_half_exposed_collective_stalls_the_compute_stream_for_the_rest(gpu):
    # Launch at 0, 5 ms of compute, then wait: the compute stream stalls from 5 to 10.
    # Latency 10, exposed 5, hidden 5.
    device, comm, probe = gpu
    handle = comm._run("reduce_scatter", "grad_reduce", 1024, True, TENSOR,
                       _launch(device, 10 * MS))  # fmt: skip
    device.kernel(5 * MS)
    handle.wait()
    latency, exposed = _measured(probe)
    assert (latency, exposed) == (pytest.approx(10 * MS), pytest.approx(5 * MS))
    assert WALL[0] - exposed == pytest.approx(5 * MS)
    assert device.compute.t == pytest.approx(10 * MS)


def test_a_synchronous_collective_is_exposed_whole(gpu):
    # A synchronous 8 ms all-reduce with 3 ms of compute queued before it: it starts at 3,
    # the compute stream waits until 11. Latency 8, exposed 8, hidden 0.
    device, comm, probe = gpu
    device.kernel(3 * MS)
    comm._run("all_reduce", "other", 64, False, TENSOR, _sync_launch(device, 8 * MS))
    latency, exposed = _measured(probe)
    assert (latency, exposed) == (pytest.approx(8 * MS), pytest.approx(8 * MS))


def test_a_compute_queue_running_ahead_of_the_host_is_timed_on_the_device(gpu):
    # The host queues 20 ms of compute, launches a 10 ms gather and waits for it at once:
    # on the host nothing took any time (NCCL's wait returns immediately), yet the compute
    # stream reaches the launch at 20, the gather runs 20-30 and the stream stalls for all
    # of it. Latency 10, exposed 10: the device's times, not the host's.
    device, comm, probe = gpu
    device.kernel(20 * MS)
    handle = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, _launch(device, 10 * MS))
    handle.wait()
    latency, exposed = _measured(probe)
    assert (latency, exposed) == (pytest.approx(10 * MS), pytest.approx(10 * MS))


def test_prefetched_collectives_queue_on_their_stream(gpu):
    # Two 10 ms gathers launched back to back at 0: NCCL runs them 0-10 and 10-20. Compute
    # of 12 ms, then both waits: the first is done (no stall), the second stalls 12-20.
    # Latencies: 12 for the first (its end seen at its wait: the bound of its 10); 20 for
    # the second, counted from its launch point (it queued behind the first: the time a
    # prefetch waits for the link is its latency as the step sees it; exact, it stalled).
    # Exposed 8 in all. The calls spanned 0-20 (the union, not the latencies' sum of 32):
    # hidden 12.
    device, comm, probe = gpu
    first = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, _launch(device, 10 * MS))
    second = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, _launch(device, 10 * MS))
    device.kernel(12 * MS)
    first.wait()
    second.wait()
    latency, exposed = _measured(probe)
    assert latency == pytest.approx(32 * MS)
    assert exposed == pytest.approx(8 * MS)
    assert WALL[0] - exposed == pytest.approx(12 * MS)


def test_nothing_is_read_before_the_device_has_finished(gpu):
    # Events not yet completed (query() False) keep the window waiting: the recorder reads
    # the step a step later rather than synchronizing.
    device, comm, probe = gpu
    handle = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, _launch(device, 10 * MS))
    handle.wait()
    window = probe.take()
    rec = window.pending_cuda[0]
    rec.cuda_exposed[1].t, saved = None, rec.cuda_exposed[1].t
    assert not window.ready()
    rec.cuda_exposed[1].t = saved
    assert window.ready()
