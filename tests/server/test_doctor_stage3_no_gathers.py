"""A stage-3 run whose parameters all sit under stage3_param_persistence_threshold gathers
nothing: its only collective is the all-reduce of the whole parameters' gradients. No
finding of the doctor (the exposed communication, the latency-bound collectives, the stage
choice, any other) advises on gathers or their prefetch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read import doctor

from zerowatch import events as ev
from zerowatch import simulate

#: Advice on gathers (the all-reduce's own advice may say its parameters are never gathered).
GATHER_WORDS = ("prefetch", "all_gather", "all-gather", "gathers parameters",
                "raise stage3_param_persistence_threshold")  # fmt: skip


def _all_reduce_only(calls: int, nbytes: int) -> object:
    """60% of the step exposed, in `calls` all-reduces of `nbytes` together a step."""

    def mutate(e: ev.StepEvent) -> ev.StepEvent:
        secs = 0.5 * e.step_time_s
        stats = [ev.CollectiveStats.of_calls(
            "all_reduce", "grad_reduce", world_size=8, count=calls, nbytes=nbytes,
            latency_sum_s=secs, latency_max_s=secs / calls,
            buckets=[0] * (len(ev.LATENCY_BUCKETS) + 1))]  # fmt: skip
        return dataclasses.replace(e, exposed_comm_s=0.6 * e.step_time_s, collectives=stats)

    return mutate


@pytest.mark.parametrize(("calls", "nbytes"), [(8, 64 << 20), (64, 64 << 10)])
def test_stage_3_without_gathers_gets_no_gather_or_prefetch_advice(
    tmp_path: Path, calls: int, nbytes: int
) -> None:
    db = Database.open(f"sqlite:///{tmp_path / 'z.db'}")
    spec = simulate.SimSpec(world_size=8, stage=3, num_params=50_000_000, spans_every=0)
    rc = simulate.run_create(spec)
    rc = dataclasses.replace(rc, config={**rc.config, "zero_optimization": {
        **rc.config.get("zero_optimization", {}), "stage": 3,
        "stage3_param_persistence_threshold": 10**9}})  # fmt: skip
    store.create_run(db, run=rc)
    mutate = _all_reduce_only(calls, nbytes)
    for events in simulate.steps(spec, 30):
        events = [mutate(e) for e in events]  # type: ignore[operator]
        store.ingest_batch(db, run_id=rc.run_id, batch=ev.EventBatch(rc.run_id, events))
    # The link's bandwidth known: the small all-reduces are judged latency-bound against it.
    settings = doctor.DoctorSettings(link_busbw_bytes_per_s=150e9)
    got = doctor.findings(db=db, run_id=rc.run_id, settings=settings)
    db.close()
    assert got is not None
    found = got["findings"]
    kinds = {f["kind"] for f in found}
    assert "exposed_communication" in kinds, found
    if calls >= 64:  # many small calls: latency-bound too, told a larger reduce bucket
        assert "latency_bound_collectives" in kinds, kinds
    for f in found:
        said = f"{f['message']} {f['suggestion']}".lower()
        assert not [w for w in GATHER_WORDS if w in said], (f["kind"], said)
