"""The pages' reads (server/page_queries.py): sampled steps, and values that match what was
ingested."""

from __future__ import annotations

import itertools
import statistics

import pytest
from zerowatch.server import page_queries as pq
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read import series

from zerowatch import events as ev
from zerowatch import simulate as sim


def test_sample_steps_are_evenly_spaced_with_both_ends():
    assert pq.sample_steps(0, 9, 400) == list(range(10))
    got = pq.sample_steps(0, 99_999, 400)
    assert len(got) == 400 and got[0] == 0 and got[-1] == 99_999
    gaps = {b - a for a, b in itertools.pairwise(got)}
    assert max(gaps) - min(gaps) <= 1
    assert pq.sample_steps(5, 4, 10) == []


@pytest.fixture
def stored(tmp_path):  # type: ignore[no-untyped-def]
    db = Database.open(f"sqlite:///{tmp_path / 'z.db'}")
    spec = sim.SimSpec(name="q", stage=3, world_size=4, straggler_rank=1, offload_optimizer=True,
                       precision="fp16", seed=5)  # fmt: skip
    rc = sim.run_create(spec)
    store.create_run(db, run=rc)
    events = [e for step in sim.steps(spec, 30) for e in step]
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(run_id=rc.run_id, events=events))
    yield db, rc, events
    db.close()


def test_run_view_matches_the_ingested_events(stored):
    db, rc, events = stored
    view = pq.run_view(db=db, run_id=rc.run_id)
    assert view is not None and view.last_step == 29 and view.steps == list(range(30))
    at5 = [e for e in events if e.step == 5]
    # Every chart draws the median over ranks (the read model's p50).
    assert view.step_time.values[5] == pytest.approx(statistics.median(e.step_time_s for e in at5))
    assert view.phases["backward"].values[5] == pytest.approx(
        statistics.median(e.phases["backward"] for e in at5)
    )
    ag = [c for e in at5 for c in e.collectives if c.op == "all_gather"]
    assert view.latency["all_gather"].values[5] == pytest.approx(
        statistics.median(c.latency_sum_s / c.count for c in ag)
    )
    assert view.sizes["all_gather"].sizes[5] == pytest.approx(
        statistics.median(c.bytes for c in ag) / statistics.median(c.count for c in ag)
    )
    assert set(view.offload) == {"d2h", "h2d"}
    assert view.heat.ranks == [0, 1, 2, 3] and len(view.heat.steps) == 30
    e1 = next(e for e in at5 if e.rank == 1)  # the straggler, by busy time
    assert view.heat.z[1][5] == pytest.approx(e1.step_time_s - e1.exposed_comm_s)
    heat = series.rank_heatmap(db=db, run_id=rc.run_id, metric="busy_s")
    assert heat is not None and heat["straggler"]["rank"] == 1
    # Memory at the newest step: every rank's peak (its highest phase peak), sorted.
    at29 = {e.rank: e for e in events if e.step == 29}
    peaks = sorted((max(e.memory.peak_by_phase.values()), e.rank) for e in at29.values())
    dist = view.memory_peak
    assert dist is not None and dist.step == 29 and dist.n == 4 and dist.every_rank
    assert list(dist.ranks) == [r for _, r in peaks]
    assert list(dist.values) == pytest.approx([v for v, _ in peaks])
    assert list(dist.positions) == [0, 1, 2, 3]
    fwd = sorted(e.memory.peak_by_phase["forward"] for e in at29.values())
    assert (view.memory_phases["forward"].min, view.memory_phases["forward"].max) == (
        pytest.approx(fwd[0]), pytest.approx(fwd[-1]))  # fmt: skip
    assert view.memory_state["params"] == pytest.approx(
        statistics.median(e.memory.model_state["params"] for e in at29.values())
    )
    assert view.capacity_bytes == max(e.memory.capacity_bytes for e in at29.values())
    assert view.peak_bytes == pytest.approx(peaks[-1][0])
    assert view.theory == {k: float(v) for k, v in rc.theory.items()}
    assert view.loss_scale.values[0] == 65536.0


def test_run_view_samples_a_long_run(stored):
    db, rc, events = stored
    view = pq.run_view(db=db, run_id=rc.run_id, max_points=7)
    assert view is not None and len(view.steps) == 7
    assert view.steps[0] == 0 and view.steps[-1] == 29
    assert len(view.step_time.steps) == 7 and len(view.heat.steps) == 7
    # the collectives of exactly the sampled steps, every rank's
    assert view.latency["all_gather"].steps == view.steps
    for step, got in zip(view.steps, view.latency["all_gather"].values, strict=True):
        ag = [c for e in events if e.step == step for c in e.collectives if c.op == "all_gather"]
        assert got == pytest.approx(statistics.median(c.latency_sum_s / c.count for c in ag))


