"""GPU health next to the step: the rank's own GPU read through NVML (`pynvml`, PyPI
`nvidia-ml-py`), off the training thread.

A daemon thread of its own (`zerowatch-gpu-rank<r>`) takes one `GpuSample` about once a
second: SM and memory clocks, clock event (throttle) reasons, temperature, power against
its limit, XID events, ECC and row-remap counts, PCIe and NVLink throughput. The samples
wait in a short ring; when the shipper thread builds a step's event it asks `window(start,
end)` for the samples taken while the step ran and summarises them into an
`events.GpuTelemetry` (a list walk, no NVML call). So the training thread never calls NVML,
and the shipper never waits for it.

Every NVML read is guarded on its own: a call the card or driver does not support
(`NVMLError_NotSupported`, a missing function in an older `pynvml`) leaves that field None
and is not tried again; nothing raises into training. Without `pynvml` or a device
`gpu_probe()` returns `NullGpuProbe`, which does nothing; without a driver the sampler
thread finds out (NVML is opened there, never on the training thread) and ends, and every
step's record is None.

Which GPU: the rank's CUDA device index is an index into CUDA_VISIBLE_DEVICES, NVML's are
the machine's, so the device is found by its UUID or PCI bus id as torch reports them
(`device_identity`), else by the CUDA_VISIBLE_DEVICES entry at that index, else by the
index itself.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from zerowatch.agent.errors import AgentHealth, log

from zerowatch import events as ev

#: Seconds between two samples.
SAMPLE_INTERVAL_S = 1.0
#: Samples kept (10 minutes at 1 Hz): a step is built at most a flush interval (<= 30 s)
#: after it ended.
RING = 600
#: A step shorter than the interval carries the newest sample at most this old at its end.
STALE_S = 5.0


class GpuProbe(Protocol):
    """What the recorder asks of a GPU probe (on the shipper thread)."""

    def start(self) -> None: ...

    def window(self, start: float, end: float) -> ev.GpuTelemetry | None:
        """The GPU during [start, end] (unix seconds), or None when nothing is known."""
        ...

    def close(self) -> None: ...


class NullGpuProbe:
    """No NVML, no GPU, or turned off: does nothing."""

    def start(self) -> None:
        pass

    def window(self, start: float, end: float) -> ev.GpuTelemetry | None:
        return None

    def close(self) -> None:
        pass


@dataclass(slots=True)
class GpuSample:
    """One reading of the GPU (None: not supported)."""

    time: float
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    mem_clock_mhz: float | None = None
    reasons: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    xid_errors: int | None = None
    last_xid: int | None = None
    ecc_errors: int | None = None
    remapped_rows: int | None = None
    remap_pending: bool | None = None
    pcie_tx: float | None = None
    pcie_rx: float | None = None
    nvlink_tx: float | None = None
    nvlink_rx: float | None = None


class NvmlReader:
    """Reads one NVML device; each reading guarded, an unsupported one dropped for good.

    Error counts are reported since the first sample (its values are their zero)."""

    def __init__(self, nvml: Any, handle: Any, health: AgentHealth) -> None:
        self._nvml = nvml
        self._h = handle
        self._health = health
        self._off: set[str] = set()
        self._base: dict[str, int] = {}
        self._xids = 0
        self._last_xid: int | None = None
        self._events: Any = None
        self._nvlink_prev: tuple[float, float, float] | None = None
        self._sm_max = self._read("sm_max", lambda: nvml.nvmlDeviceGetMaxClockInfo(
            handle, nvml.NVML_CLOCK_SM))  # fmt: skip
        try:
            es = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, es)
            self._events = es
        except Exception:
            self._events = None  # no XID events on this card / driver: counts stay None

    def _read(self, key: str, fn: Callable[[], Any]) -> Any:
        if key in self._off:
            return None
        try:
            return fn()
        except Exception as e:  # NotSupported, NoPermission, an older pynvml, a bad reading
            self._off.add(key)
            log.debug("zerowatch agent: NVML %s unavailable (%s)", key, e)
            return None

    def _since_start(self, key: str, value: int | None) -> int | None:
        if value is None:
            return None
        base = self._base.setdefault(key, value)
        return max(value - base, 0)

    def _poll_xids(self) -> int | None:
        if self._events is None:
            return None
        nvml = self._nvml
        for _ in range(64):  # events queued since the last sample
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: none waiting
                break
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                self._xids += 1
                self._last_xid = int(data.eventData)
        return self._xids

    def sample(self) -> GpuSample:
        nvml, h, r = self._nvml, self._h, self._read
        s = GpuSample(time=time.time())
        s.sm_clock_mhz = r("sm", lambda: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)))
        s.sm_clock_max_mhz = self._sm_max
        s.mem_clock_mhz = r(
            "mem", lambda: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM))
        )
        s.reasons = r("reasons", lambda: int(_reasons(nvml, h)))
        s.temperature_c = r("temp", lambda: float(nvml.nvmlDeviceGetTemperature(
            h, nvml.NVML_TEMPERATURE_GPU)))  # fmt: skip
        s.power_w = r("power", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
        s.power_limit_w = r("limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
        s.xid_errors = self._poll_xids()
        s.last_xid = self._last_xid
        ecc = r("ecc", lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
            h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)))  # fmt: skip
        s.ecc_errors = self._since_start("ecc", ecc)
        remap = r("remap", lambda: nvml.nvmlDeviceGetRemappedRows(h))
        if remap is not None:  # (correctable rows, uncorrectable rows, pending, failure)
            s.remapped_rows = self._since_start("remap", int(remap[1]))
            s.remap_pending = bool(remap[2])
        kb = 1000.0  # NVML's PCIe throughput is in KB/s
        tx = r("pcie_tx", lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES))
        rx = r("pcie_rx", lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES))
        s.pcie_tx = tx * kb if tx is not None else None
        s.pcie_rx = rx * kb if rx is not None else None
        s.nvlink_tx, s.nvlink_rx = self._nvlink(s.time)
        return s

    def _nvlink(self, now: float) -> tuple[float | None, float | None]:
        """NVLink bytes/s from the change of the data throughput counters (KiB, all links)."""
        nvml = self._nvml

        def read() -> tuple[float, float]:
            ids = [
                nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
            ]
            values = nvml.nvmlDeviceGetFieldValues(self._h, ids)
            if any(v.nvmlReturn != nvml.NVML_SUCCESS for v in values):
                raise RuntimeError("NVLink throughput counters not supported")
            return float(values[0].value.ullVal) * 1024, float(values[1].value.ullVal) * 1024

        got = self._read("nvlink", read)
        if got is None:
            return None, None
        prev, self._nvlink_prev = self._nvlink_prev, (now, *got)
        if prev is None or now <= prev[0]:
            return None, None
        dt = now - prev[0]
        return max(got[0] - prev[1], 0.0) / dt, max(got[1] - prev[2], 0.0) / dt

    def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlEventSetFree(self._events)


def _reasons(nvml: Any, h: Any) -> int:
    fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if fn is None:  # pynvml before the rename
        fn = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(fn(h))


#: What opens NVML for a probe, on its own thread: the sampling function and what closes
#: it, or None when NVML or the device is not there.
Connect = Callable[[], "tuple[Callable[[], GpuSample], Callable[[], None]] | None"]


class NvmlGpuProbe:
    """Samples one GPU on a daemon thread of its own; `window` summarises a step's samples.

    NVML is opened (`connect`), read and shut down on that thread only: `instrument()` and
    `close()` on the training thread make no NVML call either. Without NVML or the device,
    the thread ends at once and every window is None."""

    def __init__(
        self,
        reader: Callable[[], GpuSample] | None = None,
        *,
        connect: Connect | None = None,
        health: AgentHealth,
        rank: int = 0,
        interval_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        self._reader = reader
        self._connect = connect
        self._on_close: Callable[[], None] | None = None
        self._health = health
        self._interval = interval_s
        self._ring: deque[GpuSample] = deque(maxlen=RING)
        self._stop = threading.Event()
        #: Seconds spent sampling and samples taken (the benchmark's cost per second).
        self.busy_s = 0.0
        self.n_samples = 0
        self._thread = threading.Thread(
            target=self._main, name=f"zerowatch-gpu-rank{rank}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def sample_once(self) -> None:
        if self._reader is None:
            return
        t0 = time.perf_counter()
        try:
            self._ring.append(self._reader())
        except Exception as e:
            self._health.error("sampling the GPU (NVML)", e)
        self.busy_s += time.perf_counter() - t0
        self.n_samples += 1

    def _main(self) -> None:
        if self._reader is None and self._connect is not None:
            try:
                opened = self._connect()
            except Exception as e:
                self._health.error("opening NVML", e)
                opened = None
            if opened is None:
                return
            self._reader, self._on_close = opened
        try:
            while not self._stop.is_set():
                self.sample_once()
                self._stop.wait(self._interval)
        finally:
            if self._on_close is not None:
                try:
                    self._on_close()
                except Exception as e:
                    self._health.error("shutting NVML down", e)

    def window(self, start: float, end: float) -> ev.GpuTelemetry | None:
        ring = list(self._ring)  # a copy: the sampler appends meanwhile
        inside = [s for s in ring if start <= s.time <= end]
        if not inside:
            before = [s for s in ring if s.time <= end]
            if not before or end - before[-1].time > STALE_S:
                return None
            return summarize([before[-1]], samples=0)
        return summarize(inside, samples=len(inside))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)


def _mean(values: list[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return sum(have) / len(have) if have else None


def _last(values: list[Any]) -> Any:
    have = [v for v in values if v is not None]
    return have[-1] if have else None


def summarize(group: list[GpuSample], *, samples: int) -> ev.GpuTelemetry:
    """One step's samples as its GpuTelemetry: clocks, temperature and power averaged,
    reasons OR-ed, the throttled share counted, counters the newest."""
    sm = _mean([s.sm_clock_mhz for s in group])
    sm_max = _last([s.sm_clock_max_mhz for s in group])
    masks = [s.reasons for s in group if s.reasons is not None]
    reasons: int | None = None
    throttled: float | None = None
    if masks:
        reasons = 0
        for mask in masks:
            reasons |= mask
        throttled = sum(1 for mask in masks if mask & ev.GPU_SLOWING_REASONS) / len(masks)
    return ev.GpuTelemetry(
        samples=samples,
        sm_clock_mhz=sm,
        sm_clock_max_mhz=sm_max,
        mem_clock_mhz=_mean([s.mem_clock_mhz for s in group]),
        sm_clock_ratio=sm / sm_max if sm is not None and sm_max else None,
        throttle_reasons=reasons,
        throttled_fraction=throttled,
        temperature_c=_mean([s.temperature_c for s in group]),
        power_w=_mean([s.power_w for s in group]),
        power_limit_w=_mean([s.power_limit_w for s in group]),
        xid_errors=_last([s.xid_errors for s in group]),
        last_xid=_last([s.last_xid for s in group]),
        ecc_errors=_last([s.ecc_errors for s in group]),
        remapped_rows=_last([s.remapped_rows for s in group]),
        remap_pending=_last([s.remap_pending for s in group]),
        pcie_tx_bytes_per_s=_mean([s.pcie_tx for s in group]),
        pcie_rx_bytes_per_s=_mean([s.pcie_rx for s in group]),
        nvlink_tx_bytes_per_s=_mean([s.nvlink_tx for s in group]),
        nvlink_rx_bytes_per_s=_mean([s.nvlink_rx for s in group]),
    )


# -- which NVML device is this rank's --------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """The rank's CUDA device as NVML can find it: its index among the visible devices and,
    where torch reports them, its UUID and PCI bus id."""

    index: int
    uuid: str | None = None
    pci_bus_id: str | None = None


def device_identity(device: Any) -> DeviceIdentity:
    """The identity of a torch CUDA device (torch imported here only)."""
    import torch

    index = (
        device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
    )
    uuid = pci = None
    try:
        props = torch.cuda.get_device_properties(index)
        raw = getattr(props, "uuid", None)
        if raw is not None:
            text = str(raw)
            uuid = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            domain = getattr(props, "pci_domain_id", 0)
            dev = getattr(props, "pci_device_id", 0)
            pci = f"{domain:08x}:{bus:02x}:{dev:02x}.0"
    except Exception:
        pass
    return DeviceIdentity(index=int(index), uuid=uuid, pci_bus_id=pci)


def nvml_handle(nvml: Any, ident: DeviceIdentity) -> Any:
    """The NVML handle of the rank's device: by UUID, by PCI bus id, by the
    CUDA_VISIBLE_DEVICES entry at its index (a number or a UUID), else by the index."""
    if ident.uuid:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(ident.uuid)
        except Exception:
            pass
    if ident.pci_bus_id:
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(ident.pci_bus_id)
        except Exception:
            pass
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    if ident.index < len(visible):
        entry = visible[ident.index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(ident.index)


def gpu_probe(
    ident: DeviceIdentity | None,
    *,
    health: AgentHealth,
    rank: int = 0,
    interval_s: float = SAMPLE_INTERVAL_S,
) -> GpuProbe:
    """The rank's GPU probe: sampling through NVML on its own thread (which opens NVML and
    finds the device there), or a NullGpuProbe without a device or without `pynvml`."""
    if ident is None:
        return NullGpuProbe()
    try:
        import pynvml as nvml
    except ImportError:
        return NullGpuProbe()

    def connect() -> tuple[Callable[[], GpuSample], Callable[[], None]] | None:
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            log.info("zerowatch agent: no GPU telemetry (NVML: %s)", e)
            return None
        try:
            reader = NvmlReader(nvml, nvml_handle(nvml, ident), health)
        except Exception as e:
            log.info("zerowatch agent: no GPU telemetry (NVML device of %s: %s)", ident, e)
            _shutdown(nvml)
            return None

        def done() -> None:
            reader.close()
            _shutdown(nvml)

        return reader.sample, done

    return NvmlGpuProbe(connect=connect, health=health, rank=rank, interval_s=interval_s)


def _shutdown(nvml: Any) -> None:
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


__all__ = [
    "SAMPLE_INTERVAL_S",
    "DeviceIdentity",
    "GpuProbe",
    "GpuSample",
    "NullGpuProbe",
    "NvmlGpuProbe",
    "NvmlReader",
    "device_identity",
    "gpu_probe",
    "nvml_handle",
    "summarize",
]
