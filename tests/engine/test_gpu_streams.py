"""The GPU timing path on a real device: the scenarios of test_gpu_timing_arithmetic.py
played on real CUDA streams and events (skipped without CUDA).

A collective here is modelled as NCCL runs one: on a stream of its own that first waits for
the point the launching stream has reached, with `wait()` making the *current* stream wait
for its end event while the host returns at once. Its work is `torch.cuda._sleep`, so its
duration is known (calibrated first). The same stand-in runs on a real NCCL group of one
rank below, where the collective is NCCL's own copy. Each scenario's expected latency,
exposed and hidden time is worked out in its test; the tolerance is what the host needs to
launch the kernels (0.4 ms), not a share of the result.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from support.engine_scenarios import TINY, ds_config, make_model, micro_batches
from support.ports import free_port
from support.probed_comm import probed_comm
from zerowatch.agent.probes.collectives import CollectiveAggregator
from zerowatch.agent.spool import read_events, segments

import zerowatch
from zerowatch import events as ev

pytestmark = pytest.mark.gpu

MS = 1e-3
TOL = 0.4 * MS


@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    """Clock cycles `torch.cuda._sleep` spins per millisecond on this device."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000)  # load the kernel
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


class Device:
    """The compute stream (current) and a collective stream, with kernels of known length."""

    def __init__(self, cycles_per_ms: float) -> None:
        self.cycles_per_ms = cycles_per_ms
        self.collective_stream = torch.cuda.Stream()

    def kernel(self, seconds: float) -> None:
        """Queue `seconds` of work on the current stream; the host returns at once."""
        torch.cuda._sleep(int(seconds / MS * self.cycles_per_ms))

    def launch(self, seconds: float) -> Any:
        return lambda async_op: Work(self, seconds)

    def sync_launch(self, seconds: float) -> Any:
        def launch(async_op: bool) -> Work:
            work = Work(self, seconds)
            work.wait()  # a synchronous NCCL call orders the current stream, then returns
            return work

        return launch


class Work:
    """A collective of `seconds` on the collective stream, as ProcessGroupNCCL launches one."""

    def __init__(self, device: Device, seconds: float) -> None:
        stream = device.collective_stream
        stream.wait_stream(torch.cuda.current_stream())  # starts at the launch point
        with torch.cuda.stream(stream):
            device.kernel(seconds)
            self.end = torch.cuda.Event()
            self.end.record()

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.end)


@pytest.fixture
def gpu(cycles_per_ms: float) -> Any:
    comm, probe = probed_comm()  # the launches are the test's stand-ins
    torch.cuda.synchronize()
    yield Device(cycles_per_ms), comm, probe
    torch.cuda.synchronize()


def _measured(probe: CollectiveAggregator) -> tuple[float, float, float]:
    """(latency summed over the window's calls, exposed, hidden) once the device is done.
    The test synchronizes here, after the scenario; the agent reads a step later instead."""
    torch.cuda.synchronize()
    window = probe.take()
    assert window.ready()
    latency = sum(s.latency_sum_s for s in window.stats())
    got = latency, window.exposed_s, window.wall_s - window.exposed_s
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
    print(f"{test}: latency, exposed, hidden (ms) = " + ", ".join(f"{v / MS:.3f}" for v in got))
    return got


TENSOR = torch.empty(4, device="cuda") if torch.cuda.is_available() else torch.empty(4)


def test_an_overlapped_collective_is_hidden_and_bounded_by_the_wait(gpu):
    # A 10 ms collective launched with the compute stream idle, 25 ms of compute queued
    # after it, then the wait: the collective ends at 10 while compute runs on to 25, so
    # the compute stream never stalls. Exposed 0; its end is seen at the wait (25), the
    # upper bound of its 10 (docs/gpu.md, "The agent and a collective's lifetime"): latency
    # 25, hidden 25.
    device, comm, probe = gpu
    handle = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, device.launch(10 * MS))
    device.kernel(25 * MS)
    handle.wait()
    latency, exposed, hidden = _measured(probe)
    assert latency == pytest.approx(25 * MS, abs=TOL)
    assert exposed == pytest.approx(0.0, abs=TOL)
    assert hidden == pytest.approx(25 * MS, abs=TOL)


