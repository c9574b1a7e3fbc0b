"""The doctor on simulated runs (zerowatch.simulate written through the store): each kind of
finding fires on the run made to show it and not on a clean one, the prediction points the
right way, and a 4,096-rank run's findings answer in well under a second."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read import doctor
from zerowatch.server.read.doctor_settings import DoctorSettings, DoctorSettingsError
from zerowatch.server.read.rollups import RollupWorker

from zerowatch import events as ev
from zerowatch import predict, simulate

Mutate = Callable[[ev.StepEvent], ev.StepEvent]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database.open(f"sqlite:///{tmp_path / 'z.db'}")
    yield database
    database.close()


def _store(
    db: Database,
    spec: simulate.SimSpec,
    n: int = 30,
    mutate: Mutate | None = None,
    engine_info: dict | None = None,
    engine: str | None = None,
) -> str:
    rc = simulate.run_create(spec)
    if engine_info is not None:
        rc = dataclasses.replace(rc, engine_info=engine_info)
    if engine is not None:
        rc = dataclasses.replace(rc, engine=engine)
    store.create_run(db, run=rc)
    for events in simulate.steps(spec, n):
        if mutate is not None:
            events = [mutate(e) for e in events]
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    RollupWorker(db).flush()
    return rc.run_id


def _found(db: Database, run_id: str) -> list[dict]:
    out = doctor.findings(db=db, run_id=run_id)
    assert out is not None
    return out["findings"]


def _kinds(found: list[dict], *, at_least: str = "warning") -> set[str]:
    levels = doctor.SEVERITIES[: doctor.SEVERITIES.index(at_least) + 1]
    return {f["kind"] for f in found if f["severity"] in levels}


SPEC = simulate.SimSpec(world_size=8, stage=2, num_params=50_000_000, spans_every=0)


def test_a_clean_run_has_no_warning_or_critical_finding(db: Database) -> None:
    found = _found(db, _store(db, SPEC))
    assert _kinds(found) == set(), found
    assert [f["severity"] for f in found] == sorted(
        (f["severity"] for f in found), key=doctor.SEVERITIES.index
    )


def test_an_unknown_run_has_no_findings(db: Database) -> None:
    assert doctor.findings(db=db, run_id="nope") is None


def test_a_straggler_rank_is_named_with_its_host_and_the_compute_part(db: Database) -> None:
    found = _found(db, _store(db, dataclasses.replace(SPEC, straggler_rank=5,
                                                      straggler_factor=1.5)))  # fmt: skip
    (f,) = [f for f in found if f["kind"] == "straggler"]
    assert f["severity"] == "warning" and f["ranks"] == [5]
    assert f["evidence"]["part"] == "compute" and "sim-node-0000" in f["message"]
    assert f["chart"] == "ranks"


def test_time_between_steps_on_every_rank_is_an_input_stall(db: Database) -> None:
    # Each event ends later than its step alone would: 0.3 s a step outside the engine.
    def slow_input(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, time=e.time + 0.3 * e.step)

    found = _found(db, _store(db, SPEC, mutate=slow_input))
    assert _kinds(found) == {"input_stall"}, found
    (f,) = [f for f in found if f["kind"] == "input_stall"]
    assert f["severity"] == "critical" and f["evidence"]["share_by_rank"]


def test_one_rank_starting_late_is_a_straggler_in_input(db: Database) -> None:
    def late(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, time=e.time + 0.3 * e.step) if e.rank == 3 else e

    # Rank 3 is not sampled unless the others wait for it: its exposed comm is the lowest.
    def lowest_exposed(e: ev.StepEvent) -> ev.StepEvent:
        e = late(e)
        return dataclasses.replace(e, exposed_comm_s=e.exposed_comm_s * (0.1 if e.rank == 3
                                                                          else 1.0))  # fmt: skip

    found = _found(db, _store(db, SPEC, mutate=lowest_exposed))
    (f,) = [f for f in found if f["kind"] == "straggler"]
    assert f["ranks"] == [3] and f["evidence"]["part"] == "input"
    assert "input_stall" not in _kinds(found)


def test_exposed_communication_fires_above_its_share(db: Database) -> None:
    def exposed(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, exposed_comm_s=0.6 * e.step_time_s)

    found = _found(db, _store(db, SPEC, mutate=exposed))
    assert _kinds(found) == {"exposed_communication"}, found


def _exposed_in(*ops: tuple[str, float]) -> Mutate:
    """60% of the step exposed, the collectives' seconds in `ops` ((op, seconds a step)):
    the ops a run measured, and no other."""

    def mutate(e: ev.StepEvent) -> ev.StepEvent:
        stats = [ev.CollectiveStats.of_calls(
            op, "param_fetch" if op == "all_gather" else "grad_reduce", world_size=8, count=8,
            nbytes=8 << 20, latency_sum_s=secs, latency_max_s=secs / 8,
            buckets=[0] * (len(ev.LATENCY_BUCKETS) + 1)) for op, secs in ops]  # fmt: skip
        return dataclasses.replace(e, exposed_comm_s=0.6 * e.step_time_s, collectives=stats)

    return mutate


def _exposed(found: list[dict]) -> dict:
    (f,) = [f for f in found if f["kind"] == "exposed_communication"]
    return f


def test_stage_3_without_gathers_gets_no_gather_advice(db: Database) -> None:
    """Stage 3 whose parameters all sit under the persistence threshold: no all-gather in
    fact, only the all-reduce of the whole parameters' gradients. The advice names the
    knobs of that all-reduce, not the prefetch of gathers that never happen."""
    spec = dataclasses.replace(SPEC, stage=3)
    f = _exposed(_found(db, _store(db, spec, mutate=_exposed_in(("all_reduce", 0.2)))))
    assert "most of it in all_reduce" in f["message"]
    assert "reduce_bucket_size" in f["suggestion"]
    assert "prefetch" not in f["suggestion"] and "gathers" not in f["suggestion"]
    assert f["evidence"]["op"] == "all_reduce"


def test_exposed_reduce_scatter_is_told_the_reduce_buckets_not_the_prefetch(
    db: Database,
) -> None:
    """A DeepSpeed ZeRO-3 run whose collectives' time is mostly in reduce_scatter: the
    gradient reduction's knobs (reduce_bucket_size, overlap_comm); the prefetch bucket acts
    on the gathers only."""
    spec = dataclasses.replace(SPEC, stage=3)
    mutate = _exposed_in(("reduce_scatter", 0.2), ("all_gather", 0.05))
    f = _exposed(_found(db, _store(db, spec, mutate=mutate, engine="deepspeed")))
    assert "most of it in reduce_scatter" in f["message"]
    assert "reduce_bucket_size" in f["suggestion"] and "overlap_comm" in f["suggestion"]
    assert "prefetch" not in f["suggestion"] and "gathers parameters" not in f["suggestion"]


def test_exposed_gathers_at_stage_3_are_told_the_prefetch_and_persistence(db: Database) -> None:
    spec = dataclasses.replace(SPEC, stage=3)
    mutate = _exposed_in(("all_gather", 0.2), ("reduce_scatter", 0.05))
    f = _exposed(_found(db, _store(db, spec, mutate=mutate, engine="deepspeed")))
    assert "most of it in all_gather" in f["message"]
    assert "stage3_prefetch_bucket_size" in f["suggestion"]
    assert "stage3_param_persistence_threshold" in f["suggestion"]
    assert "reduce_bucket_size" not in f["suggestion"]


def test_exposed_all_reduce_at_stage_0_is_told_the_buckets(db: Database) -> None:
    spec = dataclasses.replace(SPEC, stage=0)
    f = _exposed(_found(db, _store(db, spec, mutate=_exposed_in(("all_reduce", 0.2)))))
    assert "reduce_bucket_size" in f["suggestion"] and "overlap_comm" in f["suggestion"]
    assert "prefetch" not in f["suggestion"] and "lower stage" not in f["suggestion"]


def _many_small(op: str, calls: int, msg: int, busbw: float) -> ev.CollectiveStats:
    lat = msg * calls / busbw
    return ev.CollectiveStats(op=op, purpose="grad_reduce", count=calls, bytes=msg * calls,  # type: ignore[arg-type]
                              latency_sum_s=lat, latency_max_s=lat / calls,
                              buckets=[0] * (len(ev.LATENCY_BUCKETS) + 1), world_size=8,
                              algbw_bytes_per_s=busbw, busbw_bytes_per_s=busbw)  # fmt: skip


def test_many_small_slow_collectives_are_latency_bound_with_a_bucket_prediction(
    db: Database,
) -> None:
    def small(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, collectives=[
            _many_small("reduce_scatter", 200, 64 << 10, 1e9),
            _many_small("all_gather", 4, 64 << 20, 20e9),
        ])  # fmt: skip

    found = _found(db, _store(db, SPEC, mutate=small))
    (f,) = [f for f in found if f["kind"] == "latency_bound_collectives"]
    assert f["severity"] == "warning" and f["evidence"]["op"] == "reduce_scatter"
    assert f["evidence"]["reference"] == "run" and f["evidence"]["reference_op"] == "all_gather"
    assert "reduce_bucket_size" in f["prediction"]["config"]["zero_optimization"]
    assert f["prediction"]["step_time_s"] < f["prediction"]["step_time_now_s"]
    clean = _found(db, _store(db, SPEC))
    assert "latency_bound_collectives" not in _kinds(clean, at_least="info")


def _all_small(e: ev.StepEvent) -> ev.StepEvent:
    """Stage 2 with 600-element buckets: 660 reduce-scatters and all-gathers a step of 2.3
    KiB each (fp32) and the gradient norm's all-reduce: no op has larger messages."""
    return dataclasses.replace(e, collectives=[
        _many_small("reduce_scatter", 660, 2400, 5e6),
        _many_small("all_gather", 660, 2400, 6e6),
        _many_small("all_reduce", 1, 4, 1e4),
    ])  # fmt: skip


