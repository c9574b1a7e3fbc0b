"""The calibrated planner's arithmetic on scripted measurements (zerowatch/predict.py): known
numbers in, the prediction worked out by hand out. The doctor's tests check the direction of
each prediction on simulated runs and bench/doctor.py the magnitudes on real ones."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from zerowatch import predict, theory

PSI, N = 1_000_000, 2


def stage3_on_cpu(**kw: object) -> predict.Measured:
    """A stage-3 CPU run of 1M fp32 parameters on 2 ranks. Theory: all-gather 8 MB and
    reduce-scatter 4 MB a step (bus factor 1/2: 4 and 2 MB of traffic); at the measured 400
    and 200 MB/s of bus bandwidth that is 10 + 10 = 20 ms of communication a step. The host
    was its own: the step less its waits (50 - 8 ms) is within the CPU its threads used
    (37 + 6 ms: the comm threads ran beside the training thread part of the time)."""
    base = dict(
        num_params=PSI, world_size=N, stage=3, device="cpu",
        step_time_s=0.050, exposed_comm_s=0.008, optimizer_s=0.002,
        comm_s={"all_gather": 0.010, "reduce_scatter": 0.010},
        busbw={"all_gather": 4e8, "reduce_scatter": 2e8},
        calls={"all_gather": 8, "reduce_scatter": 4},
        comm_bytes={"all_gather": 8e6, "reduce_scatter": 4e6},
        model_state_bytes=float(theory.model_state_bytes(PSI, N, 3).device_total),
        thread_cpu_s=0.037, other_cpu_s=0.006,
    )  # fmt: skip
    base.update(kw)
    return predict.Measured(**base)  # type: ignore[arg-type]


def test_stage_3_to_1_moves_the_overlap_cost_with_the_communication() -> None:
    """Stage 1 sends 4 MB of reduce-scatter and 4 MB of all-gather: 10 + 5 = 15 ms at the
    run's bandwidth, 3/4 of now. The exposed 8 ms become 6; the comm threads' 6 ms of CPU
    are ρ = 6 / 20 = 0.3 s of CPU per second of communication, 4.5 ms at stage 1; the
    optimizer updates the same shard (Ψ/N at both stages):

        50 - 8 + 6 - 6 + 4.5 = 46.5 ms   (48 ms without the overlap term)"""
    m = stage3_on_cpu()
    got = predict.predict(m, predict.Change(stage=1))
    assert got.basis["comm_s_now"] == pytest.approx(0.020)
    assert got.basis["comm_s_new"] == pytest.approx(0.015)
    assert got.basis["overlap_s_now"] == pytest.approx(0.006)
    assert got.basis["overlap_s_new"] == pytest.approx(0.0045)
    assert got.step_time_s == pytest.approx(0.0465)


def test_without_a_cpu_measurement_the_overlap_cost_is_zero() -> None:
    """A GPU run (NCCL on its own streams: the agent measures no CPU times) or an older
    agent: the model is the exposed communication's alone, 50 - 8 + 6 = 48 ms."""
    m = stage3_on_cpu(other_cpu_s=None, thread_cpu_s=None)
    got = predict.predict(m, predict.Change(stage=1))
    assert got.basis["overlap_s_now"] == 0.0 == got.basis["overlap_s_new"]
    assert got.step_time_s == pytest.approx(0.048)
    assert predict.overlap_cpu_per_comm_s(m, 0.020) == 0.0


def test_a_layout_with_the_same_communication_keeps_the_overlap_cost() -> None:
    """Stage 3 with optimizer offload moves as much as stage 3: the overlap term cancels and
    only the copies are added (1M / 2 fp32 elements down and up: 4 MB at the assumed
    10 GB/s, 0.4 ms, uncalibrated as the run did not offload)."""
    m = stage3_on_cpu()
    got = predict.predict(m, predict.Change(stage=3, offload_optimizer=True))
    assert got.basis["overlap_s_new"] == pytest.approx(got.basis["overlap_s_now"])
    assert got.step_time_s == pytest.approx(0.050 + 4e6 / predict.HOST_COPY_BYTES_PER_S)
    assert not got.calibrated


