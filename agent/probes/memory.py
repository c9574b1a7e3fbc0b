"""Memory of one rank per step, next to the ZeRO theory.

* On CUDA: the caching allocator's peak per top-level phase (`reset_peak_memory_stats` at
  the phase start, the allocated-bytes peak at its end), reserved bytes, the device
  capacity, allocation retries (`num_alloc_retries`: the allocator had to free its cache to
  satisfy a request, a sign of fragmentation) and OOMs. Every read is one
  `memory_stats_as_nested_dict`: `max_memory_allocated` and `memory_reserved` each build
  and flatten the whole `memory_stats` dict in Python, ~145 us a call on an H100 host
  (measured: bench/agent_overhead.py --cuda), which made the agent cost 25% of a 9 ms step.
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


class CudaMemoryProbe(MemoryProbe):
    """Allocator peaks per phase (reset between phases) plus the CPU side's RSS peak."""

    device_kind = "cuda"

    def __init__(self, theory: dict[str, int], device: Any) -> None:
        super().__init__(theory)  # (every step: the allocator's peaks are no system calls)
        import torch

        self._cuda = torch.cuda
        self._device = torch.device(device).index
        if self._device is None:
            self._device = torch.cuda.current_device()
        self._stats = torch.cuda.memory_stats_as_nested_dict
        self._capacity = int(torch.cuda.get_device_properties(self._device).total_memory)

    def phase_start(self, phase: str) -> None:
        self._cuda.reset_peak_memory_stats(self._device)

    def phase_end(self, phase: str) -> None:
        value = int(_stat(self._stats(self._device), "allocated_bytes", "peak"))
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


__all__ = ["CudaMemoryProbe", "MemoryProbe", "RssReader", "rss_peak_bytes"]