#: The agent's probe of the link when it attached (zerowatch/rehearse/link.py).
LINK = {"op": "reduce_scatter", "message_bytes": 8 << 20, "latency_s": 0.004, "busbw": 1e9}


def test_when_every_collective_is_small_the_engines_probe_of_the_link_is_the_reference(
    db: Database,
) -> None:
    """No op of the run carries messages large enough to show the link's bandwidth: the
    agent's probe of the link (a large reduce-scatter when it attached) does, and the
    finding says so; without it (another engine) nothing is compared."""
    found = _found(db, _store(db, SPEC, mutate=_all_small,
                              engine_info={"device": "cpu", "collective_calls": {"link": LINK}}))  # fmt: skip
    by_op = {f["evidence"]["op"]: f for f in found if f["kind"] == "latency_bound_collectives"}
    assert set(by_op) == {"reduce_scatter", "all_gather"}, found
    f = by_op["reduce_scatter"]
    assert f["severity"] == "warning"
    assert f["evidence"]["reference"] == "rehearsal"
    assert f["evidence"]["reference_busbw"] == LINK["busbw"]
    assert f["evidence"]["reference_message_bytes"] == LINK["message_bytes"]
    assert "when the agent attached" in f["message"] and "under 1%" in f["message"]
    assert "reduce_bucket_size" in f["suggestion"]
    assert "reduce_bucket_size" in f["prediction"]["config"]["zero_optimization"]
    assert f["prediction"]["step_time_s"] < f["prediction"]["step_time_now_s"]
    # The exposed share it explains is info, pointing at it.
    exposed = [f for f in found if f["kind"] == "exposed_communication"]
    assert all(x["severity"] == "info" for x in exposed)

    plain = _found(db, _store(db, SPEC, mutate=_all_small, engine_info={"device": "cpu"}))
    assert "latency_bound_collectives" not in _kinds(plain, at_least="info")
    # Where the engine counts as many calls at the larger bucket (its buckets are as large
    # as they get), a larger bucket is no remedy: nothing is said.
    same = {"reduce_scatter": [660, 660], "all_gather": [660, 660], "all_reduce": [1, 1]}
    table = {"world_size": 8, "gradient_accumulation_steps": 1, "reduce_bucket_size": 600,
             "bucket_sizes": [600, 10**8], "calls": {"2": same}, "link": LINK}  # fmt: skip
    counted = _found(db, _store(db, SPEC, mutate=_all_small,
                                engine_info={"device": "cpu", "collective_calls": table}))  # fmt: skip
    assert "latency_bound_collectives" not in _kinds(counted, at_least="info")


