"""The foreign engines' phase board (phases -> observers, collectives -> purposes) and the
tensor census (each storage counted once), in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zerowatch.agent.adapters.foreign import PhaseBoard, TensorCensus, host_kinds


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_phase_start(self, phase: str, t: float) -> None:
        self.events.append(f"+{phase}")

    def on_phase_end(self, phase: str, t: float) -> None:
        self.events.append(f"-{phase}")


@pytest.fixture
def board() -> Any:
    b = PhaseBoard()
    rec = Recorder()
    b.add(rec)
    yield b, rec
    b.remove(rec)


@pytest.mark.parametrize(
    ("open_phases", "op", "purpose"),
    [
        (["forward"], "all_gather", "param_fetch"),
        (["backward"], "all_gather", "param_fetch"),
        (["optimizer_step"], "all_gather", "optimizer_gather"),
        ([], "all_gather", "other"),
        (["backward"], "reduce_scatter", "grad_reduce"),
        ([], "reduce_scatter", "grad_reduce"),
        (["backward"], "all_reduce", "grad_reduce"),
        (["grad_reduce"], "all_reduce", "grad_reduce"),
        (["optimizer_step"], "all_reduce", "other"),
        ([], "all_reduce", "other"),
        (["forward"], "broadcast", "other"),
    ],
)
def test_a_collective_takes_its_purpose_from_the_open_phase(
    board: Any, open_phases: list[str], op: str, purpose: str
) -> None:
    b, _ = board
    for phase in open_phases:
        b.start(phase)
    assert b.classify(op) == purpose


def test_the_step_opens_at_the_first_forward_and_closes_after_the_optimizer(board: Any) -> None:
    b, rec = board
    for _ in range(2):  # two micro-batches of one accumulation cycle
        b.begin_forward()
        b.end("forward")
        b.start("backward")
        b.end("backward")
    b.start("optimizer_step")
    b.end("optimizer_step")
    b.finish_step()
    assert rec.events == ["+step", "+forward", "-forward", "+backward", "-backward",
                          "+forward", "-forward", "+backward", "-backward",
                          "+optimizer_step", "-optimizer_step", "-step"]  # fmt: skip


def test_an_end_without_a_start_is_not_announced(board: Any) -> None:
    b, rec = board
    b.end("backward")
    b.finish_step()
    assert rec.events == []


def test_the_census_counts_a_flat_buffer_and_its_views_once() -> None:
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:]]
    other = torch.zeros(10, dtype=torch.float64)
    census = TensorCensus()
    census.add("params", flat)
    census.add("params", views)
    census.add("grads", {"a": views[0], "b": [other, None]})
    assert census.result() == {"params": 400, "grads": 80}


def test_offloaded_kinds_are_named_host() -> None:
    assert host_kinds({"params": 1, "optimizer_states": 2}, ("optimizer_states",)) == {
        "params": 1, "host_optimizer_states": 2,
    }  # fmt: skip