def test_a_bucket_change_moves_the_overlap_cost_with_its_seconds() -> None:
    """A reduce_bucket_size that cuts the reduce-scatter's seconds by `delta` saves delta
    times the exposed share (8 / 20) plus ρ (0.3) times it."""
    m = stage3_on_cpu(calls={"all_gather": 8, "reduce_scatter": 400})
    off = predict.predict(
        dataclasses.replace(m, other_cpu_s=None),
        predict.Change(stage=3, bucket=("reduce_bucket_size", 500_000)),
    )
    on = predict.predict(m, predict.Change(stage=3, bucket=("reduce_bucket_size", 500_000)))
    delta = (off.step_time_s - m.step_time_s) / (0.008 / 0.020)
    assert delta < 0
    assert on.basis["overlap_cpu_per_comm_s"] == pytest.approx(0.3)
    assert on.step_time_s == pytest.approx(m.step_time_s + delta * (0.4 + 0.3))


def test_stage_3_to_1_removes_stage_3s_parameter_management() -> None:
    """The run spent 3 ms a step in its communication phases outside any collective wait
    (gathering units into buffers, releasing them, per-unit reductions): stage 1 does none
    of it, so the prediction drops it on top of the overlap term's 46.5 ms (the test above):

        50 - 8 + 6 - 6 + 4.5 - 3 = 43.5 ms"""
    m = stage3_on_cpu(comm_phase_host_s=0.003)
    got = predict.predict(m, predict.Change(stage=1))
    assert got.basis["management_s_now"] == pytest.approx(0.003)
    assert got.basis["management_s_new"] == 0.0
    assert got.step_time_s == pytest.approx(0.0435)
    without = predict.predict(
        dataclasses.replace(m, comm_phase_host_s=None), predict.Change(stage=1)
    )
    assert without.step_time_s == pytest.approx(0.0465)


def test_stage_3_layouts_keep_the_parameter_management() -> None:
    """Within stage 3 (offload) the units are still gathered and released: the term cancels."""
    m = stage3_on_cpu(comm_phase_host_s=0.003)
    got = predict.predict(m, predict.Change(stage=3, offload_optimizer=True))
    assert got.basis["management_s_new"] == pytest.approx(0.003)
    assert got.step_time_s == pytest.approx(0.050 + 4e6 / predict.HOST_COPY_BYTES_PER_S)


def test_the_parameter_management_is_zero_on_gpu_below_stage_3_and_unmeasured() -> None:
    """A GPU run (the host runs ahead of the device: its bookkeeping is not the step's), a
    run below stage 3 (what it measured is its own bucket handling, which stage 1/2 keep) and
    a run without the exclusive parts price none."""
    m = stage3_on_cpu(comm_phase_host_s=0.003)
    assert predict.stage3_management_s(m) == pytest.approx(0.003)
    assert predict.stage3_management_s(dataclasses.replace(m, device="cuda")) == 0.0
    assert predict.stage3_management_s(dataclasses.replace(m, stage=1)) == 0.0
    assert predict.stage3_management_s(dataclasses.replace(m, comm_phase_host_s=None)) == 0.0
    assert predict.stage3_management_s(dataclasses.replace(m, comm_phase_host_s=-0.001)) == 0.0
    s1 = dataclasses.replace(m, stage=1)
    assert predict.predict(s1, predict.Change(stage=3)).basis["management_s_new"] == 0.0


def test_a_run_that_shared_its_cores_is_predicted_for_the_host_to_itself() -> None:
    """Another process took the cores: the same work (the clocks: 36 + 6 ms of CPU) took
    twice the wall time, every wall-clock figure with it (step 100 ms, waits 16, optimizer
    4, communication phases 6, collectives 20 + 20 ms and so half the bandwidth). c = (100 -
    16) / 42 = 2: the prediction is the one of the undisturbed run, 43.5 ms (the test
    above), and so is the step it is compared with."""
    quiet = stage3_on_cpu(comm_phase_host_s=0.003)
    shared = stage3_on_cpu(
        step_time_s=0.100, exposed_comm_s=0.016, optimizer_s=0.004, comm_phase_host_s=0.006,
        comm_s={"all_gather": 0.020, "reduce_scatter": 0.020},
        busbw={"all_gather": 2e8, "reduce_scatter": 1e8}, thread_cpu_s=0.036,
    )  # fmt: skip
    assert predict.contention(quiet) == 1.0
    assert predict.contention(shared) == pytest.approx(2.0)
    assert predict.uncontended(shared).step_time_s == pytest.approx(0.050)
    assert predict.uncontended(shared).busbw["all_gather"] == pytest.approx(4e8)
    got = predict.predict(shared, predict.Change(stage=1))
    assert got.basis["contention"] == pytest.approx(2.0)
    assert got.basis["step_time_uncontended_s"] == pytest.approx(0.050)
    assert got.step_time_s == pytest.approx(predict.predict(quiet, predict.Change(stage=1))
                                            .step_time_s)  # fmt: skip
    assert got.step_time_s == pytest.approx(0.0435)
    assert got.to_dict(shared)["step_time_now_s"] == 0.100  # what the run measured


