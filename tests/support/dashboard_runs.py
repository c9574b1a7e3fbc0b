"""Runs for the dashboards' tests: real instrumented training runs (the bundled engine under
torchrun, 2 gloo ranks on CPU), simulated runs posted to a live server's ingest API, and a big
simulated run stored fast.

`start_real_runs(server_url, [(stage, extra_args), ...], log_dir=...)` starts training the
example GPT (`zerowatch.examples.train`) once per entry, all at once, each rank instrumented
with `zerowatch.instrument`; `.wait()` returns their run ids once they end.

`post_simulated_run(server_url, spec, steps)` creates a run and posts its events through
`/api/v1` exactly as an agent would (JSON batches), optionally with each rank's end event.

`store_big_run(db, rank_steps=1_000_000)` ingests the first `seed_steps` steps of a
simulated run (zerowatch.simulate) through the store's own ingest, so every row is exactly
what ingest writes, then doubles the run in SQL (`INSERT ... SELECT` of the stored rows
shifted by the steps already stored) until it holds `rank_steps` rank-steps, copying the
seed's rollups (computed by the server's own compactor) with the rows and scaling the run's
totals, and brings the per-rank counters up to date. Ingesting a million rank-steps one batch at a time would take
minutes; the pages under test only read, so how the rows got there does not matter to them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, insert, literal, select, update
from zerowatch.server import models as m
from zerowatch.server import store
from zerowatch.server.db import Database
from zerowatch.server.read.rollups import RollupWorker as Compactor

from zerowatch import events as ev
from zerowatch import simulate as sim

#: The real runs: the same tiny GPT in fp16 (dynamic loss scaling) at stage 1, stage 2 with
#: the optimizer offloaded to the CPU, and stage 3; 2 gloo ranks each. The stage-3 run's
#: micro-batches are larger, so that it trains for some seconds after its first steps are
#: stored: the page that follows it live opens while it still runs (at 8 samples its 16
#: steps took about a second, a race the page lost on a busy machine).
FP16 = ("--precision", "fp16")
REAL_RUNS = ((1, FP16), (2, (*FP16, "--offload", "cpu")), (3, (*FP16, "--micro-batch", "128")))
REAL_STEPS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RealRuns:
    """Training runs started by `start_real_runs`, still going until `wait()`."""

    procs: dict[int, subprocess.Popen[bytes]]
    logs: dict[int, Path]
    #: A tag unique to each run of this launch (find it with /api/v1/runs?tag=...).
    tags: dict[int, str]
    timeout_s: float = 300.0
    _ids: dict[int, str] | None = None

    def wait(self) -> dict[int, str]:
        """Wait for every run to end; stage -> run id. Raises with the output of a failure."""
        if self._ids is not None:
            return self._ids
        ids: dict[int, str] = {}
        failures = []
        for stage, proc in self.procs.items():
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out = self.logs[stage].read_text(errors="replace")
            found = [line.split()[1] for line in out.splitlines() if line.startswith("run ")]
            if proc.returncode != 0 or not found:
                failures.append(f"stage {stage} exited {proc.returncode}:\n{out[-3000:]}")
            else:
                ids[stage] = found[-1]
        if failures:
            raise RuntimeError("\n\n".join(failures))
        self._ids = ids
        return ids

    def stop(self) -> None:
        """Kill runs still going (by their pid)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_real_runs(
    server_url: str,
    runs: Sequence[tuple[int, Sequence[str]]],
    *,
    steps: int = 16,
    world_size: int = 2,
    project: str = "zero-stages",
    log_dir: Path,
    timeout_s: float = 300.0,
) -> RealRuns:
    """Start training the example model once per (stage, extra args), all at once.

    Each run is `torchrun --nproc-per-node world_size -m zerowatch.examples.train` named
    "tiny-gpt stage N", shipping to `server_url`, its output in `log_dir`.
    """
    launch = uuid.uuid4().hex[:8]
    procs, logs, tags = {}, {}, {}
    for stage, extra in runs:
        tags[stage] = f"launch-{launch}-stage{stage}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "-m", "zerowatch.examples.train", "--stage", str(stage), "--steps", str(steps),
            "--server", server_url, "--name", f"tiny-gpt stage {stage}", "--project", project,
            "--tag", "real", "--tag", tags[stage], *extra,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", ZEROWATCH_PRINT_RUN="1")
        logs[stage] = log_dir / f"train-stage{stage}.log"
        with logs[stage].open("wb") as log:
            procs[stage] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return RealRuns(procs=procs, logs=logs, tags=tags, timeout_s=timeout_s)


