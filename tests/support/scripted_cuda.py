"""A scripted stand-in for CUDA streams, events and ProcessGroupNCCL work, with a log.

No GPU is lent to these machines, so what the agent does to a job's streams and tensors on
a GPU is checked against a device model whose timestamps the test sets and which writes
down every call that could change what the job computes:

* a `Stream` is a queue: `t` is when the work queued on it so far completes (seconds);
* an `Event` recorded on a stream completes when the stream's queued work has (`record`
  is logged with the stream it went on);
* a `Work` is a NCCL collective as torch >= 2.8 launches one: it starts once the launching
  stream reaches the launch point and NCCL's own stream is free, it keeps its tensors
  alive on a shelf until `wait()`, and `wait()` makes only the *current* stream wait for
  its end and then releases them (the host returns at once). Every `wait()` is logged with
  the stream it made wait and whether the job's own code (`Device.caller`) made the call.

`install(monkeypatch)` puts the stand-in in place of `torch.cuda`'s Event, Stream, stream,
current_stream and current_device and returns the `Device`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist


class Stream:
    """A CUDA stream: `t` is when the work queued on it so far completes (seconds)."""

    def __init__(self, device: Device, name: str) -> None:
        self.device, self.name, self.t = device, name, 0.0

    def wait_event(self, event: Event) -> None:
        self.device.log.append(("stream_wait", self.name, self.device.in_caller))
        assert event.t is not None
        self.t = max(self.t, event.t)

    def wait_stream(self, other: Stream) -> None:
        self.device.log.append(("stream_wait", self.name, self.device.in_caller))
        self.t = max(self.t, other.t)


class Event:
    def __init__(self, device: Device) -> None:
        self.device, self.t = device, None
        self.stream: str | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self.device.current
        self.t, self.stream = stream.t, stream.name
        self.device.log.append(("record", stream.name, self.device.in_caller))

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, end: Event) -> float:  # milliseconds, as torch's
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3


class Device:
    """The scripted device: a compute stream (current by default) and NCCL's stream."""

    def __init__(self) -> None:
        #: ("record" | "stream_wait" | "work_wait", stream name, made by the job's code?)
        self.log: list[tuple[str, str, bool]] = []
        self.compute = Stream(self, "compute")
        self.nccl = Stream(self, "nccl")
        self.current = self.compute
        self.in_caller = False
        self.streams_made = 0

    def kernel(self, seconds: float) -> None:
        """Queue `seconds` of compute on the current stream (the host returns at once)."""
        self.current.t += seconds

    @contextlib.contextmanager
    def caller(self) -> Iterator[None]:
        """The job's own code runs inside (its waits are its own)."""
        before, self.in_caller = self.in_caller, True
        try:
            yield
        finally:
            self.in_caller = before

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def calls(self, kind: str) -> list[tuple[str, bool]]:
        return [(stream, mine) for k, stream, mine in self.log if k == kind]


class Work(dist.Work):
    """A NCCL collective of `seconds` launched from the current stream, holding `tensors`
    on its shelf until `wait()` (ProcessGroupNCCL's `stashed_for_allocator_safety_`)."""

    def __init__(self, device: Device, seconds: float, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.device = device
        start = max(device.current.t, device.nccl.t)
        self.end = device.nccl.t = start + seconds
        self.shelf: list[torch.Tensor] = list(tensors)

    def wait(self, timeout: Any = None) -> bool:
        s = self.device.current
        self.device.log.append(("work_wait", s.name, self.device.in_caller))
        s.t = max(s.t, self.end)  # only the current stream waits; the host does not
        self.shelf.clear()  # torch >= 2.8: released once the current stream waits
        return True

    def is_completed(self) -> bool:
        return False

    def get_future(self) -> Any:
        raise RuntimeError("no future in the stand-in")


def install(monkeypatch: pytest.MonkeyPatch) -> Device:
    """Put the scripted device in place of `torch.cuda`'s streams and events."""
    device = Device()

    def make_stream(*_: Any, **__: Any) -> Stream:
        device.streams_made += 1
        return Stream(device, f"side-{device.streams_made}")

    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=True: Event(device))
    monkeypatch.setattr(torch.cuda, "Stream", make_stream)
    monkeypatch.setattr(torch.cuda, "stream", device.use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: device.current)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return device
