"""What each gloo rank runs in the clock-offset test (spawned by support.engine_harness)."""

from __future__ import annotations

import time
from typing import Any

from rank_jobs import train
from support.engine_scenarios import ds_config, make_model
from zerowatch.agent.spool import read_events, segments

import zerowatch


def skewed_clock_run(rank: int, world: int, spool_root: str, skew_s: float,
                     skewed_rank: int, steps: int) -> dict[str, Any]:  # fmt: skip
    """A few instrumented steps; `skewed_rank`'s wall clock (time.time) runs `skew_s` ahead.
    Returns the offset the agent estimated and the step events it wrote."""
    if rank == skewed_rank:
        real = time.time
        time.time = lambda: real() + skew_s  # type: ignore[assignment]
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(0))
    with zerowatch.instrument(engine, run="clocks", spool_dir=spool_root, spans_every=1,
                              clock_sync_rounds=16) as run:  # fmt: skip
        for s in range(steps):
            train(engine, run, s, rank, world)
    events = []
    for seg in segments(run.spool_path / f"rank-{rank:05d}"):
        events.extend(obj for _, obj in read_events(seg) if obj["kind"] == "step")
    return {"offset": run._recorder.clock_offset_s, "steps": events}
