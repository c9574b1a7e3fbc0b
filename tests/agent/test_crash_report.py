"""The crash path on one rank (fake engine): the last event is bounded against a server that
hangs, a MemoryError carries the memory waterfall, and the pure helpers (the failed
allocation's size, the forward tracer, the local-gradient report, the waterfall)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from test_step_recording import spooled
from torch import nn
from zerowatch.agent import forensics as fx

import zerowatch
from zerowatch import waterfall as wf
from zerowatch.engine.forensics import LocalGradReport


def test_a_crash_against_a_hanging_server_leaves_within_its_bound(fake_engine, fake_server,
                                                                   spool_root):  # fmt: skip
    hanging = fake_server("hang")
    with (
        pytest.raises(ValueError),
        zerowatch.instrument(fake_engine, server=hanging.url, spool_dir=spool_root,
                             http_timeout_s=1.0, crash_flush_s=0.5,
                             flush_interval_s=0.1) as run,
    ):  # fmt: skip
        fake_engine.train_step()
        t0 = time.perf_counter()
        raise ValueError("bad batch")
    took = time.perf_counter() - t0
    # crash_flush_s, plus at most one request in flight (http_timeout_s), plus a second.
    assert took < 0.5 + 1.0 + 1.0 + 0.5, took
    assert run.status == "crashed"
    end = spooled(run)[-1]  # not sent: kept in the spool for `zerowatch upload`
    assert end["status"] == "crashed" and end["crash"]["type"] == "ValueError"


def test_memory_error_in_the_block_carries_the_memory_waterfall(fake_engine, spool_root):
    with (
        pytest.raises(MemoryError),
        zerowatch.instrument(fake_engine, spool_dir=spool_root) as run,
    ):
        fake_engine.train_step()
        raise MemoryError
    crash = spooled(run)[-1]["crash"]
    assert crash["oom"] and crash["type"] == "MemoryError"
    memory = crash["memory"]
    assert memory["device"] == "cpu" and memory["waterfall"]["activations"] is None
    assert memory["waterfall"]["model_state"] == wf.device_bytes(fake_engine.model_state_bytes())


def test_failed_allocation_size_is_read_from_the_message():
    assert (
        fx.failed_allocation_bytes("CUDA out of memory. Tried to allocate 20.00 MiB") == 20 * 2**20
    )
    assert fx.failed_allocation_bytes("Tried to allocate 1.50 GiB (GPU 0)") == int(1.5 * 2**30)
    assert fx.failed_allocation_bytes("out of memory") is None
    assert fx.is_oom(torch.OutOfMemoryError("x")) and fx.is_oom(MemoryError())
    assert not fx.is_oom(RuntimeError("x"))


def test_forward_tracer_names_where_a_nan_was_born_not_where_it_was_carried():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    model[2].register_forward_hook(lambda m, i, o: o * float("nan"))
    tracer = fx.ForwardTracer(model)
    model(torch.ones(1, 4))
    assert not tracer.armed and tracer.take() is None  # unarmed: no hooks, nothing seen
    tracer.arm()
    model(torch.ones(1, 4))
    assert tracer.take() == "2" and not tracer.armed
    with torch.no_grad():  # spoiled weights upstream: the NaN is carried, not born
        model[0].weight.fill_(float("nan"))
    tracer.arm()
    model(torch.ones(1, 4))
    assert tracer.take() is None


def test_local_grad_report_names_non_finite_parameters_in_forward_order():
    report = LocalGradReport(
        names=(("b.weight", "c.weight"), ("a.weight",)),
        norms=(torch.tensor([3.0, float("nan")]), torch.tensor([float("inf")])),
        order={"a.weight": 0, "b.weight": 1, "c.weight": 2}, divisor=2.0,
    )  # fmt: skip
    got = report.read()
    assert got["nonfinite_params"] == ["a.weight", "c.weight"]
    assert math.isnan(got["local_grad_norm"])
    finite = LocalGradReport(names=(("a", "b"),), norms=(torch.tensor([3.0, 4.0]),),
                             order={}, divisor=2.0).read()  # fmt: skip
    assert finite == {"local_grad_norm": 2.5, "nonfinite_params": []}


def test_waterfall_bars_explain_the_peak_in_order():
    bars = wf.waterfall(theory={"params": 100, "host_params": 7}, model_state={"params": 110},
                        comm_buffers=40, peak_allocated=400, reserved=500, capacity=1000)  # fmt: skip
    assert [bars[k] for k in wf.BARS] == [100, 110, 40, 250, 100]
    assert bars["capacity"] == 1000
    cpu = wf.waterfall(theory={"params": 100}, model_state={"params": 110})
    assert cpu["activations"] is None and cpu["allocator_reserve"] is None