def test_run_summary_averages_the_newest_steps(stored):
    db, rc, events = stored
    got = pq.run_summary(db=db, run_id=rc.run_id, window=10)
    assert got is not None
    _, summary = got
    # read.compare's definitions: medians over the newest steps of the medians over ranks;
    # the job's samples/s is the sum over ranks at a step.
    newest = range(20, 30)
    at = {s: [e for e in events if e.step == s] for s in newest}
    assert summary.step_time_s == pytest.approx(
        statistics.median(statistics.median(e.step_time_s for e in at[s]) for s in newest)
    )
    assert summary.comm_bytes == pytest.approx({op: float(b) for op, b in rc.theory_comm.items()})
    assert summary.samples_per_s == pytest.approx(
        statistics.median(sum(e.samples_per_s for e in at[s]) for s in newest)
    )
    assert pq.run_summary(db=db, run_id="nope") is None
    assert pq.run_view(db=db, run_id="nope") is None


def test_the_run_page_stacks_exclusive_parts_that_meet_the_step_time(stored):
    from zerowatch.dashboards.run import figures

    db, rc, events = stored
    view = pq.run_view(db=db, run_id=rc.run_id)
    assert view is not None and set(view.parts) == set(ev.STEP_PARTS)
    at5 = [e for e in events if e.step == 5]
    mean5 = statistics.fmean(e.step_time_s for e in at5)
    assert view.step_time_mean.values[5] == pytest.approx(mean5)
    assert sum(s.values[5] for s in view.parts.values()) == pytest.approx(mean5, rel=1e-9)
    assert view.hidden_comm.values[5] == pytest.approx(
        statistics.fmean(e.hidden_comm_s for e in at5)
    )
    # The figure: the stack is the parts only (no nested phase), and its height is the line.
    fig = figures(view)["breakdown"]
    stacked = [t for t in fig.data if t.stackgroup == "parts"]
    assert len(stacked) == len(ev.STEP_PARTS)
    line = next(t for t in fig.data if t.name == "step time")
    for i in range(len(view.steps)):
        assert sum(t.y[i] for t in stacked) == pytest.approx(line.y[i], rel=1e-9)
    assert any(t.name.startswith("hidden communication") and t.stackgroup is None for t in fig.data)


def test_compare_stacks_parts_that_meet_the_mean_step_time(stored):
    from zerowatch.dashboards.compare import step_phases

    db, rc, _ = stored
    got = pq.run_summary(db=db, run_id=rc.run_id)
    assert got is not None
    _, summary = got
    assert set(summary.parts) == set(ev.STEP_PARTS)
    assert sum(summary.parts.values()) == pytest.approx(summary.step_time_mean_s, rel=1e-9)
    fig = step_phases([summary])
    bars = [t for t in fig.data if t.type == "bar"]
    marker = next(t for t in fig.data if t.type == "scatter")
    assert sum(b.y[0] for b in bars) == pytest.approx(marker.y[0], rel=1e-9)


