"""What the agent reads from the engine: a record per collective, phase boundaries from one
place (top-level phases never overlap, the others nest inside them), offload copies,
per-step stats, and the engine's descriptive attributes."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from support.engine_harness import run_ranks
from support.engine_scenarios import CLIP, TINY, ds_config, make_model, train_engine

import zerowatch
from zerowatch.engine import CollectiveRecord, params_sharded

TOP = {"forward", "backward", "optimizer_step"}
NESTED = {"grad_reduce", "param_gather", "offload_d2h", "offload_h2d"}
CASES = {
    "stage2-overlap-offload": ds_config(2, ga=2, overlap=True, offload_optimizer=True),
    "stage3-offload-all": ds_config(
        3, ga=2, overlap=True, offload_optimizer=True, offload_param=True
    ),
    "stage1-sync": ds_config(1, ga=1),
}


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, float]] = []
        self.records: list[CollectiveRecord] = []
        self.offloads: list[tuple[str, int, float, float]] = []

    def on_collective(self, r: CollectiveRecord) -> None:
        self.records.append(r)

    def on_phase_start(self, phase: str, t: float) -> None:
        self.events.append(("start", phase, t))

    def on_phase_end(self, phase: str, t: float) -> None:
        self.events.append(("end", phase, t))

    def on_offload(self, direction: str, nbytes: int, start: float, end: float) -> None:
        self.offloads.append((direction, nbytes, start, end))


class Broken:
    def on_collective(self, r: CollectiveRecord) -> None:
        raise RuntimeError("observer bug")

    def on_phase_start(self, phase: str, t: float) -> None:
        raise RuntimeError("observer bug")


def _observe(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name, cfg in CASES.items():
        engine, *_ = zerowatch.initialize(model=make_model(), config=cfg)
        rec = Recorder()
        engine.add_observer(rec)
        engine.add_observer(Broken())
        train_engine(engine, TINY, 3, cfg["gradient_accumulation_steps"], world, rank)
        engine.remove_observer(rec)
        before = len(rec.events)
        train_engine(engine, TINY, 1, cfg["gradient_accumulation_steps"], world, rank)
        attrs = {k: getattr(engine, k) for k in (
            "rank", "world_size", "zero_stage", "precision", "num_parameters",
            "num_persistent_parameters", "micro_batch_size", "gradient_accumulation_steps",
            "global_steps")}  # fmt: skip
        out[name] = {"events": rec.events, "records": rec.records, "offloads": rec.offloads,
                     "after_remove": len(rec.events) - before, "last_step": engine.last_step,
                     "attrs": attrs, "device": str(engine.device),
                     "config_stage": engine.config.zero_optimization.stage}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def observed() -> list[dict[str, Any]]:
    return run_ranks(_observe, 2, timeout_s=120)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_top_level_phases_do_not_overlap_and_others_nest(case: str, observed: list[Any]) -> None:
    events = observed[0][case]["events"]
    open_top: str | None = None
    open_nested: list[str] = []
    steps_started = steps_ended = 0
    step_open = False
    for kind, phase, _t in events:
        if phase == "step":
            assert step_open == (kind == "end"), f"unbalanced step at {kind}"
            step_open = kind == "start"
            steps_started += kind == "start"
            steps_ended += kind == "end"
        elif phase in TOP:
            if kind == "start":
                assert open_top is None, f"{phase} starts inside {open_top}"
                assert step_open, f"{phase} outside a step"
                open_top = phase
            else:
                assert open_top == phase and not open_nested
                open_top = None
        else:
            assert phase in NESTED, phase
            assert open_top is not None, f"{phase} outside forward/backward/optimizer_step"
            if kind == "start":
                open_nested.append(phase)
            else:
                assert open_nested and open_nested[-1] == phase
                open_nested.pop()
    assert steps_started == steps_ended == 3
    ts = [t for _, _, t in events]
    assert ts == sorted(ts)


@pytest.mark.slow
def test_each_stage_announces_its_reductions_and_gathers(observed: list[Any]) -> None:
    phases = {c: {p for _, p, _ in observed[0][c]["events"]} for c in CASES}
    assert {"grad_reduce", "param_gather", "offload_d2h", "offload_h2d"} <= phases[
        "stage2-overlap-offload"
    ]
    assert {"grad_reduce", "param_gather", "offload_h2d"} <= phases["stage3-offload-all"]
    assert "offload_d2h" not in phases["stage1-sync"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_collective_records_are_complete(case: str, observed: list[Any]) -> None:
    records: list[CollectiveRecord] = observed[0][case]["records"]
    assert records
    for r in records:
        assert r.op in {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
        assert r.purpose in {"param_fetch", "grad_reduce", "optimizer_gather", "other"}
        assert r.world_size == 2 and r.nbytes > 0 and r.end >= r.start
        assert 0 <= r.exposed_s <= (r.end - r.start) + 1e-3
        if not r.async_op:
            assert r.exposed_s == pytest.approx(r.end - r.start)
    # Gradient reduction is asynchronous exactly when overlap_comm is on.
    reduce_async = {r.async_op for r in records if r.purpose == "grad_reduce"}
    assert reduce_async == {CASES[case]["zero_optimization"]["overlap_comm"]}


@pytest.mark.slow
def test_offload_copies_report_bytes_and_times(observed: list[Any]) -> None:
    offloads = observed[0]["stage2-overlap-offload"]["offloads"]
    assert {d for d, *_ in offloads} == {"d2h", "h2d"}
    assert all(n > 0 and end >= start for _, n, start, end in offloads)


@pytest.mark.slow
def test_step_stats_attributes_and_observer_removal(observed: list[Any]) -> None:
    for case in CASES:
        res = observed[1][case]
        st = res["last_step"]
        assert st.grad_norm is not None and st.grad_norm > 0 and not st.skipped
        assert st.lr == pytest.approx(1e-2) and st.loss_scale is None and not st.nonfinite
        assert st.clipped == (st.grad_norm > CLIP)
        assert res["after_remove"] == 0
        attrs = res["attrs"]
        assert attrs["rank"] == 1 and attrs["world_size"] == 2 and attrs["global_steps"] == 4
        assert attrs["zero_stage"] == res["config_stage"] and attrs["precision"] == "fp32"
        assert attrs["num_parameters"] == sum(p.numel() for p in make_model().parameters())
        assert attrs["micro_batch_size"] == 2 and res["device"] == "cpu"
    assert observed[0]["stage3-offload-all"]["attrs"]["num_persistent_parameters"] > 0


def _die_after_two_steps(rank: int, world: int) -> dict[str, Any]:
    import os
    import time

    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(2))
    train_engine(engine, TINY, 2, 1, world, rank)
    if rank == 1:
        os._exit(3)  # a crash: no goodbye to the others
    t0 = time.perf_counter()
    try:
        train_engine(engine, TINY, 50, 1, world, rank, start=2)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.perf_counter() - t0}
    return {"error": None, "after_s": time.perf_counter() - t0}


@pytest.mark.slow
def test_a_dead_rank_makes_the_others_fail_not_hang() -> None:
    res = run_ranks(_die_after_two_steps, 2, timeout_s=20, may_die=frozenset({1}))
    assert res[1] is None
    assert res[0]["error"], "rank 0 trained on without its peer"
    assert res[0]["after_s"] < 25


def test_single_process_without_torchrun_trains_and_matches_adamw() -> None:
    from support.engine_scenarios import max_relative_error, reference_run

    assert not torch.distributed.is_initialized()
    engine, optimizer, _, sched = zerowatch.initialize(model=make_model(), config=ds_config(3))
    assert engine.world_size == 1 and engine.rank == 0 and sched is None
    assert optimizer is engine.optimizer
    train_engine(engine, TINY, 5, 1, 1, 0)
    err, key = max_relative_error(engine.consolidated_state_dict(),
                                  reference_run(1, 1, steps=5).state_dict)  # fmt: skip
    assert err < 1e-5, key
    assert engine.model_state_bytes() == engine.theory().flat() | {
        "optimizer_states": engine.model_state_bytes()["optimizer_states"]}  # fmt: skip


def _forward_releases(rank: int, world: int) -> dict[str, Any]:
    """A stage-3 run whose releases are timed: when each unit went back to its shard."""
    cfg = ds_config(3)
    engine, *_ = zerowatch.initialize(model=make_model(), config=cfg)
    rec = Recorder()
    engine.add_observer(rec)
    released: list[float] = []
    release = params_sharded.ShardedParams.release

    def timed(self: params_sharded.ShardedParams, seg: Any) -> None:
        released.append(time.perf_counter())
        release(self, seg)

    params_sharded.ShardedParams.release = timed  # type: ignore[method-assign]
    train_engine(engine, TINY, 2, 1, world, rank)
    return {"events": rec.events, "released": released}


def _intervals(events: list[tuple[str, str, float]], phase: str) -> list[tuple[float, float]]:
    starts = [t for kind, p, t in events if p == phase and kind == "start"]
    ends = [t for kind, p, t in events if p == phase and kind == "end"]
    return list(zip(starts, ends, strict=True))


def test_stage3_releases_after_a_modules_forward_are_parameter_management() -> None:
    """Stage 3's management after a module's forward (its units released, the hook that
    gathers them again for backward) is announced as param_gather, as the gather before it:
    not the module's compute in the step's parts, and so in the doctor's measure of the
    stage's path, which the engine's rehearsal counts alike (docs/timing.md)."""
    for got in run_ranks(_forward_releases, 2, timeout_s=120):
        forward = _intervals(got["events"], "forward")
        gathers = _intervals(got["events"], "param_gather")
        in_forward = [t for t in got["released"] if any(a <= t <= b for a, b in forward)]
        assert in_forward  # the tiny model's units are released in its forward
        assert all(any(a <= t <= b for a, b in gathers) for t in in_forward)