def test_a_half_exposed_collective_stalls_the_compute_stream_for_the_rest(gpu):
    # Launch at 0, 5 ms of compute, then the wait: the compute stream stalls from 5 to 10.
    # Latency 10, exposed 5, hidden 5.
    device, comm, probe = gpu
    handle = comm._run("reduce_scatter", "grad_reduce", 1024, True, TENSOR,
                       device.launch(10 * MS))  # fmt: skip
    device.kernel(5 * MS)
    handle.wait()
    latency, exposed, hidden = _measured(probe)
    assert latency == pytest.approx(10 * MS, abs=TOL)
    assert exposed == pytest.approx(5 * MS, abs=TOL)
    assert hidden == pytest.approx(5 * MS, abs=TOL)


def test_a_synchronous_collective_is_exposed_whole(gpu):
    # 3 ms of compute queued, then a synchronous 8 ms all-reduce: it starts at 3 and the
    # compute stream waits until 11. Latency 8, exposed 8, hidden 0.
    device, comm, probe = gpu
    device.kernel(3 * MS)
    comm._run("all_reduce", "other", 64, False, TENSOR, device.sync_launch(8 * MS))
    latency, exposed, hidden = _measured(probe)
    assert latency == pytest.approx(8 * MS, abs=TOL)
    assert exposed == pytest.approx(8 * MS, abs=TOL)
    assert hidden == pytest.approx(0.0, abs=TOL)


def test_a_compute_queue_running_ahead_of_the_host_is_timed_on_the_device(gpu):
    # The host queues 20 ms of compute, launches a 10 ms gather and waits for it at once.
    # The host is through all of it in well under a millisecond, yet the gather runs 20-30
    # on the device and the compute stream stalls for all of it: latency 10, exposed 10.
    device, comm, probe = gpu
    t0 = time.perf_counter()
    device.kernel(20 * MS)
    handle = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, device.launch(10 * MS))
    handle.wait()
    host = time.perf_counter() - t0
    latency, exposed, _ = _measured(probe)
    assert host < 10 * MS  # what a host clock would have called the collective's time
    assert latency == pytest.approx(10 * MS, abs=TOL)
    assert exposed == pytest.approx(10 * MS, abs=TOL)


def test_prefetched_collectives_queue_on_their_stream(gpu):
    # Two 10 ms gathers launched back to back: they run 0-10 and 10-20 on the collective
    # stream. 12 ms of compute, then both waits: the first is done, the second stalls the
    # compute stream 12-20. Latencies 12 (the first's end seen at its wait, the bound of
    # its 10) and 20 (the second counted from its launch point), exposed 8, the calls
    # spanning 0-20: hidden 12.
    device, comm, probe = gpu
    first = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, device.launch(10 * MS))
    second = comm._run("all_gather", "param_fetch", 1024, True, TENSOR, device.launch(10 * MS))
    device.kernel(12 * MS)
    first.wait()
    second.wait()
    latency, exposed, hidden = _measured(probe)
    assert latency == pytest.approx(32 * MS, abs=2 * TOL)
    assert exposed == pytest.approx(8 * MS, abs=TOL)
    assert hidden == pytest.approx(12 * MS, abs=TOL)


