"""Memory of one rank per step, next to the ZeRO theory.

* On CUDA: the allocated bytes' peak per top-level phase, reserved bytes, the device
  capacity, allocation retries (`num_alloc_retries`: the allocator had to free its cache to
  satisfy a request, a sign of fragmentation) and OOMs. The allocator's peak statistics are
  never reset: `reset_peak_memory_stats` resets every peak of the process, the user's
  `max_memory_allocated()` among them. So a phase's peak comes from the allocated bytes'
  statistics read at its two ends (`peak_between`): exact where they prove it (the phase
  raised the allocator's high-water mark; it only allocated; it only freed), else the
  larger of the allocated bytes at its two ends, a lower bound (docs/gpu.md). Every read is
  one `memory_stats_as_nested_dict` (two per top-level phase, one at the step's end):
  `max_memory_allocated` and `memory_reserved` each build and flatten the whole
  `memory_stats` dict in Python, ~145 us a call on an H100 host (measured:
  bench/agent_overhead.py --cuda), which made the agent cost 25% of a 9 ms step.
* On CPU: the process RSS at the end of each top-level phase (the peak of those readings
  per phase) and the process's lifetime RSS peak (`ru_maxrss`), read on every `every`-th
  step (the agent's `memory_every`, 10) and repeated between: each reading is a system
  call, and between the engine's kernels, which evict the CPU's caches, one costs the
  training thread 12-25 µs (a /proc/self/statm read 25, getrusage 12; measured at stage
  3 on the development machine), four a step 0.09 ms of a 90 ms step.
* Everywhere: the engine's own model-state bytes per kind (the tensors it holds, from the
  adapter) and the theory's bytes for this stage, so measured sits beside expected.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

from zerowatch import events as ev

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RssReader:
    """Current resident set size, cheaply: a pread of /proc/self/statm, else psutil."""

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._proc: Any = None
        if self._fd is None:
            try:
                import psutil

                self._proc = psutil.Process()
            except ImportError:
                self._proc = None

    def __call__(self) -> int:
        if self._fd is not None:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) * _PAGE
        if self._proc is not None:
            return int(self._proc.memory_info().rss)
        return 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def rss_peak_bytes() -> int:
    """The process's lifetime resident-set peak (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MemoryProbe:
    """Peaks per top-level phase; `take()` builds the step's MemoryStats."""

    device_kind = "cpu"

    def __init__(self, theory: dict[str, int], every: int = 1) -> None:
        self._theory = dict(theory)
        self._rss = RssReader()
        self._every = max(int(every), 1)
        self._peaks: dict[str, int] = {}
        self._rss_seen = 0
        #: Whether the step in progress reads the RSS (`begin_step`).
        self.reading = True
        self._last_peaks: dict[str, int] = {}
        self._last_rss_peak = 0
        self._last_stats: ev.MemoryStats | None = None
        self._last_state: dict[str, int] | None = None

    def begin_step(self, n: int) -> None:
        """The `n`-th recorded step starts: it reads the RSS on every `every`-th step (and
        until a reading exists); the others repeat the last readings."""
        self.reading = n % self._every == 0 or not self._last_peaks

    def phase_start(self, phase: str) -> None:
        pass

    def phase_end(self, phase: str) -> None:
        if not self.reading:
            return
        value = self._rss()
        self._rss_seen = max(self._rss_seen, value)
        if value > self._peaks.get(phase, 0):
            self._peaks[phase] = value

    def take(self, model_state: dict[str, int]) -> ev.MemoryStats:
        """The step's MemoryStats. A step that read nothing gets the last step's object
        again when the model-state bytes are the same ones (the recorder reads those on the
        same steps): an event's MemoryStats is only ever encoded, never changed."""
        last = self._last_stats
        if not self.reading and last is not None and self._last_state is model_state:
            return last
        if self.reading:
            self._last_peaks, self._peaks = self._peaks, {}
            # ru_maxrss is updated lazily by the kernel: never report less than we saw.
            self._last_rss_peak = max(rss_peak_bytes(), self._rss_seen)
        stats = ev.MemoryStats(
            peak_by_phase=dict(self._last_peaks),
            model_state=dict(model_state),
            model_state_theory=dict(self._theory),
            device="cpu",
            rss_peak_bytes=self._last_rss_peak,
        )
        self._last_stats, self._last_state = stats, model_state
        return stats

    def close(self) -> None:
        self._rss.close()