def test_contention_is_one_without_the_clocks_or_where_they_explain_the_step() -> None:
    """A GPU run or an older agent reads no clocks; a step the waits and the threads' CPU
    explain (or more than explain: the comm threads ran beside the training thread) is the
    host's own."""
    m = stage3_on_cpu(step_time_s=0.100)
    assert predict.contention(dataclasses.replace(m, thread_cpu_s=None)) == 1.0
    assert predict.contention(dataclasses.replace(m, device="cuda")) == 1.0
    assert predict.contention(dataclasses.replace(m, step_time_s=0.045)) == 1.0
    assert predict.uncontended(dataclasses.replace(m, device="cuda")).step_time_s == 0.100
    assert predict.predict(dataclasses.replace(m, thread_cpu_s=None),
                           predict.Change(stage=3, offload_optimizer=True)).step_time_s > 0.1  # fmt: skip


def _table(own: int, sizes: list[int], calls: dict[int, dict[str, list[int]]]) -> dict:
    """engine_info as the agent sends it for the bundled engine (zerowatch/rehearse/counts.py)."""
    return {"collective_calls": {"world_size": N, "gradient_accumulation_steps": 1,
                                 "reduce_bucket_size": own, "bucket_sizes": sizes,
                                 "calls": {str(st): ops for st, ops in calls.items()}}}  # fmt: skip


def test_counted_calls_are_read_from_engine_info_and_looked_up_by_bucket_size() -> None:
    info = _table(1000, [256, 512, 1000, 1024], {1: {"reduce_scatter": [9, 5, 3, 3]}})
    counted = predict.CountedCalls.from_engine_info(info)
    assert counted is not None
    assert counted.at(1) == {"reduce_scatter": 3.0}  # the run's own size
    assert counted.at(1, 700) == {"reduce_scatter": 5.0}  # the largest size not above
    assert counted.at(1, 10**9) == {"reduce_scatter": 3.0}
    assert counted.at(1, 100) is None and counted.at(2) is None
    for bad in ({}, {"collective_calls": {"bucket_sizes": [1]}}, None,
                _table(1, [2, 1], {1: {"all_reduce": [1, 1]}}),
                _table(1, [1, 2], {1: {"all_reduce": [1]}})):  # fmt: skip
        assert predict.CountedCalls.from_engine_info(bad) is None


def _counted(m: predict.Measured, calls: dict[int, dict[str, list[int]]],
             sizes: list[int] | None = None, own: int = 1000) -> predict.Measured:  # fmt: skip
    info = _table(own, sizes or [own], calls)
    return dataclasses.replace(m, counted_calls=predict.CountedCalls.from_engine_info(info))


def test_with_counted_calls_a_layout_is_priced_by_its_calls() -> None:
    """Each call costs what the run measured a call of its op to take: all_gather 10 ms / 8
    = 1.25 ms, reduce-scatter 10 / 4 = 2.5 ms (stage 3 now: 8 x 1.25 + 4 x 2.5 = 20 ms, the
    measured). Stage 1 as counted: 2 all-gathers, 2 reduce-scatters (messages of 2 MB
    against 1 MB now: within the size factor) and the norm's all-reduce, an op the run did
    not make (the median, 1.875 ms): 2.5 + 5 + 1.875 = 9.375 ms, against 15 ms by the bytes
    alone. Exposed 8 x 9.375 / 20 = 3.75 ms. The comm threads' 6 ms of CPU go per ring pass
    (12 now; stage 1: 2 + 2 + the all-reduce's 2 = 6): 3 ms:

        50 - 8 - 6 + 3.75 + 3 = 42.75 ms"""
    m = _counted(stage3_on_cpu(), {3: {"all_gather": [8], "reduce_scatter": [4]},
                                   1: {"all_gather": [2], "reduce_scatter": [2],
                                       "all_reduce": [1]}})  # fmt: skip
    got = predict.predict(m, predict.Change(stage=1))
    assert got.basis["comm_s_now"] == pytest.approx(0.020)
    assert got.basis["comm_s_new"] == pytest.approx(0.009375)
    assert got.basis["overlap_s_now"] == pytest.approx(0.006)
    assert got.basis["overlap_s_new"] == pytest.approx(0.003)
    assert got.step_time_s == pytest.approx(0.04275)