def test_a_run_with_collectives_of_different_sizes_is_judged_by_its_own(db: Database) -> None:
    """Stage 3 with a tiny reduce bucket: the persistent parameters' all-reduces (1.4 KiB)
    are judged against the run's own reduce-scatters (170 KiB), and only they, probe or
    not: the link's figure is for runs whose collectives are all small."""

    def mixed(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, collectives=[
            _many_small("all_reduce", 20, 1400, 2e5),
            _many_small("reduce_scatter", 10, 170 << 10, 8e6),
        ])  # fmt: skip

    info = {"device": "cpu", "collective_calls": {"link": LINK}}
    found = _found(db, _store(db, dataclasses.replace(SPEC, stage=3), mutate=mixed,
                              engine_info=info))  # fmt: skip
    (f,) = [f for f in found if f["kind"] == "latency_bound_collectives"]
    assert f["evidence"]["op"] == "all_reduce" and f["evidence"]["reference"] == "run"
    assert f["evidence"]["reference_op"] == "reduce_scatter"


def test_a_links_bandwidth_given_in_the_settings_is_the_reference_of_last_resort(
    db: Database,
) -> None:
    run_id = _store(db, SPEC, mutate=_all_small, engine_info={"device": "cpu"})
    got = doctor.findings(db=db, run_id=run_id,
                          settings=DoctorSettings(link_busbw_bytes_per_s=1e9))  # fmt: skip
    assert got is not None
    (f,) = [f for f in got["findings"] if f["kind"] == "latency_bound_collectives"
            and f["evidence"]["op"] == "reduce_scatter"]  # fmt: skip
    assert f["evidence"]["reference"] == "settings"
    assert "link_busbw_bytes_per_s" in f["message"]
    # A probe too small to show the link's bandwidth (not 4x the op's messages) is not used.
    small_probe = dict(LINK, message_bytes=4800)
    run_id = _store(db, SPEC, mutate=_all_small,
                    engine_info={"device": "cpu", "collective_calls": {"link": small_probe}})  # fmt: skip
    assert "latency_bound_collectives" not in _kinds(_found(db, run_id), at_least="info")


