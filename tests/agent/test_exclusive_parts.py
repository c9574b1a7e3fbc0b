"""The exclusive decomposition of a step: each instant goes to the innermost phase running
then, so parts never overlap and add up to the step, worked out by hand here."""

from __future__ import annotations

import pytest
from zerowatch.agent.probes.clock import HostClock
from zerowatch.agent.probes.phases import PhaseTimer, exclusive_parts

from zerowatch import events as ev


def test_nested_communication_is_counted_once_in_the_innermost_part() -> None:
    # A 10 s step: forward 0-4 with two gathers (1-2, 3-3.5), backward 4-8 with a reduce
    # 6-9 that runs on into the optimizer step 8-9.5, an offload copy 8.5-9 inside both.
    got = exclusive_parts(
        [("forward", 0, 4), ("param_gather", 1, 2), ("param_gather", 3, 3.5),
         ("backward", 4, 8), ("grad_reduce", 6, 9), ("optimizer_step", 8, 9.5),
         ("offload_d2h", 8.5, 9)],
        10.0,
    )  # fmt: skip
    assert got == {
        "forward_compute": 2.5,  # 4 - 1 - 0.5
        "exposed_param_gather": 1.5,
        "backward_compute": 2.0,  # 4 - 2 (reduce 6-8)
        "exposed_grad_reduce": 2.5,  # 6-8.5 (the offload copy owns 8.5-9)
        "exposed_offload": 0.5,
        "optimizer_step": 0.5,  # 9-9.5
        "other": 0.5,  # 9.5-10
    }
    assert sum(got.values()) == pytest.approx(10.0)
    assert set(got) == set(ev.STEP_PARTS)


def test_overlapping_same_phase_and_out_of_step_intervals() -> None:
    # Two gathers overlapping each other count their union; an interval reaching past the
    # step is clipped; unknown phases are ignored; an empty step is all zeros.
    got = exclusive_parts(
        [("forward", -1, 3), ("param_gather", 0.5, 2), ("param_gather", 1.5, 2.5),
         ("backward", 3, 7), ("backward_inner", 3, 6), ("step", 0, 6)],
        6.0,
    )  # fmt: skip
    assert got["exposed_param_gather"] == pytest.approx(2.0)
    assert got["forward_compute"] == pytest.approx(1.0)
    assert got["backward_compute"] == pytest.approx(3.0)
    assert got["other"] == 0.0
    assert sum(got.values()) == pytest.approx(6.0)
    assert exclusive_parts([], 0.0) == dict.fromkeys(ev.STEP_PARTS, 0.0)
    assert exclusive_parts([], 2.0)["other"] == 2.0


def test_phase_window_parts_from_the_timer_marks() -> None:
    timer = PhaseTimer(HostClock())
    for phase, t in [("forward", 100.5), ("param_gather", 100.6)]:
        timer.start(phase, t)
    for phase, t in [("param_gather", 100.9), ("forward", 101.0)]:
        timer.end(phase, t)
    timer.start("optimizer_step", 101.2)
    timer.end("optimizer_step", 101.4)
    parts = timer.take().parts(100.0, 2.0)
    assert parts["forward_compute"] == pytest.approx(0.2)
    assert parts["exposed_param_gather"] == pytest.approx(0.3)
    assert parts["optimizer_step"] == pytest.approx(0.2)
    assert parts["other"] == pytest.approx(1.3)  # 0-0.5, 1.0-1.2, 1.4-2.0