def test_with_counted_calls_the_comm_threads_cpu_goes_by_ring_passes() -> None:
    """A stage-1 run (3 all-gathers, 3 reduce-scatters, the norm's all-reduce: 8 passes,
    4 ms of comm-thread CPU): stage 3's 8 gathers, 4 reduce-scatters and 2 all-reduces
    are 16 passes, 8 ms, whatever the latency of stage 1's calls (queued at the end of
    backward) says; without the clock it is 0."""
    m = _counted(stage3_on_cpu(stage=1, other_cpu_s=0.004),
                 {1: {"all_gather": [3], "reduce_scatter": [3], "all_reduce": [1]},
                  3: {"all_gather": [8], "reduce_scatter": [4], "all_reduce": [2]}})  # fmt: skip
    assert predict.comm_thread_cpu_s(m, 1) == pytest.approx(0.004)
    assert predict.comm_thread_cpu_s(m, 3) == pytest.approx(0.008)
    assert predict.comm_thread_cpu_s(m, 0) is None  # stage 0 not counted here
    got = predict.predict(m, predict.Change(stage=3))
    assert got.basis["overlap_s_new"] - got.basis["overlap_s_now"] == pytest.approx(0.004)
    assert predict.comm_thread_cpu_s(dataclasses.replace(m, other_cpu_s=None), 3) is None


def test_an_ops_latency_does_not_price_calls_of_much_larger_messages() -> None:
    """A stage-1 run's one all-reduce is the gradient norm (4 bytes; 5 ms: mostly waiting for
    the other rank); stage 0 all-reduces 4 MB in 2 buckets. Those calls take the median of
    the run's other ops (all_gather 1.25 ms, reduce_scatter 2.5 ms: 1.875 ms), not 5 ms."""
    m = stage3_on_cpu(
        stage=1, comm_s={"all_gather": 0.010, "reduce_scatter": 0.010, "all_reduce": 0.005},
        busbw={"all_gather": 4e8, "reduce_scatter": 2e8, "all_reduce": 1e3},
        calls={"all_gather": 8, "reduce_scatter": 4, "all_reduce": 1},
        comm_bytes={"all_gather": 8e6, "reduce_scatter": 4e6, "all_reduce": 4},
    )  # fmt: skip
    m = _counted(m, {0: {"all_reduce": [2]}})
    assert predict.counted_comm_seconds(m, 0) == pytest.approx(2 * 0.001875)


def test_a_layout_that_makes_more_calls_is_predicted_slower_than_its_bytes_say() -> None:
    base = stage3_on_cpu()
    bytes_only = predict.predict(base, predict.Change(stage=1)).step_time_s
    many = _counted(base, {3: {"all_gather": [8], "reduce_scatter": [4]},
                           1: {"all_gather": [40], "reduce_scatter": [40], "all_reduce": [1]}})  # fmt: skip
    few = _counted(base, {3: {"all_gather": [8], "reduce_scatter": [4]},
                          1: {"all_gather": [1], "reduce_scatter": [1], "all_reduce": [1]}})  # fmt: skip
    assert predict.predict(many, predict.Change(stage=1)).step_time_s > bytes_only
    assert predict.predict(few, predict.Change(stage=1)).step_time_s < bytes_only


def test_where_no_op_has_large_messages_the_links_bandwidth_is_beta() -> None:
    """Both ops carry 1 MB messages: none shows the link's bandwidth at large messages, so
    a bucket change has no β but the run's own; given the link's (`link_busbw`, 2 GB/s),
    each call's α is its seconds beyond its bytes at that: all-gather (10 ms - 4 MB at 2
    GB/s) / 8 = 1 ms, reduce-scatter (10 ms - 2 MB at 2 GB/s) / 4 = 2.25 ms."""
    m = stage3_on_cpu(comm_bytes={"all_gather": 8e6, "reduce_scatter": 4e6},
                      calls={"all_gather": 8, "reduce_scatter": 4})  # fmt: skip
    assert predict.reference_bandwidth(m, "reduce_scatter") is None
    assert predict.call_costs(m) == (
        pytest.approx({"all_gather": 0.0, "reduce_scatter": 0.00125}),
        4e8,
    )
    linked = dataclasses.replace(m, link_busbw=2e9)
    assert predict.reference_bandwidth(linked, "reduce_scatter") == 2e9
    alpha, beta = predict.call_costs(linked) or ({}, 0.0)
    assert beta == 2e9
    assert alpha == pytest.approx({"all_gather": 0.001, "reduce_scatter": 0.00225})
    # A link slower than the run's best changes nothing.
    assert predict.call_costs(dataclasses.replace(m, link_busbw=1e8)) == predict.call_costs(m)