def test_memory_near_capacity_is_a_headroom_finding(db: Database) -> None:
    # 7B parameters at stage 0 hold 16 bytes each per rank: far beyond 80 GiB.
    big = dataclasses.replace(SPEC, stage=0, num_params=7_000_000_000)
    found = _found(db, _store(db, big, n=12))
    (f,) = [f for f in found if f["kind"] == "memory_headroom"]
    assert f["severity"] == "critical" and f["chart"] == "memory"
    lean = [f for f in found if f["kind"] == "stage_choice"]
    assert (
        lean
        and lean[0]["prediction"]["model_state_bytes"]
        < (lean[0]["prediction"]["model_state_now_bytes"])
    )


def test_offload_bandwidth_falling_below_its_earlier_level(db: Database) -> None:
    spec = dataclasses.replace(SPEC, offload_optimizer=True)

    def slower(e: ev.StepEvent) -> ev.StepEvent:
        if e.step < 60:
            return e
        return dataclasses.replace(e, offload=[dataclasses.replace(
            o, seconds=o.seconds * 5, bandwidth_bytes_per_s=o.bandwidth_bytes_per_s / 5)
            for o in e.offload])  # fmt: skip

    found = _found(db, _store(db, spec, n=100, mutate=slower))
    assert {f["evidence"]["direction"] for f in found if f["kind"] == "offload_bandwidth"} == {
        "d2h",
        "h2d",
    }
    assert "offload_bandwidth" not in _kinds(_found(db, _store(db, spec, n=100)))


def test_a_collapsing_fp16_loss_scale_and_skipped_steps(db: Database) -> None:
    spec = dataclasses.replace(SPEC, precision="fp16")

    def collapse(e: ev.StepEvent) -> ev.StepEvent:
        scale = max(65536.0 / 2**e.step, 1.0)
        return dataclasses.replace(e, loss_scale=scale, skipped=True, nonfinite=True)

    found = _found(db, _store(db, spec, mutate=collapse))
    assert _kinds(found) == {"loss_scale"}, found  # skipped overflows are not "nonfinite"
    assert found[0]["kind"] == "loss_scale" and found[0]["severity"] == "critical"
    assert "loss_scale" not in _kinds(_found(db, _store(db, spec)), at_least="info")