def peak_between(start: tuple[int, int, int, int], end: tuple[int, int, int, int]) -> int:
    """The allocated bytes' peak between two readings of the allocator's statistics, each
    (current, peak, ever allocated, ever freed) bytes, without resetting its peak.

    Exact when the readings prove it: the peak rose in between (the new high is the
    interval's: everything before it was at most the old one, also after a reset of the
    user's in between); nothing was allocated (the bytes only fell: the start's); nothing
    was freed (they only rose: the end's). Otherwise the interval rose and fell below the
    high-water mark and its own peak is known only to lie between the larger of its ends
    (returned: a lower bound) and that mark. A peak that fell (the user reset it in
    between) is a peak of part of the interval, also a lower bound.
    """
    cur0, peak0, alloc0, freed0 = start
    cur1, peak1, alloc1, freed1 = end
    if peak1 > peak0:
        return peak1
    if alloc1 == alloc0:
        return cur0
    if freed1 == freed0:
        return cur1
    return max(cur0, cur1, peak1 if peak1 < peak0 else 0)


class CudaMemoryProbe(MemoryProbe):
    """Allocated-bytes peaks per phase, the allocator's peaks left alone (`peak_between`),
    plus the CPU side's RSS peak."""

    device_kind = "cuda"

    def __init__(self, theory: dict[str, int], device: Any) -> None:
        super().__init__(theory)  # (every step: the allocator's peaks are no system calls)
        import torch

        self._device = torch.device(device).index
        if self._device is None:
            self._device = torch.cuda.current_device()
        self._stats = torch.cuda.memory_stats_as_nested_dict
        self._capacity = int(torch.cuda.get_device_properties(self._device).total_memory)
        #: phase -> the allocated bytes' statistics at its start.
        self._at_start: dict[str, tuple[int, int, int, int]] = {}

    def _allocated(self) -> tuple[int, int, int, int]:
        """(current, peak, ever allocated, ever freed) allocated bytes, over all pools."""
        stat = self._stats(self._device).get("allocated_bytes", {}).get("all", {})
        return (int(stat.get("current", 0)), int(stat.get("peak", 0)),
                int(stat.get("allocated", 0)), int(stat.get("freed", 0)))  # fmt: skip

    def phase_start(self, phase: str) -> None:
        self._at_start[phase] = self._allocated()

    def phase_end(self, phase: str) -> None:
        end = self._allocated()
        start = self._at_start.pop(phase, None)
        value = peak_between(start, end) if start is not None else end[0]
        if value > self._peaks.get(phase, 0):
            self._peaks[phase] = value

    def take(self, model_state: dict[str, int]) -> ev.MemoryStats:
        stats = super().take(model_state)
        counters = self._stats(self._device)
        stats.device = "cuda"
        stats.reserved_bytes = int(_stat(counters, "reserved_bytes", "current"))
        stats.capacity_bytes = self._capacity
        stats.alloc_retries = int(counters.get("num_alloc_retries", 0))
        stats.ooms = int(counters.get("num_ooms", 0))
        return stats


def _stat(nested: dict[str, Any], name: str, which: str) -> int:
    """One allocator statistic over all pools (`memory_stats`' "<name>.all.<which>")."""
    return int(nested.get(name, {}).get("all", {}).get(which, 0))


__all__ = ["CudaMemoryProbe", "MemoryProbe", "RssReader", "peak_between", "rss_peak_bytes"]