def test_a_bucket_size_is_priced_by_the_counted_calls_of_every_op() -> None:
    """Buckets of 500 elements: 20 all-reduces of the persistent parameters; at 65,536 the
    engine counts 2, and its units (8 gathers, 4 reduce-scatters) do not change. Priced as a
    layout is, part by part:

    - each call at its op's α (β = 400 MB/s, the best bus bandwidth; α_all_reduce = (20 ms
      - 20 KB-worth at 1 MB/s over 400 MB/s) / 20 = 0.9975 ms): 18 fewer calls take the
      communication from 40 to 22.045 ms, and the exposed waits with it: 8 x 22.045 / 40
      = 4.409 ms;
    - the comm threads' CPU by ring passes: 8 + 4 + 2 x 20 = 52 now, 8 + 4 + 2 x 2 = 16:
      6 x 16 / 52 = 1.846 ms;
    - the parameter management (4 ms) by the units' calls, 12 and 12: unchanged.

        50 - (8 + 6 + 4) + (4.409 + 1.846 + 4) = 42.26 ms"""
    m = stage3_on_cpu(
        comm_s={"all_gather": 0.010, "reduce_scatter": 0.010, "all_reduce": 0.020},
        busbw={"all_gather": 4e8, "reduce_scatter": 2e8, "all_reduce": 1e6},
        calls={"all_gather": 8, "reduce_scatter": 4, "all_reduce": 20},
        comm_bytes={"all_gather": 8e6, "reduce_scatter": 4e6, "all_reduce": 2e4},
        comm_phase_host_s=0.004,
    )
    table = {3: {"all_gather": [8, 8], "reduce_scatter": [4, 4], "all_reduce": [20, 2]}}
    m = _counted(m, table, sizes=[500, 65536], own=500)
    got = predict.predict(m, predict.Change(stage=3, bucket=("reduce_bucket_size", 65536)))
    assert got.basis["exposed_s_new"] == pytest.approx(0.008 * 0.022045 / 0.040)
    assert got.basis["overlap_s_new"] == pytest.approx(0.006 * 16 / 52)
    assert got.basis["management_s_new"] == got.basis["management_s_now"] == 0.004
    assert got.step_time_s == pytest.approx(0.050 - 0.018 + 0.004409 + 0.006 * 16 / 52 + 0.004)
    assert got.model_state_bytes == m.model_state_bytes


def test_a_bucket_size_leaves_the_training_threads_own_cpu_work() -> None:
    """The run of the test above with most of its step in communication parts: exposed 30
    ms, comm threads' CPU 25 ms, path 4 ms (59 ms: more than the 50 ms step, where the comm
    threads run during the waits). At 65,536 they would come to 30 x 22.045 / 40 = 16.53,
    25 x 16 / 52 = 7.69 and 4 ms: a step of 50 - 59 + 28.22 = 19.2 ms, below the training
    thread's own CPU work, its 20 ms clock less the 4 ms path plus the new path's 4 ms:
    20 ms."""
    m = stage3_on_cpu(
        exposed_comm_s=0.030, other_cpu_s=0.025, thread_cpu_s=0.020,
        comm_s={"all_gather": 0.010, "reduce_scatter": 0.010, "all_reduce": 0.020},
        busbw={"all_gather": 4e8, "reduce_scatter": 2e8, "all_reduce": 1e6},
        calls={"all_gather": 8, "reduce_scatter": 4, "all_reduce": 20},
        comm_bytes={"all_gather": 8e6, "reduce_scatter": 4e6, "all_reduce": 2e4},
        comm_phase_host_s=0.004,
    )  # fmt: skip
    table = {3: {"all_gather": [8, 8], "reduce_scatter": [4, 4], "all_reduce": [20, 2]}}
    m = _counted(m, table, sizes=[500, 65536], own=500)
    assert predict.contention(m) == 1.0
    got = predict.predict(m, predict.Change(stage=3, bucket=("reduce_bucket_size", 65536)))
    parts = sum(got.basis[f"{k}_new"] for k in ("exposed_s", "overlap_s", "management_s"))
    assert parts == pytest.approx(0.030 * 0.022045 / 0.040 + 0.025 * 16 / 52 + 0.004)
    assert got.step_time_s == got.basis["step_floor_s"] == pytest.approx(0.020)
    # With the clocks unmeasured (a GPU) nothing bounds it but zero.
    gpu = dataclasses.replace(m, thread_cpu_s=None, other_cpu_s=None)
    got = predict.predict(gpu, predict.Change(stage=3, bucket=("reduce_bucket_size", 65536)))
    assert "step_floor_s" not in got.basis and got.step_time_s >= 0.0