def test_a_grad_norm_spike_names_its_step(db: Database) -> None:
    found = _found(db, _store(db, dataclasses.replace(SPEC, grad_spike_at=20)))
    (f,) = [f for f in found if f["kind"] == "grad_norm_spike"]
    assert f["steps"] == [20, 20] and f["severity"] == "warning"


def test_nonfinite_steps_that_were_not_skipped_are_critical(db: Database) -> None:
    def nan(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, nonfinite=e.step >= 25, grad_norm=None) if e.step >= 25 else e

    found = _found(db, _store(db, SPEC, mutate=nan))
    assert found[0]["kind"] == "nonfinite" and found[0]["severity"] == "critical"
    assert found[0]["steps"] == [25, 29]


def test_stage_3_on_a_comm_bound_run_suggests_a_lower_stage_with_a_paste_able_config(
    db: Database,
) -> None:
    def comm_bound(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, exposed_comm_s=0.45 * e.step_time_s)

    found = _found(db, _store(db, dataclasses.replace(SPEC, stage=3), mutate=comm_bound))
    (f,) = [f for f in found if f["kind"] == "stage_choice"]
    pred = f["prediction"]
    assert pred["config"]["zero_optimization"]["stage"] < 3
    assert pred["step_time_s"] < pred["step_time_now_s"]
    assert pred["model_state_bytes"] > pred["model_state_now_bytes"]  # fewer shards
    assert f["suggestion"].startswith("Paste the prediction's config")


def test_a_stage_choice_predicted_30_percent_faster_is_a_warning(db: Database) -> None:
    """Stage 3 with most of its step in exposed communication: a lower stage is predicted
    at least stage_choice_warning_gain (30%) faster, a warning; with less exposed, the
    gain is below that and the finding stays info."""

    def exposed(share: float) -> Mutate:
        return lambda e: dataclasses.replace(e, exposed_comm_s=share * e.step_time_s)

    def choice(share: float) -> dict:
        found = _found(db, _store(db, dataclasses.replace(SPEC, stage=3), mutate=exposed(share)))
        (f,) = [f for f in found if f["kind"] == "stage_choice"]
        return f

    def gain(f: dict) -> float:
        return 1 - f["prediction"]["step_time_s"] / f["prediction"]["step_time_now_s"]

    loud, quiet = choice(0.9), choice(0.45)
    assert gain(loud) >= 0.30 and loud["severity"] == "warning"
    assert 0.10 <= gain(quiet) < 0.30 and quiet["severity"] == "info"


def test_beside_latency_bound_collectives_a_faster_stage_choice_stays_info(db: Database) -> None:
    """The latency-bound collectives come first: a stage_choice that would be a warning
    (here with the warning's gain lowered to 10%) stays info beside them, and says why."""

    def small(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, exposed_comm_s=0.9 * e.step_time_s, collectives=[
            _many_small("reduce_scatter", 200, 64 << 10, 1e9),
            _many_small("all_gather", 4, 64 << 20, 20e9),
        ])  # fmt: skip

    settings = DoctorSettings(stage_choice_warning_gain=0.1)
    spec = dataclasses.replace(SPEC, stage=3)
    got = doctor.findings(db=db, run_id=_store(db, spec, mutate=small), settings=settings)
    assert got is not None
    kinds = {f["kind"]: f for f in got["findings"]}
    assert kinds["latency_bound_collectives"]["severity"] == "warning"
    f = kinds["stage_choice"]
    assert f["prediction"]["step_time_s"] < 0.9 * f["prediction"]["step_time_now_s"]
    assert f["severity"] == "info" and "latency-bound collectives come first" in f["message"]


def test_a_run_on_the_fastest_layout_still_states_the_trade_with_every_candidate(
    db: Database,
) -> None:
    """Stage 1 with nothing predicted faster: the finding (info) names the leanest layout
    and what it would cost, and carries every other layout's prediction, so that the
    predictions from a lower stage (up to stage 3) can be checked as well as down from it."""
    run_id = _store(db, dataclasses.replace(SPEC, stage=1))
    got = doctor.findings(db=db, run_id=run_id, settings=DoctorSettings(stage_choice_min_gain=0.5))
    assert got is not None
    (f,) = [f for f in got["findings"] if f["kind"] == "stage_choice"]
    assert f["severity"] == "info" and f["message"].startswith(
        "No layout or bucket size is predicted 50%"
    )
    pred = f["prediction"]
    assert pred["config"]["zero_optimization"]["stage"] == 3  # the leanest
    assert pred["model_state_bytes"] < pred["model_state_now_bytes"]
    assert len(f["evidence"]["candidates"]) == 7  # every layout but the run's own
    assert "Paste" not in f["suggestion"]  # nothing is predicted faster


