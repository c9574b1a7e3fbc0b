"""A scripted stand-in for `pynvml` (NVIDIA's NVML bindings), for tests without a GPU.

`FakeNvml(devices)` is a module-like object with the functions and constants the agent's
GPU probe calls; inject it with `monkeypatch.setitem(sys.modules, "pynvml", fake)`. Each
device is a `FakeGpu` whose readings the test sets (and may change while the agent runs);
a reading listed in `unsupported` raises NVMLError_NotSupported like a card without it.
Every call records the name of the thread that made it (`calls`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


@dataclass
class FakeGpu:
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: str = "00000000:01:00.0"
    sm_clock: int = 1980
    sm_clock_max: int = 1980
    mem_clock: int = 2619
    reasons: int = 0
    temperature: int = 55
    power_mw: int = 500_000
    power_limit_mw: int = 700_000
    ecc_uncorrected: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    pcie_tx_kb: int = 1000
    pcie_rx_kb: int = 2000
    nvlink_tx_kib: int = 0
    nvlink_rx_kib: int = 0
    #: XID codes waiting to be read from the event set.
    xids: list[int] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)


class FakeNvml:
    """pynvml as far as the agent uses it."""

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    NVML_SUCCESS = 0
    nvmlEventTypeXidCriticalError = 0x8
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported

    def __init__(self, devices: list[FakeGpu], *, init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.calls: list[tuple[str, str]] = []
        self.initialised = False

    def _call(self, name: str, gpu: FakeGpu | None = None) -> None:
        self.calls.append((name, threading.current_thread().name))
        if gpu is not None and name in gpu.unsupported:
            raise NVMLError_NotSupported(name)

    # -- library ---------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.initialised = False

    # -- handles ---------------------------------------------------------------------

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByIndex")
        return self.devices[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByUUID")
        for d in self.devices:
            if d.uuid == uuid:
                return d
        raise NVMLError("not found")

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByPciBusId")
        for d in self.devices:
            if d.pci_bus_id.lower() == bus.lower():
                return d
        raise NVMLError("not found")

    # -- readings --------------------------------------------------------------------

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, kind: int) -> int:
        self._call("nvmlDeviceGetClockInfo", h)
        return h.sm_clock if kind == self.NVML_CLOCK_SM else h.mem_clock

    def nvmlDeviceGetMaxClockInfo(self, h: FakeGpu, kind: int) -> int:
        self._call("nvmlDeviceGetMaxClockInfo", h)
        return h.sm_clock_max

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetCurrentClocksEventReasons", h)
        return h.reasons

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        self._call("nvmlDeviceGetTemperature", h)
        return h.temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetPowerUsage", h)
        return h.power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeGpu) -> int:
        self._call("nvmlDeviceGetEnforcedPowerLimit", h)
        return h.power_limit_mw

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, kind: int, counter: int) -> int:
        self._call("nvmlDeviceGetTotalEccErrors", h)
        return h.ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, h: FakeGpu) -> tuple[int, int, int, int]:
        self._call("nvmlDeviceGetRemappedRows", h)
        return h.remapped

    def nvmlDeviceGetPcieThroughput(self, h: FakeGpu, counter: int) -> int:
        self._call("nvmlDeviceGetPcieThroughput", h)
        return h.pcie_tx_kb if counter == self.NVML_PCIE_UTIL_TX_BYTES else h.pcie_rx_kb

    def nvmlDeviceGetFieldValues(self, h: FakeGpu, ids: list[int]) -> list[Any]:
        self._call("nvmlDeviceGetFieldValues", h)
        vals = {138: h.nvlink_tx_kib, 139: h.nvlink_rx_kib}
        return [
            SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=vals.get(i, 0))) for i in ids
        ]

    # -- XID events ------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> list[FakeGpu]:
        self._call("nvmlEventSetCreate")
        return []

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, types: int, es: list[FakeGpu]) -> None:
        self._call("nvmlDeviceRegisterEvents", h)
        es.append(h)

    def nvmlEventSetWait_v2(self, es: list[FakeGpu], timeout_ms: int) -> Any:
        self._call("nvmlEventSetWait_v2")
        for h in es:
            if h.xids:
                return SimpleNamespace(
                    eventType=self.nvmlEventTypeXidCriticalError, eventData=h.xids.pop(0), device=h
                )
        raise NVMLError_Timeout("no event")

    def nvmlEventSetFree(self, es: list[FakeGpu]) -> None:
        self._call("nvmlEventSetFree")


__all__ = ["FakeGpu", "FakeNvml", "NVMLError_LibraryNotFound", "NVMLError_NotSupported"]
