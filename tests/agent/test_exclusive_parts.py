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
    parts = timer.take(100.0, 102.0).parts()
    assert parts["forward_compute"] == pytest.approx(0.2)
    assert parts["exposed_param_gather"] == pytest.approx(0.3)
    assert parts["optimizer_step"] == pytest.approx(0.2)
    assert parts["other"] == pytest.approx(1.3)  # 0-0.5, 1.0-1.2, 1.4-2.0


#: Boundaries of one step from 100 s to 102 s: (start?, phase, time). Nested in itself,
#: grad_reduce inside and after backward, an end without a start, an offload inside a gather.
_STEP = [
    (False, "forward", 100.05),  # attached mid-phase: not timed
    (True, "forward", 100.1), (True, "param_gather", 100.2), (True, "offload_h2d", 100.25),
    (False, "offload_h2d", 100.3), (False, "param_gather", 100.4), (False, "forward", 100.5),
    (True, "backward", 100.6), (True, "grad_reduce", 100.7), (True, "grad_reduce", 100.75),
    (False, "grad_reduce", 100.8), (False, "grad_reduce", 100.9), (False, "backward", 101.2),
    (True, "grad_reduce", 101.2), (False, "grad_reduce", 101.3),
    (True, "optimizer_step", 101.4), (False, "optimizer_step", 101.8),
]  # fmt: skip


def _logged(boundaries: list[tuple[bool, str, float]]) -> PhaseTimer:
    timer = PhaseTimer(HostClock())
    for is_start, phase, t in boundaries:
        (timer.start if is_start else timer.end)(phase, t)
    return timer


def test_a_steps_boundaries_pair_into_its_phases_totals_and_parts() -> None:
    window = _logged(_STEP).take(100.0, 102.0)
    got = [(p, pytest.approx(a), pytest.approx(b), inside) for p, a, b, inside in window.intervals]
    assert got == [
        ("offload_h2d", 0.25, 0.3, False), ("param_gather", 0.2, 0.4, False),
        ("forward", 0.1, 0.5, False), ("grad_reduce", 0.7, 0.9, True),  # the outer one
        ("backward", 0.6, 1.2, False), ("grad_reduce", 1.2, 1.3, False),
        ("optimizer_step", 1.4, 1.8, False),
    ]  # fmt: skip
    assert window.totals() == pytest.approx({
        "forward": 0.4, "param_gather": 0.2, "offload_h2d": 0.05, "backward": 0.6,
        "grad_reduce": 0.3, "optimizer_step": 0.4, "backward_inner": 0.4,
    })  # fmt: skip
    assert window.step_s == pytest.approx(2.0)
    assert window.parts() == pytest.approx({
        "forward_compute": 0.2, "exposed_param_gather": 0.15, "exposed_offload": 0.05,
        "backward_compute": 0.4, "exposed_grad_reduce": 0.3, "optimizer_step": 0.4,
        "other": 0.5,
    })  # fmt: skip


@pytest.mark.parametrize(
    "boundaries",
    [
        _STEP,
        _STEP[:-1],  # optimizer_step still open at the step's end
        [*_STEP[:3], (False, "param_gather", 100.15), *_STEP[3:]],  # an end before its start
        [(True, "forward", 99.5), *_STEP, (True, "backward", 102.5), (False, "backward", 103.0)],
        [*_STEP[:8], (True, "forward", 100.55), (False, "forward", 100.58), *_STEP[8:]],
    ],
    ids=["step", "still-open", "out-of-order", "beyond-the-step", "out-of-step-order"],
)
def test_the_one_pass_cut_matches_cutting_the_intervals_sorted(
    boundaries: list[tuple[bool, str, float]],
) -> None:
    """The window cuts the step while pairing (edges in the order they happened) and sorts
    only when the times do not run forward: either way, the cut of its intervals."""
    window = _logged(boundaries).take(100.0, 102.0)
    sorted_cut = exclusive_parts([(p, a, b) for p, a, b, _ in window.intervals], 2.0)
    assert window.parts() == pytest.approx(sorted_cut)
    assert sum(window.parts().values()) == pytest.approx(2.0)


def test_a_phase_open_at_the_steps_end_is_not_timed() -> None:
    timer = _logged(_STEP[:-1])
    window = timer.take(100.0, 102.0)
    assert "optimizer_step" not in window.totals()
    assert window.parts()["optimizer_step"] == 0.0
    timer.end("optimizer_step", 102.5)  # (the next step: an end without a start)
    assert timer.take(102.0, 103.0).intervals == []


def test_the_next_steps_boundaries_do_not_reach_a_window_taken() -> None:
    timer = _logged(_STEP)
    window = timer.take(100.0, 102.0)
    timer.start("forward", 102.1)  # the next step's, before the window is first read
    timer.end("forward", 102.5)
    assert window.totals() == _logged(_STEP).take(100.0, 102.0).totals()
    assert [p for p, *_ in timer.take(102.0, 103.0).intervals] == ["forward"]