def test_the_communication_path_moves_with_the_calls_it_handles() -> None:
    """Stage 3's parameter management goes per unit: 4 ms for 12 unit calls (8 gathers, 4
    reduce-scatters) now, 8 ms for the 24 of a smaller bucket. Stages 0-2's bucket handling
    goes per call: a stage-1 run whose own path is 2 ms over 7 calls (3 + 3 + the norm's
    all-reduce) has 2 x 25 / 7 ms over the 25 of buckets a third the size."""
    m = _counted(stage3_on_cpu(comm_phase_host_s=0.004),
                 {3: {"all_gather": [16, 8], "reduce_scatter": [8, 4]}}, sizes=[256, 1000])  # fmt: skip
    got = predict.predict(m, predict.Change(stage=3, bucket=("reduce_bucket_size", 256)))
    assert got.basis["management_s_now"] == pytest.approx(0.004)
    assert got.basis["management_s_new"] == pytest.approx(0.008)
    assert got.step_time_s > m.step_time_s
    one = stage3_on_cpu(
        stage=1, comm_phase_host_s=0.002,
        comm_s={"all_gather": 0.006, "reduce_scatter": 0.006, "all_reduce": 0.001},
        busbw={"all_gather": 4e8, "reduce_scatter": 2e8, "all_reduce": 1e3},
        calls={"all_gather": 3, "reduce_scatter": 3, "all_reduce": 1},
        comm_bytes={"all_gather": 4e6, "reduce_scatter": 4e6, "all_reduce": 4},
    )  # fmt: skip
    info = _table(200000, [65536, 200000],
                  {1: {"all_gather": [12, 3], "reduce_scatter": [12, 3], "all_reduce": [1, 1]}})  # fmt: skip
    info["collective_calls"]["management_s"] = {"1": 0.0015, "3": 0.004}
    one = dataclasses.replace(one, counted_calls=predict.CountedCalls.from_engine_info(info))
    got = predict.predict(one, predict.Change(stage=1, bucket=("reduce_bucket_size", 65536)))
    assert got.basis["management_s_now"] == pytest.approx(0.002)  # its own, not rehearsed
    assert got.basis["management_s_new"] == pytest.approx(0.002 * 25 / 7)


def test_the_bucket_candidates_are_a_quarter_and_four_times_the_runs_counted_sizes() -> None:
    """Own size 200,000 of a model counted up to 524,288 (one bucket): a quarter is 50,000,
    nearest in ratio 65,536 (x1.31, against 32,768's x1.53); four times is 800,000, nearest
    524,288. Each is a change of the run's own layout, priced by its counted calls."""
    sizes = [32768, 65536, 131072, 200000, 262144, 524288]
    table = {3: {"all_gather": [40, 24, 14, 8, 8, 4], "reduce_scatter": [20, 12, 7, 4, 4, 2]}}
    m = _counted(stage3_on_cpu(offload_optimizer=True), table, sizes=sizes, own=200000)
    got = predict.bucket_candidates(m)
    assert [c.bucket for c in got] == [("reduce_bucket_size", 65536),
                                       ("reduce_bucket_size", 524288)]  # fmt: skip
    assert all(c.stage == 3 and c.offload_optimizer and not c.offload_param for c in got)
    smaller, larger = (predict.predict(m, c).step_time_s for c in got)
    assert smaller > m.step_time_s > larger  # more calls, fewer calls


def test_a_bucket_size_moves_the_peak_by_its_buffers() -> None:
    """Two reduce buckets of fp32 with overlap_comm (plan.buffer_bytes): 200,000 -> 65,536
    frees (200,000 - 65,536) x 4 B x 2 = 1,075,712 B, 524,288 adds 2,594,304 B. On a device
    of 1.11 GB (90%: 0.999 GB) the run's 1 GB peak does not fit, the smaller bucket does and
    the larger does not; model state is unchanged."""
    sizes = [65536, 200000, 524288]
    table = {3: {"all_gather": [24, 8, 4], "reduce_scatter": [12, 4, 2]}}
    m = _counted(stage3_on_cpu(peak_bytes=1e9, capacity_bytes=1.11e9,
                               zero_config={"reduce_bucket_size": 200000, "overlap_comm": True}),
                 table, sizes=sizes, own=200000)  # fmt: skip
    small, large = (predict.predict(m, predict.Change(stage=3, bucket=("reduce_bucket_size", b)))
                    for b in (65536, 524288))  # fmt: skip
    assert small.peak_bytes == pytest.approx(1e9 - 1_075_712)
    assert large.peak_bytes == pytest.approx(1e9 + 2_594_304)
    assert (small.fits, large.fits) == (True, False)
    assert small.model_state_bytes == large.model_state_bytes == m.model_state_bytes
    # A run whose own value is not known ("auto", no count) is not moved by a guess.
    auto = stage3_on_cpu(peak_bytes=1e9, zero_config={"reduce_bucket_size": "auto"})
    got = predict.predict(auto, predict.Change(stage=3, bucket=("reduce_bucket_size", 65536)))
    assert got.peak_bytes == 1e9


