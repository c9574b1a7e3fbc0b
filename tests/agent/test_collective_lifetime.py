"""The agent and a collective's lifetime on a GPU (docs/gpu.md), with a scripted device.

From torch 2.8 ProcessGroupNCCL keeps an async collective's tensors alive until `wait()`,
and `wait()` releases them after making only the *current* stream wait. Whoever calls
`wait()` therefore decides when the caching allocator may hand those tensors' memory to
other work. The rule, for the bundled engine's `Comm` and for `dist_wrap` (DeepSpeed,
FSDP2, DDP): zerowatch never calls `wait()` on a work itself (only the caller does, and the
wrapper merely passes that call on), never makes a stream wait that the caller did not,
records its events only on the streams the caller uses, never holds a collective's tensor
past the caller's own wait and never lets one go before it; the latency and exposed time
come from the events around the caller's launch and wait.

The collectives here are the stand-in of tests/support/scripted_cuda.py: their tensors sit
on the work's shelf until its `wait()`, and every wait, stream wait and event record is
logged with whether the job's own code made it.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support import scripted_cuda
from support.probed_comm import probed_comm
from support.scripted_cuda import Device, Work
from zerowatch.agent.adapters import dist_wrap
from zerowatch.agent.probes.collectives import CollectiveAggregator

MS = 1e-3


class _OnDevice(torch.Tensor):
    """A host tensor that says it is on the GPU: what the timing paths look at."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def _cuda_tensor(n: int) -> torch.Tensor:
    return torch.Tensor._make_subclass(_OnDevice, torch.zeros(n))


#: (device, launch(out, inp, seconds) -> what the caller waits on, the probe)
Path = tuple[Device, Callable[[torch.Tensor, torch.Tensor, float], Any], CollectiveAggregator]


def _engine(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The bundled engine: `Comm.all_gather`'s path, returning the engine's `Handle`."""
    device = scripted_cuda.install(monkeypatch)
    comm, probe = probed_comm()

    def launch(out: torch.Tensor, inp: torch.Tensor, seconds: float) -> Any:
        nbytes = out.numel() * out.element_size()
        return comm._run("all_gather", "param_fetch", nbytes, True, out,
                         lambda a: Work(device, seconds, [out, inp]))  # fmt: skip

    return device, launch, probe


def _foreign(monkeypatch: pytest.MonkeyPatch) -> Path:
    """DeepSpeed / FSDP2: `torch.distributed.all_gather_into_tensor` wrapped by dist_wrap,
    returning the wrapper's `TimedWork`."""
    device = scripted_cuda.install(monkeypatch)
    probe = CollectiveAggregator()
    tap = dist_wrap.CollectiveTap(lambda op: "param_fetch", probe.record)
    monkeypatch.setattr(dist_wrap._HUB, "taps", (tap,))
    monkeypatch.setattr(dist_wrap._HUB, "world", lambda group: 2)
    seconds: list[float] = []

    def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               group: Any = None, async_op: bool = False) -> Any:  # fmt: skip
        return Work(device, seconds.pop(), [output_tensor, input_tensor])

    wrapped = dist_wrap._HUB.wrap(all_gather_into_tensor,
                                  dist_wrap.SPECS["all_gather_into_tensor"])  # fmt: skip

    def launch(out: torch.Tensor, inp: torch.Tensor, s: float) -> Any:
        seconds.append(s)
        return wrapped(out, inp, async_op=True)

    return device, launch, probe


