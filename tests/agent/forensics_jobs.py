"""What each gloo rank runs in the collective forensics tests (test_collective_forensics.py):
the real engine on the tiny GPT, instrumented against a live server, with a rank that
blocks forever in its data loader, or issues one collective the other rank does not."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from rank_jobs import FAST, train
from support.engine_scenarios import ds_config, make_model

import zerowatch

#: A short stall threshold and frequent heartbeats: a hang is named within seconds.
QUICK = {**FAST, "heartbeat_interval_s": 0.5, "stall_floor_s": 2.0, "stall_factor": 3.0}


def load_batch(step: int, never: threading.Event | None) -> int:
    """The test's data loader: on the stuck rank, waits for a batch that never comes."""
    if never is not None:
        never.wait()  # the loader's line the hang finding must name
    return step


def hangs_in_loader(rank: int, world: int, server: str, spool_root: str, stuck_rank: int,
                    stuck_step: int, steps_file: str) -> dict[str, Any]:  # fmt: skip
    """Train until rank `stuck_rank` blocks in its loader at step `stuck_step` (the others
    then block in that step's first collective); never returns."""
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(2, overlap=True))
    never = threading.Event() if rank == stuck_rank else None
    with zerowatch.instrument(engine, server=server, run="hang", spool_dir=spool_root,
                              **QUICK) as run:  # fmt: skip
        for s in range(10_000):
            load_batch(s, never if s == stuck_step else None)
            train(engine, run, s, rank, world)
            if rank == 0:
                with open(steps_file, "w") as f:
                    f.write(f"{run.id} {s}\n")
            time.sleep(0.01)
    return {"run_id": run.id}


def one_extra_collective(rank: int, world: int, server: str, spool_root: str, extra_rank: int,
                         extra_step: int, steps_file: str) -> dict[str, Any]:  # fmt: skip
    """Train; rank `extra_rank` issues one all-reduce of 3 elements more at step
    `extra_step` (through the engine's Comm, as any collective of the job)."""
    engine, *_ = zerowatch.initialize(model=make_model(), config=ds_config(0))
    with zerowatch.instrument(engine, server=server, run="desync", spool_dir=spool_root,
                              **QUICK) as run:  # fmt: skip
        for s in range(10_000):
            if rank == extra_rank and s == extra_step:
                engine.comm.all_reduce(torch.ones(3), purpose="other")
            if s == extra_step:
                time.sleep(2.0)  # a slow batch: the mismatch meets rank 0's collective later
            train(engine, run, s, rank, world)
            if rank == 0:
                with open(steps_file, "w") as f:
                    f.write(f"{run.id} {s}\n")
            time.sleep(0.01)
    return {"run_id": run.id}


def wrapped_calls_numbered(rank: int, world: int) -> dict[str, Any]:
    """torch.distributed's collectives through dist_wrap (as DeepSpeed's and FSDP2's
    reach them): each announced before it is issued, numbered per group, and its record
    carrying the same (group, seq); a flight recorder fed by the tap sees them complete."""
    import torch.distributed as dist
    from zerowatch.agent.adapters.dist_wrap import CollectiveTap
    from zerowatch.agent.probes.flight import FlightRecorder

    flight = FlightRecorder()
    launches: list[tuple[str, int, str, int, str]] = []
    records: list[tuple[str, int, str]] = []

    def launch(group: str, seq: int, op: str, numel: int, dtype: Any, t: float) -> None:
        launches.append((group, seq, op, numel, str(dtype)))
        flight.on_collective_launch(group, seq, op, numel, dtype, t)

    def sink(rec: Any) -> None:
        records.append((rec.group, rec.seq, rec.op))
        flight.on_collective(rec)

    tap = CollectiveTap(lambda op: "other", sink, launch)
    tap.open()
    try:
        dist.all_reduce(torch.ones(10))
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        dist.broadcast(torch.ones(3, dtype=torch.float64), src=0)
    finally:
        tap.close()
    return {"launches": launches, "records": records, "flight": flight.snapshot(0.0)}