def _on_cpu(e: ev.StepEvent) -> ev.StepEvent:
    """What the agent sends from a CPU-only job: host memory, no device capacity."""
    assert e.memory is not None
    return dataclasses.replace(e, memory=dataclasses.replace(e.memory, device="cpu",
                                                             capacity_bytes=0))  # fmt: skip


def test_a_cpu_job_with_nothing_faster_is_not_told_to_offload_or_paste(db: Database) -> None:
    """A CPU-only job with no layout predicted faster: offload frees nothing there (its
    device memory is the host's), memory is not short, so the finding names no offload and
    asks for no config to be pasted; the candidates stay on record."""
    spec = dataclasses.replace(SPEC, world_size=2, stage=2, num_params=100_000)
    run_id = _store(db, spec, mutate=_on_cpu, engine_info={"device": "cpu"})
    (f,) = [f for f in _found(db, run_id) if f["kind"] == "stage_choice"]
    assert f["severity"] == "info"
    assert "offload optimizer" not in f["message"] and "Paste" not in f["suggestion"]
    pred = f["prediction"]
    assert pred is None or "offload" not in str(pred["config"])
    assert len(f["evidence"]["candidates"]) == 7


def test_with_nothing_faster_and_memory_not_short_no_offload_is_named(db: Database) -> None:
    """A GPU run at stage 3 with room to spare and no layout predicted faster: the leanest
    layout would be offload, which the run does not need; none is named, none pasted."""
    run_id = _store(db, dataclasses.replace(SPEC, stage=3))
    got = doctor.findings(db=db, run_id=run_id, settings=DoctorSettings(stage_choice_min_gain=0.9))
    assert got is not None
    (f,) = [f for f in got["findings"] if f["kind"] == "stage_choice"]
    assert f["severity"] == "info" and f["prediction"] is None
    assert "offload optimizer" not in f["message"] and "Paste" not in f["suggestion"]


def test_a_run_that_shared_its_cores_is_told_so_and_judged_on_its_own_work(
    db: Database,
) -> None:
    """Stage 3 whose steps took twice the CPU its threads used outside the waits: the
    predictions (and the step they are compared with) are the host-to-itself ones."""

    def shared(e: ev.StepEvent) -> ev.StepEvent:
        own = (e.step_time_s - e.exposed_comm_s) / 2
        return dataclasses.replace(e, thread_cpu_s=0.9 * own, other_cpu_s=0.1 * own)

    def comm_bound(e: ev.StepEvent) -> ev.StepEvent:
        return shared(dataclasses.replace(e, exposed_comm_s=0.45 * e.step_time_s))

    run_id = _store(db, dataclasses.replace(SPEC, stage=3), mutate=comm_bound,
                    engine_info={"device": "cpu"})  # fmt: skip
    (f,) = [f for f in _found(db, run_id) if f["kind"] == "stage_choice"]
    assert "another process on its cores" in f["message"]
    basis = f["prediction"]["basis"]
    assert basis["contention"] == pytest.approx(2.0, rel=0.05)
    assert basis["step_time_uncontended_s"] == pytest.approx(
        f["prediction"]["step_time_now_s"] / basis["contention"]
    )


