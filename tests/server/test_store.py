"""The store on SQLite and on a real PostgreSQL: idempotent ingest, per-rank progress, run
status from end events, transactions that leave nothing half-written, and the queries."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import select
from zerowatch.server import models as m
from zerowatch.server import read, store
from zerowatch.server.db import Database
from zerowatch.server.read import compare as compare_read
from zerowatch.server.read import series as series_read
from zerowatch.server.read import trace as trace_read

from zerowatch import events as ev
from zerowatch import simulate

SPEC = simulate.SimSpec(world_size=4, stage=3, spans_every=5, grad_spike_at=33)


def _per_rank_series(*, rank: int | None = None, **kw: Any) -> dict[str, Any] | None:
    """A series of every rank (or one): the per-rank selection of the series read."""
    ranks = (rank,) if rank is not None else tuple(range(64))
    return series_read.series(selection=read.Selection(ranks=ranks), **kw)


queries = SimpleNamespace(
    get_run=read.get_run,
    list_runs=read.list_runs,
    UnknownMetric=read.UnknownMetric,
    compare=compare_read.compare,
    trace=trace_read.trace,
    series=_per_rank_series,
)


def _run(db: Database, spec: simulate.SimSpec = SPEC, n_steps: int = 40) -> str:
    rc = simulate.run_create(spec)
    assert store.create_run(db, run=rc)[1] is True
    for evs in simulate.steps(spec, n_steps):
        result = store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, evs))
        assert result is not None and result.accepted == len(evs)
    return rc.run_id


def test_whole_numbers_in_float_fields_and_floats_side_by_side_are_stored(db: Database) -> None:
    """One group mixes 1 and 0.5 in the same float column (JSON has one number type, so a
    client may well send `1` for 1.0), and nulls beside values."""
    rc = simulate.run_create(SPEC)
    store.create_run(db, run=rc)
    whole = dataclasses.replace(simulate.step_event(SPEC, 0, 0), step_time_s=1, loss=2,
                                grad_norm=None, lr=0, time=1_700_000_000)  # fmt: skip
    whole.collectives[0].latency_sum_s = 1
    frac = dataclasses.replace(simulate.step_event(SPEC, 1, 0), step_time_s=0.5, loss=None)
    result = store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [whole, frac]))
    assert result is not None and result.accepted == 2
    got = queries.series(db=db, run_id=rc.run_id, metric="step_time_s")
    assert got is not None
    assert [(s["rank"], s["values"]) for s in got["series"]] == [(0, [1.0]), (1, [0.5])]
    loss = queries.series(db=db, run_id=rc.run_id, metric="loss")
    assert loss is not None and [(s["rank"], s["values"]) for s in loss["series"]] == [(0, [2.0])]


def test_create_run_is_idempotent_on_run_id(db: Database) -> None:
    rc = simulate.run_create(SPEC)
    pk, created = store.create_run(db, run=rc)
    assert created
    assert store.create_run(db, run=rc) == (pk, False)
    run = queries.get_run(db=db, run_id=rc.run_id)
    assert run is not None
    assert (run["zero_stage"], run["world_size"], run["precision"]) == (3, 4, "bf16")
    assert run["theory"] == rc.theory and run["config"] == rc.config
    assert run["status"] == "running" and run["ranks"] == []


def test_replayed_events_are_stored_once(db: Database) -> None:
    run_id = _run(db, n_steps=10)
    evs = [simulate.step_event(SPEC, r, s) for s in range(8, 12) for r in range(4)]
    # steps 8 and 9 are already stored; 10 and 11 are new; one event repeated in the batch
    result = store.ingest_batch(db, run_id=run_id, batch=ev.EventBatch(run_id, [*evs, evs[-1]]))
    assert result is not None
    assert (result.accepted, result.duplicates) == (8, 9)
    run = queries.get_run(db=db, run_id=run_id)
    assert run is not None
    assert [(x["rank"], x["steps"], x["last_step"]) for x in run["ranks"]] == [
        (r, 12, 11) for r in range(4)
    ]
    got = queries.series(db=db, run_id=run_id, metric="step_time_s", rank=2)
    assert got is not None and got["series"][0]["steps"] == list(range(12))


def test_end_events_settle_the_run_status(db: Database) -> None:
    run_id = _run(db, n_steps=3)
    now = time.time()
    ends = [ev.EndEvent(rank=r, seq=3, time=now, status="finished") for r in range(3)]
    result = store.ingest_batch(db, run_id=run_id, batch=ev.EventBatch(run_id, ends))
    assert result is not None and result.status == "running"  # rank 3 has not ended yet
    last = ev.EndEvent(rank=3, seq=3, time=now, status="failed", error="CUDA OOM")
    result = store.ingest_batch(db, run_id=run_id, batch=ev.EventBatch(run_id, [last]))
    assert result is not None and result.status == "failed"
    run = queries.get_run(db=db, run_id=run_id)
    assert run is not None and run["status"] == "failed"
    assert run["ranks"][3]["error"] == "CUDA OOM"
    again = store.ingest_batch(db, run_id=run_id, batch=ev.EventBatch(run_id, [last]))
    assert again is not None and (again.accepted, again.duplicates) == (0, 1)


def test_a_bad_batch_stores_nothing(db: Database) -> None:
    run_id = _run(db, n_steps=5)
    good = [simulate.step_event(SPEC, 0, s) for s in range(5, 8)]
    bad = simulate.step_event(SPEC, 9, 5)  # rank 9 in a world of 4
    with pytest.raises(store.BatchError) as err:
        store.ingest_batch(db, run_id=run_id, batch=ev.EventBatch(run_id, [*good, bad]))
    assert err.value.loc == ("body", "events", 3, "rank")
    broken = simulate.step_event(SPEC, 1, 5)
    broken.collectives[0].buckets = [1, 2]
    with pytest.raises(store.BatchError, match="buckets"):
        store.ingest_batch(db, run_id=run_id, batch=ev.EventBatch(run_id, [*good, broken]))
    run = queries.get_run(db=db, run_id=run_id)
    assert run is not None and [x["steps"] for x in run["ranks"]] == [5, 5, 5, 5]


def test_unknown_run_and_delete(db: Database) -> None:
    assert store.ingest_batch(db, run_id="nope", batch=ev.EventBatch("nope", [])) is None
    run_id = _run(db, n_steps=3)
    assert store.delete_run(db, run_id=run_id) is True
    assert queries.get_run(db=db, run_id=run_id) is None
    assert queries.series(db=db, run_id=run_id, metric="loss") is None
    assert store.delete_run(db, run_id=run_id) is False


def test_series_downsampling_keeps_the_grad_norm_spike(db: Database) -> None:
    run_id = _run(db, n_steps=40)
    out = queries.series(db=db, run_id=run_id, metric="grad_norm", rank=1, max_points=10)
    assert out is not None
    (s,) = out["series"]
    assert s["points"] == 40 and len(s["steps"]) <= 10
    assert 33 in s["steps"]  # the 50x spike survives
    assert max(s["values"]) > 20


@pytest.mark.parametrize(
    ("metric", "unit"),
    [
        ("phase.backward", "s"),
        ("collective.all_gather.bytes", "B"),
        ("collective.reduce_scatter.busbw", "B/s"),
        ("collective.all_gather.latency_s", "s"),
        ("memory.peak.backward", "B"),
        ("memory.state.params", "B"),
        ("samples_per_s", "samples/s"),
    ],
)
def test_series_reads_each_kind_of_metric(db: Database, metric: str, unit: str) -> None:
    run_id = _run(db, n_steps=6)
    out = queries.series(db=db, run_id=run_id, metric=metric, step_from=2, step_to=4)
    assert out is not None and out["unit"] == unit
    assert [s["rank"] for s in out["series"]] == [0, 1, 2, 3]
    assert all(s["steps"] == [2, 3, 4] for s in out["series"])
    e = simulate.step_event(SPEC, 2, 3)
    expected = {
        "phase.backward": e.phases["backward"],
        "collective.all_gather.bytes": next(c.bytes for c in e.collectives if c.op == "all_gather"),
        "memory.peak.backward": e.memory.peak_by_phase["backward"] if e.memory else 0,
        "memory.state.params": e.memory.model_state["params"] if e.memory else 0,
        "samples_per_s": e.samples_per_s,
    }
    if metric in expected:
        assert out["series"][2]["values"][1] == pytest.approx(expected[metric])


def test_unknown_metric_is_refused(db: Database) -> None:
    run_id = _run(db, n_steps=1)
    for bad in ("nope", "collective.all_gather.nope", "phase.a'b", "memory.peak"):
        with pytest.raises(queries.UnknownMetric):
            queries.series(db=db, run_id=run_id, metric=bad)


def test_compare_shows_the_zero_trade_across_stages(db: Database) -> None:
    ids = [
        _run(db, simulate.SimSpec(name=f"s{s}", world_size=4, stage=s), n_steps=5)
        for s in (1, 2, 3)
    ]
    out = queries.compare(db=db, run_ids=[*ids, "missing"], metrics=["phase.forward"])
    assert out["missing"] == ["missing"]
    runs = out["runs"]
    assert [r["run"]["zero_stage"] for r in runs] == [1, 2, 3]
    totals = [r["model_state_bytes"]["measured_total"] for r in runs]
    assert totals[0] > totals[1] > totals[2]  # memory per rank down
    comm = [sum(r["comm_bytes_per_step"]["measured"].values()) for r in runs]
    assert comm[2] > comm[1]  # stage 3 gathers parameters twice more
    for r in runs:
        assert r["comm_bytes_per_step"]["measured"] == pytest.approx(
            r["comm_bytes_per_step"]["theory"]
        )
        assert r["phases_s"]["forward"] == pytest.approx(r["metrics"]["phase.forward"])
        assert r["samples_per_s"] > 0 and r["step_time_s"] > 0


def test_trace_has_a_process_per_rank_and_slices_for_sampled_steps(db: Database) -> None:
    run_id = _run(db, n_steps=12)
    out = queries.trace(db=db, run_id=run_id, step_from=0, step_to=11)
    assert out is not None
    events = out["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in slices} == {"step", "phase", "collective"}
    assert {e["args"]["step"] for e in slices if e["cat"] == "phase"} == {0, 5, 10}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    assert out["metadata"]["sampled_steps"] == [0, 5, 10]
    # Every step's slice says where its time went: the exclusive parts add up to it.
    for e in (e for e in slices if e["cat"] == "step"):
        parts = e["args"]["parts_s"]
        assert set(parts) == set(ev.STEP_PARTS)
        assert sum(parts.values()) == pytest.approx(e["args"]["step_time_s"], rel=1e-6)
        assert e["args"]["hidden_comm_s"] >= 0


def test_list_runs_filters(db: Database) -> None:
    a = _run(db, simulate.SimSpec(project="p1", tags=("x", "y")), n_steps=1)
    b = _run(db, simulate.SimSpec(project="p2", tags=("y",)), n_steps=1)
    ids = lambda runs: {r["run_id"] for r in runs}  # noqa: E731
    assert ids(queries.list_runs(db=db, project="p1")) == {a}
    assert ids(queries.list_runs(db=db, tag="y")) == {a, b}
    assert ids(queries.list_runs(db=db, tag="x")) == {a}
    assert ids(queries.list_runs(db=db, status="running")) == {a, b}
    later = time.time() + 1000
    assert ids(queries.list_runs(db=db, status="stalled", now=later)) == {a, b}
    assert queries.get_run(db=db, run_id=a, now=later)["status"] == "stalled"  # type: ignore[index]


def test_one_op_twice_in_a_step_is_stored_added_up_with_its_bandwidth(db: Database) -> None:
    spec = simulate.SimSpec(world_size=4, stage=3, spans_every=0)
    rc = simulate.run_create(spec)
    store.create_run(db, run=rc)
    e = simulate.step_event(spec, 0, 0)
    ag = next(c for c in e.collectives if c.op == "all_gather")
    half = dataclasses.replace(ag, count=2, bytes=1000, latency_sum_s=0.002, latency_max_s=0.0015,
                               algbw_bytes_per_s=0.0, busbw_bytes_per_s=0.0)  # fmt: skip
    other = dataclasses.replace(ag, count=3, bytes=3000, latency_sum_s=0.006, latency_max_s=0.004)
    e = dataclasses.replace(e, collectives=[c for c in e.collectives if c.op != "all_gather"]
                            + [half, other])  # fmt: skip
    store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [e]))
    c = m.collectives.c
    with db.read() as conn:
        row = conn.execute(
            select(c.count, c.bytes, c.latency_sum_s, c.latency_max_s, c.buckets, c.algbw,
                   c.busbw).where(c.op == "all_gather")
        ).one()  # fmt: skip
    assert (row.count, row.bytes, row.latency_max_s) == (5, 4000, 0.004)
    assert row.latency_sum_s == pytest.approx(0.008)
    assert row.buckets == [a + b for a, b in zip(half.buckets, other.buckets, strict=True)]
    assert row.algbw == pytest.approx(4000 / 0.008)
    assert row.busbw == pytest.approx(4000 / 0.008 * 3 / 4)  # (n-1)/n for all-gather


def test_text_and_json_with_quotes_backslashes_and_unicode_are_stored_verbatim(
    db: Database,
) -> None:
    """The bulk inserts' parameters (arrays on PostgreSQL, text on SQLite) carry every
    character a client may send: quotes, backslashes, braces and commas (array syntax),
    non-ASCII and astral characters."""
    odd = "n\"o\\de, {1} 'é😀"
    rc = simulate.run_create(SPEC)
    store.create_run(db, run=rc)
    e = dataclasses.replace(simulate.step_event(SPEC, 0, 0), host=odd, scalars={"s": 1.5})
    e.spans = [ev.Span(name=odd, cat="phase", start=0.0, end=1.0, args={odd: [odd, {odd: 2}]})]
    result = store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, [e]))
    assert result is not None and result.accepted == 1
    with db.read() as conn:
        host = conn.execute(select(m.rank_states.c.host)).scalar_one()
        spans = conn.execute(select(m.spans.c.spans)).scalar_one()
        memory = conn.execute(select(m.steps.c.memory)).scalar_one()
    assert host == odd
    assert spans == [{"name": odd, "cat": "phase", "start": 0.0, "end": 1.0,
                      "args": {odd: [odd, {odd: 2}]}}]  # fmt: skip
    assert memory == dataclasses.asdict(e.memory)  # type: ignore[arg-type]