@pytest.fixture
def nccl_group() -> Any:
    """A real NCCL process group of one rank (one GPU here)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))  # fmt: skip
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_real_nccl_collective_is_timed_on_its_own_stream(gpu, nccl_group):
    # NCCL's all-gather of one rank is a device copy on NCCL's stream (~1 GiB here, some
    # tenths of a millisecond). (1) Launched behind 20 ms of queued compute and waited for
    # at once: the compute stream stalls for the whole copy: exposed = latency, and the
    # latency is what an event pair around the same copy on the compute stream measures.
    # (2) Launched with 20 ms of compute queued after it: exposed ~0, hidden = latency
    # (the 20 ms to the wait: the bound of a hidden collective's time).
    device, comm, probe = gpu
    comm.group = nccl_group
    src = torch.ones(1 << 28, device="cuda")
    out = torch.empty_like(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out.copy_(src)
    b.record()
    b.synchronize()
    copy_s = a.elapsed_time(b) * MS

    device.kernel(20 * MS)
    comm.all_gather(out, src, async_op=True).wait()
    latency, exposed, hidden = _measured(probe)
    assert 0.0 < latency < copy_s * 3 + TOL, (latency, copy_s)
    assert exposed == pytest.approx(latency, abs=TOL)

    # The latency is the queued compute's own length, read by an event pair around it (the
    # calibrated sleep runs at whatever clock the GPU is at: 20.7 ms measured on an H200).
    handle = comm.all_gather(out, src, async_op=True)
    a.record()
    device.kernel(20 * MS)
    b.record()
    handle.wait()
    latency, exposed, hidden = _measured(probe)
    b.synchronize()
    assert latency == pytest.approx(a.elapsed_time(b) * MS, abs=TOL)
    assert exposed == pytest.approx(0.0, abs=TOL)
    assert hidden == pytest.approx(latency, abs=TOL)
    assert torch.equal(out, src)


@pytest.mark.parametrize(
    "stage,overlap,offload",
    [(0, False, False), (1, True, False), (2, True, True), (3, False, False), (3, True, True)],
)
def test_engine_steps_on_cuda_decompose_exactly_without_synchronizing(
    stage: int, overlap: bool, offload: bool, tmp_path, monkeypatch
) -> None:
    # The engine on the GPU, instrumented: phases are CUDA events on the compute stream,
    # read a step later. Every step's exclusive parts sum to its step time (1% or 0.2 ms),
    # none is negative, and nothing synchronized the device while training ran.
    monkeypatch.delenv("ZEROWATCH_SERVER", raising=False)
    syncs: list[int] = []
    real_sync = torch.cuda.synchronize
    config = ds_config(stage, overlap=overlap, offload_optimizer=offload,
                       offload_param=offload and stage == 3, precision="bf16")  # fmt: skip
    engine, *_ = zerowatch.initialize(model=make_model(), config=config)
    assert engine.device.type == "cuda"
    run = zerowatch.instrument(engine, spool_dir=tmp_path / "spool")
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a, **k: syncs.append(1) or real_sync(*a, **k))  # fmt: skip
    steps = 8
    for s in range(steps):
        for x, y in micro_batches(TINY, s, 1, 1, 0):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    during = len(syncs)
    run.close()
    assert during == 0
    events = []
    for seg in segments(run.spool_path / "rank-00000"):
        events.extend(obj for _, obj in read_events(seg))
    got = [e for e in events if e["kind"] == "step"]
    assert len(got) == steps
    for e in got:
        parts, step = e["parts"], e["step_time_s"]
        assert set(parts) == set(ev.STEP_PARTS)
        assert min(parts.values()) >= 0.0, parts
        assert abs(sum(parts.values()) - step) <= max(0.01 * step, 2e-4), (parts, step)
        assert e["memory"]["device"] == "cuda"
        if offload:
            assert e["offload"], e  # the host copies were timed


def test_clock_marks_follow_the_current_stream(cycles_per_ms: float) -> None:
    # The clock keeps the current stream's object between marks; under `torch.cuda.stream`
    # a mark lands on that stream. A 10 ms kernel queued on a side stream: the mark made
    # there completes after it, the next mark on the default stream does not wait for it.
    from zerowatch.agent.probes.clock import CudaClock

    clock, side = CudaClock("cuda:0"), torch.cuda.Stream()
    torch.cuda.synchronize()
    first = clock.mark(0.0)
    with torch.cuda.stream(side):
        side.wait_event(first[1])
        Device(cycles_per_ms).kernel(10 * MS)
        on_side = clock.mark(0.0)
    back = clock.mark(0.0)
    torch.cuda.synchronize()
    assert clock.seconds(first, on_side) == pytest.approx(10 * MS, abs=TOL)
    assert clock.seconds(first, back) < TOL