def test_a_bucket_candidate_goes_on_to_the_next_size_that_changes_the_calls() -> None:
    """Stage 3 cuts its units by the module tree: from 20,000 a quarter (4,096) and four
    times (65,536) make the same calls, so the candidates are the next sizes further out
    that do not (1,024: the persistent parameters' all-reduces split; 262,144: two units
    share a bucket). A run already in one bucket has none larger, and without the counts
    (a foreign engine) there is none."""
    sizes = [512, 1024, 2048, 4096, 20000, 65536, 131072, 262144]
    table = {3: {"all_gather": [8, 8, 8, 8, 8, 8, 8, 6], "reduce_scatter": [4, 4, 4, 4, 4, 4, 4, 3],
                 "all_reduce": [9, 5, 2, 2, 2, 2, 2, 2]}}  # fmt: skip
    m = _counted(stage3_on_cpu(), table, sizes=sizes, own=20000)
    assert [c.bucket for c in predict.bucket_candidates(m)] == [
        ("reduce_bucket_size", 1024), ("reduce_bucket_size", 262144)]  # fmt: skip
    whole = _counted(stage3_on_cpu(), {3: {"all_gather": [9, 8, 8], "reduce_scatter": [5, 4, 4]}},
                     sizes=[256, 1000, 4000], own=4000)  # fmt: skip
    assert [c.bucket for c in predict.bucket_candidates(whole)] == [("reduce_bucket_size", 256)]
    assert predict.bucket_candidates(stage3_on_cpu()) == []


def test_keys_the_counts_do_not_follow_keep_the_estimate_from_bytes() -> None:
    m = stage3_on_cpu()
    counted = _counted(m, {3: {"all_gather": [8], "reduce_scatter": [4]}})
    change = predict.Change(stage=3, bucket=("stage3_prefetch_bucket_size", 10**6),
                            bucket_op="all_gather")  # fmt: skip
    assert predict.predict(counted, change).step_time_s == predict.predict(m, change).step_time_s
    assert "counted_calls" not in predict.predict(counted, change).basis


def test_a_run_below_stage_3_prices_the_management_the_engine_rehearsed() -> None:
    """A stage-1 run has not measured stage 3's parameter management; it was rehearsed on
    the job when the agent attached (zerowatch/rehearse/paths.py: 2 ms here). A prediction up
    to stage 3 adds it, one to stage 2 does not, and a GPU run prices none (its host runs
    ahead of the device)."""
    calls = {1: {"all_gather": [2], "reduce_scatter": [2], "all_reduce": [1]},
             2: {"all_gather": [2], "reduce_scatter": [2], "all_reduce": [1]},
             3: {"all_gather": [8], "reduce_scatter": [4]}}  # fmt: skip
    info = _table(1000, [1000], calls)
    info["collective_calls"]["management_s"] = {"3": 0.002}
    s1 = dataclasses.replace(
        stage3_on_cpu(stage=1, comm_phase_host_s=-0.001),
        counted_calls=predict.CountedCalls.from_engine_info(info),
    )
    plain = dataclasses.replace(s1, counted_calls=_counted(s1, calls).counted_calls)
    to3 = predict.predict(s1, predict.Change(stage=3))
    assert to3.basis["management_s_new"] == pytest.approx(0.002)
    assert to3.step_time_s == pytest.approx(
        predict.predict(plain, predict.Change(stage=3)).step_time_s + 0.002
    )
    to2 = predict.predict(s1, predict.Change(stage=2))
    assert to2.step_time_s == predict.predict(plain, predict.Change(stage=2)).step_time_s
    gpu = dataclasses.replace(s1, device="cuda")
    assert predict.predict(gpu, predict.Change(stage=3)).basis["management_s_new"] == 0.0
    for bad in (-1.0, "x", float("nan")):
        info["collective_calls"]["management_s"] = {"3": bad}
        counted = predict.CountedCalls.from_engine_info(info)
        assert counted is not None and counted.management_s == {}