def post_simulated_run(
    server_url: str,
    spec: sim.SimSpec,
    n_steps: int,
    *,
    start: int = 0,
    run_id: str | None = None,
    end: str | None = None,
    config: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> str:
    """Create (or reuse) a run and post `n_steps` steps of every rank; returns the run id.

    Args:
        end: "finished" or "failed" to close every rank after the steps; None keeps it running.
        config: replaces the simulated run's resolved config.
    """
    api = server_url.rstrip("/") + "/api/v1"
    rc = sim.run_create(spec, run_id=run_id)
    if config is not None:
        rc = dataclasses.replace(rc, config=config)
    with httpx.Client(timeout=30, headers=headers) as client:
        client.post(f"{api}/runs", json=dataclasses.asdict(rc)).raise_for_status()
        events: list[Any] = [e for step in sim.steps(spec, n_steps, start=start) for e in step]
        if end is not None:
            seq = start + n_steps
            events += [ev.EndEvent(rank=r, seq=seq, time=events[-1].time, status=end)
                       for r in range(spec.world_size)]  # fmt: skip
        for i in range(0, len(events), 200):
            body = {"schema_version": ev.SCHEMA_VERSION, "run_id": rc.run_id,
                    "events": [dataclasses.asdict(e) for e in events[i : i + 200]]}  # fmt: skip
            client.post(f"{api}/runs/{rc.run_id}/events", json=body).raise_for_status()
    return rc.run_id


def _copy_shifted(conn, table, pk: int, offset: int, step_time_s: float) -> None:
    cols = list(table.c)
    exprs = []
    for c in cols:
        if c.name in ("seq", "step"):
            exprs.append(c + literal(offset))
        elif c.name == "time":
            exprs.append(c + literal(offset * step_time_s))
        else:
            exprs.append(c)
    conn.execute(
        insert(table).from_select([c.name for c in cols], select(*exprs).where(table.c.run == pk))
    )


def store_big_run(
    db: Database,
    *,
    rank_steps: int = 1_000_000,
    world_size: int = 8,
    seed_steps: int = 250,
    name: str = "big run",
) -> tuple[str, int]:
    """Store a run of about `rank_steps` rank-steps; returns (run_id, rank-steps stored)."""
    spec = sim.SimSpec(name=name, stage=3, world_size=world_size, straggler_rank=3,
                       spans_every=0, grad_spike_at=seed_steps // 2)  # fmt: skip
    rc = sim.run_create(spec)
    store.create_run(db, run=rc)
    events = [e for step in sim.steps(spec, seed_steps) for e in step]
    for i in range(0, len(events), 1000):
        batch = ev.EventBatch(run_id=rc.run_id, events=events[i : i + 1000])
        store.ingest_batch(db, run_id=rc.run_id, batch=batch)
    # Roll the seed up as a live server's compactor would; the copies below carry their
    # rollups with them (a copied step's ranks hold the same values as its original).
    Compactor(db, max_steps=seed_steps).flush()
    steps = seed_steps
    doublings = max(0, math.ceil(math.log2(rank_steps / (seed_steps * world_size))))
    with db.write() as conn:
        pk = conn.execute(select(m.runs.c.id).where(m.runs.c.run_id == rc.run_id)).scalar_one()
        for _ in range(doublings):
            for table in (m.steps, m.collectives, m.step_rollups):
                _copy_shifted(conn, table, pk, steps, spec.step_time_s)
            steps *= 2
        # Every total (skipped and non-finite steps, latency histograms) doubled with the run.
        t = m.run_totals.c
        for key, value, buckets in conn.execute(
            select(t.key, t.value, t.buckets).where(t.run == pk)
        ).all():
            if key.startswith("retention."):
                continue
            scale = 2**doublings
            conn.execute(
                update(m.run_totals)
                .where(t.run == pk, t.key == key)
                .values(value=value * scale, buckets=[int(n) * scale for n in buckets or []])
            )
        conn.execute(
            update(m.rank_states)
            .where(m.rank_states.c.run == pk)
            .values(steps=steps, last_step=steps - 1)
        )
        stored = conn.execute(select(func.count()).where(m.steps.c.run == pk)).scalar_one()
    return rc.run_id, int(stored)