def test_predictions_point_the_right_way_on_a_small_model() -> None:
    """The direction of each change (the bench checks the magnitudes on real runs)."""
    m = predict.Measured(
        num_params=10_000_000, world_size=4, stage=2, step_time_s=0.2, exposed_comm_s=0.05,
        optimizer_s=0.02, comm_s={"reduce_scatter": 0.04, "all_gather": 0.03},
        busbw={"reduce_scatter": 0.5e9, "all_gather": 2e9},
        calls={"reduce_scatter": 100, "all_gather": 2},
        comm_bytes={"reduce_scatter": 4e7, "all_gather": 4e7},
        model_state_bytes=theory_bytes(10_000_000, 4, 2), device="cpu",
    )  # fmt: skip

    def p(**kw: object) -> predict.Prediction:
        return predict.predict(m, predict.Change(**kw))  # type: ignore[arg-type]

    s1, s3 = p(stage=1), p(stage=3)
    assert s3.step_time_s > m.step_time_s and s3.model_state_bytes < m.model_state_bytes
    assert s1.model_state_bytes > m.model_state_bytes
    off = p(stage=2, offload_optimizer=True)
    assert off.step_time_s > m.step_time_s and off.model_state_bytes < m.model_state_bytes
    bigger = p(stage=2, bucket=("reduce_bucket_size", 5_000_000))
    assert bigger.step_time_s < m.step_time_s
    assert bigger.change.fragment(m) == {"zero_optimization": {"reduce_bucket_size": 5_000_000}}
    back = predict.predict(dataclasses.replace(m, stage=3, model_state_bytes=s3.model_state_bytes),
                           predict.Change(stage=2))  # fmt: skip
    assert back.model_state_bytes == pytest.approx(m.model_state_bytes, rel=0.01)


def _measured(db: Database, run_id: str) -> predict.Measured:
    """What the doctor hands the planner for a stored run (its evidence, then Measured)."""
    from sqlalchemy import select
    from zerowatch.server import models
    from zerowatch.server.read import doctor_checks, doctor_evidence, runs

    with db.read() as conn:
        row = conn.execute(select(models.runs).where(models.runs.c.run_id == run_id)).one()
        run = runs.run_dict(row, now=0.0, stalled_after_s=float("inf"))
        e = doctor_evidence.gather(conn, int(row.id), run, DoctorSettings())
    assert e is not None
    got = doctor_checks.measured(e)
    assert got is not None
    return got


def test_a_host_runs_cpu_times_calibrate_the_overlap_cost(db: Database) -> None:
    """The comm threads' CPU time (other_cpu_s, median over the window) reaches the planner;
    a run without it (a GPU run, an older agent) prices no overlap cost."""

    def cpu(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, thread_cpu_s=0.5 * e.step_time_s, other_cpu_s=0.01)

    spec = dataclasses.replace(SPEC, stage=3)
    m = _measured(db, _store(db, spec, mutate=cpu))
    assert m.other_cpu_s == pytest.approx(0.01) and m.thread_cpu_s is not None
    to_1 = predict.predict(m, predict.Change(stage=1))
    assert to_1.basis["overlap_s_now"] == pytest.approx(0.01)
    assert 0 < to_1.basis["overlap_s_new"] < 0.01  # stage 1 moves less than stage 3
    bare = _measured(db, _store(db, spec))
    assert bare.other_cpu_s is None
    assert predict.predict(bare, predict.Change(stage=1)).basis["overlap_s_now"] == 0.0


def test_the_communication_phases_host_time_reaches_the_planner(db: Database) -> None:
    """comm_phase_host_s is the communication phases' exclusive parts less the exposed
    communication (medians over the window); a run without parts (an older agent) has None."""

    def parts(e: ev.StepEvent) -> ev.StepEvent:
        p = dict(e.parts)
        p["exposed_param_gather"] = e.exposed_comm_s * 0.5 + 0.002
        p["exposed_grad_reduce"] = e.exposed_comm_s * 0.5 + 0.001
        return dataclasses.replace(e, parts=p)

    spec = dataclasses.replace(SPEC, stage=3)
    m = _measured(db, _store(db, spec, mutate=parts))
    assert m.comm_phase_host_s == pytest.approx(0.003, abs=2e-4)
    bare = _measured(db, _store(db, spec, mutate=lambda e: dataclasses.replace(e, parts={})))
    assert bare.comm_phase_host_s is None


def theory_bytes(psi: int, n: int, stage: int) -> float:
    from zerowatch import theory

    return float(theory.model_state_bytes(psi, n, stage).device_total)


def test_settings_name_the_field_at_fault() -> None:
    with pytest.raises(DoctorSettingsError, match="straggler_ratio"):
        DoctorSettings(straggler_ratio=0.9)
    with pytest.raises(DoctorSettingsError, match="exposed_comm_share"):
        DoctorSettings(exposed_comm_share=2.0)