def test_each_stages_communication_path_is_priced_from_the_engines_rehearsal() -> None:
    """Where every stage's communication path on the training thread was rehearsed
    (zerowatch/rehearse/paths.py: stage 0 0.5 ms, 1 1 ms, 2 4 ms, 3 7 ms here), a change of stage
    takes off what the run measured of its own (the communication phases less the waits:
    1.5 ms at this stage-1 run, 3 ms at the stage-3 one) and adds the other stage's
    rehearsed figure: stage 1 -> 2 is 2.5 ms slower than without the table, -> 3 5.5 ms;
    stage 3 -> 1 takes off 3 ms and adds 1 ms. A change within the stage (offload) keeps
    the run's own. A GPU run prices none; values that are not seconds are not read."""
    calls = {1: {"all_gather": [2], "reduce_scatter": [2], "all_reduce": [1]},
             2: {"all_gather": [2], "reduce_scatter": [2], "all_reduce": [1]},
             3: {"all_gather": [8], "reduce_scatter": [4]}}  # fmt: skip
    info = _table(1000, [1000], calls)
    info["collective_calls"]["management_s"] = {"0": 0.0005, "1": 0.001, "2": 0.004,
                                                "3": 0.007}  # fmt: skip
    counted = predict.CountedCalls.from_engine_info(info)
    assert counted is not None and counted.management_s == {0: 0.0005, 1: 0.001, 2: 0.004,
                                                            3: 0.007}  # fmt: skip
    s1 = dataclasses.replace(stage3_on_cpu(stage=1, comm_phase_host_s=0.0015),
                             counted_calls=counted)  # fmt: skip
    plain = dataclasses.replace(s1, counted_calls=_counted(s1, calls).counted_calls)

    def step(m: predict.Measured, **change: Any) -> float:
        return predict.predict(m, predict.Change(**change)).step_time_s

    assert step(s1, stage=2) == pytest.approx(step(plain, stage=2) - 0.0015 + 0.004)
    assert step(s1, stage=3) == pytest.approx(step(plain, stage=3) - 0.0015 + 0.007)
    assert step(s1, stage=1, offload_optimizer=True) == pytest.approx(
        step(plain, stage=1, offload_optimizer=True)
    )
    got = predict.predict(s1, predict.Change(stage=0)).basis
    assert (got["management_s_now"], got["management_s_new"]) == (0.0015, 0.0005)
    s3 = dataclasses.replace(stage3_on_cpu(comm_phase_host_s=0.003), counted_calls=counted)
    plain3 = dataclasses.replace(s3, counted_calls=_counted(s3, calls).counted_calls)
    assert step(s3, stage=1) == pytest.approx(step(plain3, stage=1) + 0.001)
    assert step(s3, stage=3, offload_optimizer=True) == pytest.approx(
        step(plain3, stage=3, offload_optimizer=True)
    )
    gpu = predict.predict(dataclasses.replace(s1, device="cuda"), predict.Change(stage=3))
    assert (gpu.basis["management_s_now"], gpu.basis["management_s_new"]) == (0.0, 0.0)
    info["collective_calls"]["management_s"] = {"1": -1.0, "2": float("nan"), "3": True,
                                                "x": 0.001, "0": "y"}  # fmt: skip
    bad = predict.CountedCalls.from_engine_info(info)
    assert bad is not None and bad.management_s == {}


def test_without_the_rehearsed_paths_a_change_of_stage_says_it_is_not_calibrated() -> None:
    """A CPU run of the bundled engine instrumented with `rehearse=False` sends its counted
    calls but no rehearsed paths: another stage's path on the training thread is unknown
    (taken as 0, the run's own kept inside its step), and the prediction says so; one with
    the rehearsed paths is calibrated, as is a change within the stage or a GPU run (whose
    host-side path is 0 by definition)."""
    calls = {1: {"all_gather": [2], "reduce_scatter": [2], "all_reduce": [1]},
             3: {"all_gather": [8], "reduce_scatter": [4]}}  # fmt: skip
    bare = _counted(stage3_on_cpu(comm_phase_host_s=0.003), calls)
    to1 = predict.predict(bare, predict.Change(stage=1))
    assert not to1.calibrated
    assert to1.basis["management_s_new"] == 0.0
    info = _table(1000, [1000], calls)
    info["collective_calls"]["management_s"] = {"1": 0.001, "3": 0.004}
    rehearsed = dataclasses.replace(bare, counted_calls=predict.CountedCalls.from_engine_info(info))
    assert predict.predict(rehearsed, predict.Change(stage=1)).calibrated
    assert predict.predict(bare, predict.Change(stage=3)).calibrated
    gpu = dataclasses.replace(bare, device="cuda")
    assert predict.predict(gpu, predict.Change(stage=1)).calibrated
