"""GPU health next to the step: the agent's NVML probe against a scripted pynvml (no GPU
here), its thread, its do-nothing forms."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from support.fake_nvml import FakeGpu, FakeNvml, NVMLError_LibraryNotFound
from zerowatch.agent.errors import AgentHealth
from zerowatch.agent.probes import gpu
from zerowatch.agent.spool import read_events, segments

import zerowatch


def _steps(run: zerowatch.agent.Run) -> list[dict]:
    out = []
    for seg in segments(run.spool_path / f"rank-{run.rank:05d}"):
        out.extend(obj for _, obj in read_events(seg) if obj["kind"] == "step")
    return out


def _train(fake_engine, run, n: int, pause_s: float = 0.02) -> None:
    for _ in range(n):
        fake_engine.train_step(fwd=0.02, bwd=0.02)  # a step long enough to hold samples
        time.sleep(pause_s)


def test_steps_carry_the_gpus_clocks_throttling_power_and_errors(
    fake_engine, spool_root, monkeypatch
):
    card = FakeGpu(sm_clock=1400, reasons=0x4 | 0x1, power_mw=690_000, temperature=83,
                   ecc_uncorrected=7, xids=[79], nvlink_tx_kib=10, pcie_tx_kb=3)  # fmt: skip
    fake = FakeNvml([FakeGpu(uuid="GPU-other"), card])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, gpu_telemetry=True,
                              gpu_sample_interval_s=0.005) as run:  # fmt: skip
        _train(fake_engine, run, 3)
        card.ecc_uncorrected = 9  # two uncorrected errors during the run
        _train(fake_engine, run, 3)
    steps = _steps(run)
    assert len(steps) == 6 and all(s["gpu"] is not None for s in steps)
    g = steps[-1]["gpu"]
    assert g["samples"] >= 1  # 40 ms steps, a sample every 5 ms
    assert g["sm_clock_mhz"] == 1400 and g["sm_clock_max_mhz"] == 1980
    assert g["sm_clock_ratio"] == pytest.approx(1400 / 1980)
    assert g["throttle_reasons"] == 0x5 and g["throttled_fraction"] == 1.0
    assert (g["temperature_c"], g["power_w"], g["power_limit_w"]) == (83, 690, 700)
    assert g["xid_errors"] == 1 and g["last_xid"] == 79
    assert g["ecc_errors"] == 2  # since the agent attached, not the card's lifetime 9
    assert steps[0]["gpu"]["ecc_errors"] == 0
    assert g["pcie_tx_bytes_per_s"] == 3000
    assert nvml_closed(fake)


def nvml_closed(fake: FakeNvml) -> bool:
    return not fake.initialised and ("nvmlShutdown", fake.calls[-1][1]) in fake.calls


def test_nvml_is_never_called_on_the_training_thread(fake_engine, spool_root, monkeypatch):
    fake = FakeNvml([FakeGpu()])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    main = threading.current_thread().name
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, gpu_telemetry=True,
                              gpu_sample_interval_s=0.01) as run:  # fmt: skip
        before = len(fake.calls)
        _train(fake_engine, run, 5, pause_s=0.03)
        during = fake.calls[before:]
    readings = [c for c in during if c[0].startswith("nvmlDeviceGet")]
    assert len(readings) > 20  # it sampled while training ran...
    assert {thread for _, thread in readings} == {"zerowatch-gpu-rank0"}  # ...on its thread
    # Not one NVML call on the training thread: not to open it in instrument(), not to
    # read it, not to shut it down in close().
    assert [c for c in fake.calls if c[1] == main] == []
    assert {name for name, _ in fake.calls} >= {"nvmlInit", "nvmlShutdown"}
    assert _steps(run)[-1]["gpu"]["sm_clock_mhz"] == 1980


def test_unsupported_readings_are_none_and_the_rest_still_arrive(
    fake_engine, spool_root, monkeypatch
):
    card = FakeGpu(unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors",
                                "nvmlDeviceGetFieldValues", "nvmlDeviceGetRemappedRows",
                                "nvmlDeviceRegisterEvents"})  # fmt: skip
    fake = FakeNvml([card])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, gpu_telemetry=True,
                              gpu_sample_interval_s=0.02) as run:  # fmt: skip
        _train(fake_engine, run, 3)
    assert run.stats["agent_errors"] == 0
    g = _steps(run)[-1]["gpu"]
    assert g["power_w"] is None and g["ecc_errors"] is None and g["xid_errors"] is None
    assert g["nvlink_tx_bytes_per_s"] is None and g["remapped_rows"] is None
    assert g["sm_clock_mhz"] == 1980 and g["temperature_c"] == 55
    # an unsupported reading is tried once, not every second
    assert sum(1 for name, _ in fake.calls if name == "nvmlDeviceGetPowerUsage") == 1


def test_without_pynvml_or_a_driver_the_probe_does_nothing(fake_engine, spool_root, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert isinstance(gpu.gpu_probe(gpu.DeviceIdentity(0), health=AgentHealth()), gpu.NullGpuProbe)
    no_driver = FakeNvml([FakeGpu()], init_error=NVMLError_LibraryNotFound("libnvidia-ml.so.1"))
    monkeypatch.setitem(sys.modules, "pynvml", no_driver)
    health = AgentHealth()
    probe = gpu.gpu_probe(gpu.DeviceIdentity(0), health=health)
    probe.start()
    probe.close()
    assert probe.window(0.0, 1e12) is None and health.errors == 0
    assert [name for name, _ in no_driver.calls] == ["nvmlInit"]
    with zerowatch.instrument(fake_engine, spool_dir=spool_root, gpu_telemetry=True) as run:
        _train(fake_engine, run, 2, pause_s=0.0)
    assert [s["gpu"] for s in _steps(run)] == [None, None]
    assert run.stats["agent_errors"] == 0


def test_a_cpu_run_samples_no_gpu_unless_asked(fake_engine, spool_root, monkeypatch):
    fake = FakeNvml([FakeGpu()])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with zerowatch.instrument(fake_engine, spool_dir=spool_root) as run:
        _train(fake_engine, run, 2, pause_s=0.0)
    assert fake.calls == [] and _steps(run)[0]["gpu"] is None


def test_the_rank_finds_its_gpu_by_uuid_or_bus_id_through_cuda_visible_devices(monkeypatch):
    a, b, c = (
        FakeGpu(uuid="GPU-a", pci_bus_id="00000000:07:00.0"),
        FakeGpu(uuid="GPU-b"),
        FakeGpu(uuid="GPU-c"),
    )
    fake = FakeNvml([a, b, c])
    assert gpu.nvml_handle(fake, gpu.DeviceIdentity(0, uuid="GPU-c")) is c
    assert gpu.nvml_handle(fake, gpu.DeviceIdentity(0, pci_bus_id="00000000:07:00.0")) is a
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    assert gpu.nvml_handle(fake, gpu.DeviceIdentity(0)) is c  # cuda:0 is NVML's device 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-b")
    assert gpu.nvml_handle(fake, gpu.DeviceIdentity(0)) is b


def test_a_step_between_samples_carries_the_newest_one_and_its_throttled_share(monkeypatch):
    s = [gpu.GpuSample(time=t, sm_clock_mhz=1000.0, sm_clock_max_mhz=2000.0, reasons=r)
         for t, r in ((10.0, 0), (11.0, 0x4), (12.0, 0x40), (13.0, 0x1))]  # fmt: skip
    g = gpu.summarize(s, samples=4)
    assert g.throttled_fraction == 0.5 and g.throttle_reasons == 0x45 and g.sm_clock_ratio == 0.5
    probe = gpu.NvmlGpuProbe(lambda: s.pop(0), health=AgentHealth())
    for _ in range(4):
        probe.sample_once()
    assert probe.window(11.2, 11.8).samples == 0  # the sample at 11.0, none inside
    assert probe.window(11.2, 11.8).throttled_fraction == 1.0
    assert probe.window(10.5, 12.5).samples == 2
    assert probe.window(30.0, 31.0) is None  # the newest sample is too old