@pytest.fixture(params=["engine", "dist_wrap"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Path:
    return (_engine if request.param == "engine" else _foreign)(monkeypatch)


def _measured(probe: CollectiveAggregator) -> tuple[float, float]:
    window = probe.take()
    assert window.ready()
    stats = window.stats()
    return sum(s.latency_sum_s for s in stats), window.exposed_s


def test_only_the_caller_waits_and_no_stream_is_made_to_wait(path: Path) -> None:
    device, launch, probe = path
    out, inp = _cuda_tensor(8), _cuda_tensor(4)
    work = launch(out, inp, 10 * MS)
    device.kernel(5 * MS)
    assert device.calls("work_wait") == []  # nobody waited at the launch
    with device.caller():
        work.wait()
    # The one wait is the caller's, on the caller's stream; no other stream waited.
    assert device.calls("work_wait") == [("compute", True)]
    assert device.calls("stream_wait") == []
    assert device.streams_made == 0  # no side stream of the agent's
    assert {stream for stream, _ in device.calls("record")} == {"compute"}
    assert len(probe.take().pending_cuda) == 1


def test_the_collectives_tensors_live_exactly_as_long_as_the_caller_keeps_them(
    path: Path,
) -> None:
    # The caller drops its input right after the launch (FSDP2 and DeepSpeed do: the work's
    # shelf keeps it alive for NCCL). Until the caller's wait nothing may let it go; after
    # the wait, with the caller's references gone, nothing of zerowatch's may hold either.
    device, launch, probe = path
    out, inp = _cuda_tensor(8), _cuda_tensor(4)
    work = launch(out, inp, 10 * MS)
    alive_in, alive_out = weakref.ref(inp), weakref.ref(out)
    del inp
    device.kernel(5 * MS)
    gc.collect()
    assert alive_in() is not None, "the input was released before the caller's wait"
    with device.caller():
        work.wait()
    del work, out
    gc.collect()
    assert alive_in() is None and alive_out() is None
    window = probe.take()  # the record is still unread: it holds events, not tensors
    assert len(window.pending_cuda) == 1


def test_a_half_exposed_collective_is_timed_from_the_callers_events(path: Path) -> None:
    # Launched with the compute stream at 0; the 10 ms collective runs 0-10; 5 ms of
    # compute, then the caller's wait: its stream stalls 5-10. Latency 10 (the stream got
    # the result at 10: exact, because it stalled), exposed 5.
    device, launch, probe = path
    work = launch(_cuda_tensor(8), _cuda_tensor(4), 10 * MS)
    device.kernel(5 * MS)
    with device.caller():
        work.wait()
    latency, exposed = _measured(probe)
    assert (latency, exposed) == (pytest.approx(10 * MS), pytest.approx(5 * MS))


def test_a_hidden_collectives_latency_is_bounded_by_the_callers_wait(path: Path) -> None:
    # The 10 ms collective runs 0-10 while 25 ms of compute runs; the caller's stream
    # reaches its wait at 25 and does not stall. Without an event on NCCL's stream (and no
    # wait of zerowatch's own), the end the agent sees is the wait: latency 25, an upper
    # bound of the collective's 10; exposed 0, exact.
    device, launch, probe = path
    work = launch(_cuda_tensor(8), _cuda_tensor(4), 10 * MS)
    device.kernel(25 * MS)
    with device.caller():
        work.wait()
    latency, exposed = _measured(probe)
    assert (latency, exposed) == (pytest.approx(25 * MS), pytest.approx(0.0))


def test_a_collective_waited_for_on_another_stream_is_timed_there(path: Path) -> None:
    # FSDP2 launches its all-gathers from a stream of its own and waits on the compute
    # stream: the launch event goes on the launching stream, the wait's on the waiting
    # one, and only the waiting stream waits. The all-gather stream is at 2 when it
    # launches (the collective runs 2-12); the compute stream is at 4 when it waits.
    device, launch, probe = path
    side = scripted_cuda.Stream(device, "all_gather")
    side.t = 2 * MS
    with device.use(side):
        work = launch(_cuda_tensor(8), _cuda_tensor(4), 10 * MS)
    device.kernel(4 * MS)
    with device.caller():
        work.wait()
    assert device.calls("work_wait") == [("compute", True)]
    assert [s for s, _ in device.calls("record")] == ["all_gather", "compute", "compute"]
    latency, exposed = _measured(probe)
    assert (latency, exposed) == (pytest.approx(10 * MS), pytest.approx(8 * MS))


def test_ddps_hook_times_the_all_reduce_on_its_future_callbacks_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DDP's communication hook (`allreduce_seen`, zerowatch's own, as DDP's default hook)
    # waits through the work's future: its callback runs on a stream the future made wait
    # for the all-reduce, and `TimedWork.completed` records the end there. The all-reduce
    # runs 0-6 while the callback's stream got the result at 6; nothing waits on the work.
    device, launch, probe = _foreign(monkeypatch)
    work = launch(_cuda_tensor(8), _cuda_tensor(4), 6 * MS)
    callback = scripted_cuda.Stream(device, "callback")
    callback.t = 6 * MS  # (made to wait for the collective by the future, not by zerowatch)
    with device.use(callback):
        work.completed()
    assert device.calls("work_wait") == [] and device.calls("stream_wait") == []
    assert [s for s, _ in device.calls("record")] == ["compute", "callback"]
    latency, exposed = _measured(probe)
    assert (latency, exposed) == (pytest.approx(6 * MS), 0.0)