def test_a_4096_rank_run_names_its_one_slow_rank(db: Database) -> None:
    spec = dataclasses.replace(SPEC, world_size=4096, stage=3, straggler_rank=3001,
                               straggler_factor=1.5, ranks_per_host=8)  # fmt: skip
    run_id = _store(db, spec, n=12)
    doctor.findings(db=db, run_id=run_id)  # warm the connection pool and caches
    t0 = time.perf_counter()
    found = _found(db, run_id)
    elapsed = time.perf_counter() - t0
    print(
        f"4,096-rank findings: {elapsed * 1000:.0f} ms"
    )  # (part of the 4,096-rank run page's time: bench/pages.py)
    (f,) = [f for f in found if f["kind"] == "straggler"]
    assert f["ranks"] == [3001]


def test_a_run_whose_engine_counted_its_calls_is_priced_by_them(db: Database) -> None:
    """The bundled engine's engine_info carries the calls each stage makes per step
    (engine/counts.py): the doctor reads them, and a stage that makes many more calls is
    predicted slower than its bytes alone say; a run without them keeps the bytes model."""
    spec = dataclasses.replace(SPEC, stage=3)
    calls = {"0": {"all_reduce": [400]}, "1": {"reduce_scatter": [400], "all_gather": [400],
             "all_reduce": [1]}, "2": {"reduce_scatter": [400], "all_gather": [400],
             "all_reduce": [1]}, "3": {"all_gather": [20], "reduce_scatter": [10],
             "all_reduce": [2]}}  # fmt: skip
    table = {"world_size": 8, "gradient_accumulation_steps": 1, "reduce_bucket_size": 1000,
             "bucket_sizes": [1000], "calls": calls}  # fmt: skip
    plain = _store(db, spec, engine_info={"device": "cpu"})
    counted = _store(db, spec, engine_info={"device": "cpu", "collective_calls": table})
    assert _measured(db, plain).counted_calls is None
    m = _measured(db, counted)
    assert m.counted_calls is not None and m.counted_calls.at(1) == {
        "reduce_scatter": 400.0, "all_gather": 400.0, "all_reduce": 1.0}  # fmt: skip

    def stage1(run_id: str) -> dict:
        (f,) = [f for f in _found(db, run_id) if f["kind"] == "stage_choice"]
        (c,) = [c for c in f["evidence"]["candidates"] if c["config"] == {
            "zero_optimization": {"stage": 1}}]  # fmt: skip
        return c

    assert stage1(counted)["step_time_s"] > stage1(plain)["step_time_s"]
    assert stage1(counted)["basis"]["comm_s_new"] > stage1(plain)["basis"]["comm_s_new"]


def test_the_bundled_engine_is_told_the_bucket_key_that_sets_its_gathers(db: Database) -> None:
    """Many small all-gathers at stage 3: a run of the bundled engine (it counted its calls)
    gathers per unit, cut by reduce_bucket_size, so that is the key to raise (and the counts
    price it); another engine is told the prefetch bucket size, as before."""
    spec = dataclasses.replace(SPEC, stage=3)

    def small(e: ev.StepEvent) -> ev.StepEvent:
        return dataclasses.replace(e, collectives=[
            _many_small("all_gather", 200, 64 << 10, 1e9),
            _many_small("reduce_scatter", 4, 64 << 20, 20e9),
        ])  # fmt: skip

    calls = {"3": {"all_gather": [200, 8], "reduce_scatter": [4, 4]}}
    table = {"world_size": 8, "gradient_accumulation_steps": 1, "reduce_bucket_size": 1000,
             "bucket_sizes": [1000, 10**6], "calls": calls}  # fmt: skip
    for info, key in (({"device": "cpu", "collective_calls": table}, "reduce_bucket_size"),
                      ({"device": "cpu"}, "stage3_prefetch_bucket_size")):  # fmt: skip
        found = _found(db, _store(db, spec, mutate=small, engine_info=info))
        (f,) = [f for f in found if f["kind"] == "latency_bound_collectives"]
        assert list(f["prediction"]["config"]["zero_optimization"]) == [key]
        assert f["prediction"]["step_time_s"] < f["prediction"]["step_time_now_s"]