def test_a_wide_run_page_shows_the_spread_over_ranks_and_names_its_straggler(tmp_path):
    from zerowatch.dashboards.run import figures

    db = Database.open(f"sqlite:///{tmp_path / 'wide.db'}")
    try:
        spec = sim.SimSpec(name="wide", stage=3, world_size=64, straggler_rank=37,
                           straggler_factor=1.5, spans_every=0, seed=2)  # fmt: skip
        rc = sim.run_create(spec)
        store.create_run(db, run=rc)
        events = [e for step in sim.steps(spec, 12) for e in step]
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
        view = pq.run_view(db=db, run_id=rc.run_id)
    finally:
        db.close()
    assert view is not None
    busy = view.spread["busy_s"]
    at5 = sorted(e.step_time_s - e.exposed_comm_s for e in events if e.step == 5)
    assert busy["max"].values[5] == pytest.approx(at5[-1])
    assert busy["min"].values[5] <= busy["p10"].values[5] <= busy["p50"].values[5]
    assert busy["p50"].values[5] <= busy["p90"].values[5] <= busy["max"].values[5]
    # Bands for each phase, exposed communication and each collective, from the rollups.
    for name in ("exposed_comm_s", "phase.forward", "phase.param_gather",
                 "collective.all_gather.latency_s", "collective.reduce_scatter.busbw"):  # fmt: skip
        assert set(view.spread[name]) == {"min", "p10", "p50", "p90", "max"}, name
    fwd = sorted(e.phases["forward"] for e in events if e.step == 5)
    assert view.spread["phase.forward"]["max"].values[5] == pytest.approx(fwd[-1])
    assert view.spread["phase.forward"]["min"].values[5] == pytest.approx(fwd[0])
    # Memory over 64 ranks from the rollups: the 16 lowest and 16 highest ranks exactly,
    # the median between them (p10 and p90 fall among the named ranks).
    at11 = sorted((max(e.memory.peak_by_phase.values()), e.rank) for e in events if e.step == 11)
    dist = view.memory_peak
    assert dist is not None and dist.n == 64 and not dist.every_rank
    assert list(dist.positions) == [*range(16), 31.5, *range(48, 64)]
    assert list(dist.ranks[:16]) == [r for _, r in at11[:16]]
    assert list(dist.ranks[-16:]) == [r for _, r in at11[-16:]]
    assert list(dist.values[-16:]) == pytest.approx([v for v, _ in at11[-16:]])
    assert dist.ranks[16] is None
    assert dist.values[16] == pytest.approx(statistics.median(v for v, _ in at11))
    drawn = figures(view)
    assert {"spread", "phases", "memory"} <= set(drawn)
    fig = drawn["spread"]
    assert {t.name for t in fig.data if t.showlegend is not False} >= {
        "min–max over ranks", "p10–p90 over ranks", "median rank"
    }  # fmt: skip
    # The table of ranks that stand out: the straggler first, slowest in busy time, with its
    # host (8 ranks a host: rank 37 runs on the fifth).
    first = view.outliers[0]
    assert (first["rank"], first["what"]) == (37, "slowest busy time")
    assert first["host"] == sim.host_of(spec, 37) and first["ratio"] > 1.3
    for o in view.outliers:  # each stands out on its bad side: slow, full, or low bandwidth
        if o["what"].startswith("lowest"):
            assert o["ratio"] <= 1 - pq.STANDS_OUT, o
        else:
            assert o["ratio"] >= 1 + pq.STANDS_OUT, o


def test_the_outlier_table_lists_only_the_rank_that_stands_out(stored):
    db, rc, _ = stored
    view = pq.run_view(db=db, run_id=rc.run_id)
    assert view is not None
    slow = [o["rank"] for o in view.outliers if o["what"] == "slowest busy time"]
    assert slow == [1]


def test_run_page_memory_waterfall_of_the_median_and_worst_rank_from_stored_steps(stored):
    from zerowatch.dashboards.run import figures, waterfall_by_rank

    from zerowatch import plan

    db, rc, events = stored
    view = pq.run_view(db=db, run_id=rc.run_id)
    assert view is not None
    at29 = [e for e in events if e.step == 29]
    peaks = [max(e.memory.peak_by_phase.values()) for e in at29]
    reserved = [e.memory.reserved_bytes for e in at29]
    assert view.memory_reserved == pytest.approx(
        (statistics.median(reserved), max(reserved)), rel=1e-6
    )
    bars = waterfall_by_rank(view)
    assert set(bars) == {"median rank", "worst rank"}
    state = sum(v for k, v in view.memory_state.items() if k in ev.STATE_KINDS)
    z = rc.config["zero_optimization"]
    buffers = sum(plan.buffer_bytes(rc.param_count, rc.precision, rc.zero_stage,
                                    **{k: z[k] for k in ("reduce_bucket_size",
                                                         "allgather_bucket_size",
                                                         "stage3_prefetch_bucket_size",
                                                         "stage3_max_live_parameters",
                                                         "overlap_comm") if k in z}).values())  # fmt: skip
    worst = bars["worst rank"]
    assert worst["theory"] == sum(v for k, v in rc.theory.items() if k in ev.STATE_KINDS)
    assert worst["model_state"] == int(state)
    assert worst["comm_buffers"] == buffers
    assert worst["activations"] == pytest.approx(max(max(peaks) - state - buffers, 0), abs=2)
    assert worst["allocator_reserve"] == pytest.approx(max(max(reserved) - max(peaks), 0), abs=2)
    assert bars["median rank"]["activations"] <= worst["activations"]
    fig = figures(view)["waterfall"]
    assert [t.name for t in fig.data] == ["median rank", "worst rank"]
    assert list(fig.data[1].x)[-1] == "allocator reserve + fragmentation"
