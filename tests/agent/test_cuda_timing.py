"""On a GPU, phase and collective times come from CUDA events read a step later; the agent
never synchronizes the device while training runs (skipped without CUDA)."""

from __future__ import annotations

import time

import pytest
from zerowatch.agent.spool import read_events, segments

import zerowatch
from zerowatch.engine.hooks import CollectiveRecord

pytestmark = pytest.mark.gpu


def test_cuda_steps_are_timed_from_events_without_synchronizing(
    fake_engine, spool_root, monkeypatch
):
    import torch

    fake_engine.device = "cuda:0"
    x = torch.randn(2048, 2048, device="cuda")
    syncs = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a, **k: syncs.append(1) or real_sync(*a, **k)
    )

    def gpu_step() -> None:
        reg = fake_engine.registry
        reg.call("on_phase_start", "step", time.perf_counter())
        for phase in ("forward", "backward", "optimizer_step"):
            reg.call("on_phase_start", phase, time.perf_counter())
            for _ in range(5):
                x.mul_(1.0001)
            reg.call("on_phase_end", phase, time.perf_counter())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.add_(1.0)
        end.record()
        t = time.perf_counter()
        reg.call("on_collective", CollectiveRecord("all_reduce", "grad_reduce", 4 * x.numel(), 2,
                                                   t, t, False, 0.0, (start, end)))  # fmt: skip
        fake_engine.global_steps += 1
        reg.call("on_phase_end", "step", time.perf_counter())

    run = zerowatch.instrument(fake_engine, spool_dir=spool_root)
    for _ in range(5):
        gpu_step()
        time.sleep(0.05)  # the host is not far ahead: each step's events complete meanwhile
    assert syncs == []  # nothing waited on the device during training
    assert run._recorder.steps_emitted >= 3  # each step went out once its events completed
    run.close()
    assert len(syncs) <= 1  # at most once, at close, for the last step
    events = []
    for seg in segments(run.spool_path / "rank-00000"):
        events.extend(obj for _, obj in read_events(seg))
    steps = [e for e in events if e["kind"] == "step"]
    assert len(steps) == 5
    for e in steps:
        assert e["memory"]["device"] == "cuda" and e["memory"]["capacity_bytes"] > 0
        assert set(e["memory"]["peak_by_phase"]) == {"forward", "backward", "optimizer_step"}
        (c,) = e["collectives"]
        assert c["latency_sum_s"] > 0 and c["bytes"] == 4 * x.numel()
        p = e["phases"]
        assert (
            p["forward"] > 0
            and p["forward"] + p["backward"] + p["optimizer_step"] <= e["step_time_s"] * 1.01
        )
        # Compute runs on the device: the host threads' CPU clocks are not the overlap cost
        # there, and are not read (the doctor's term is 0 on a GPU).
        assert e["thread_cpu_s"] is None and e["other_cpu_s"] is None
