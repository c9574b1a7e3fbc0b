"""The SQL schema (SQLAlchemy 2 `Mapped` models); migrations under migrations/versions/.

Sized for sharded training: a stage-3 job of 1,000 ranks at one step a second sends 1,000
step events a second, each with a few dozen phase and collective records. So the unit of
storage is the *rank-step*, never the individual collective call:

- `steps`: one row per (run, rank, seq) with the step's scalars as columns and the small
  keyed maps (phases, memory, offload, user scalars) as JSON columns that the series query
  reads with the database's JSON operators. The primary key is the idempotency key: a
  replayed event hits ON CONFLICT DO NOTHING.
- `collectives`: one row per (run, rank, seq, op, purpose): the step's aggregate of that op
  (count, bytes, latency sum and max, histogram buckets), a handful of rows per rank-step.
- `spans`: raw phase/collective slices, only for the steps the agent sampled, one JSON row
  per rank-step (the trace export reads them).
- `rank_states`: per (run, rank) counters kept current on ingest (steps stored, last step,
  how the rank ended), so a run's page never counts a million rows.
- `runs` and `run_tags`: one row per job, its tags one row each (for the tag filter).
- `step_rollups`: the read model. One row per (run, step, metric): the distribution of that
  metric over the step's ranks (n, min, p10, p50, p90, max, mean, the ranks at the min and
  the max, and the ranks at both ends). Written by the roll-up worker (read/rollups/) from
  the per-rank rows; every read that is not about named ranks reads these, so its cost
  follows steps, not steps x ranks.
- `dirty_steps`: (run, step) pairs whose per-rank rows changed since their rollup was
  written, with a version that every ingest bumps (the roll-up worker clears a mark only if
  the version it read is still there, so a late rank is never lost).
- `fresh_blocks`: with several server processes, the metric columns of fresh rank-steps
  that one process converted for another's roll-up worker (read/rollups/shared_blocks.py),
  a row per group of rank-steps; a cache in the database, deleted once that worker has
  taken it.
- `heartbeats`: the newest heartbeat of each rank (its last step, phase, flight recorder and,
  once stalled, its training thread's stack), replaced as they come: what the hang and
  desync findings read (read/forensics.py).
- `checkpoints`: each rank's checkpoint saves and loads (seconds, bytes, the step), keyed
  by the event that carried them; with `runs.job` (the runs of one job across restarts)
  what the job view and its goodput read (read/jobs.py).
- `run_totals`: per run, running totals the roll-up worker keeps by deltas (steps skipped or
  non-finite, the latency histogram of each collective op summed over ranks): /metrics
  reads them in one query whatever the run's length.

Runs are referenced by an integer surrogate key (`runs.id`) to keep the big tables narrow.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, Index, Integer, LargeBinary, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, int: BigInteger}


class Run(Base):
    """One training job."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(Text, unique=True)
    name: Mapped[str] = mapped_column(Text)
    project: Mapped[str] = mapped_column(Text, index=True)
    tags: Mapped[list[Any]] = mapped_column(JSON)
    #: running, finished, failed or crashed; "stalled" is derived when reading (no recent
    #: event).
    status: Mapped[str] = mapped_column(Text, index=True)
    zero_stage: Mapped[int] = mapped_column(Integer)
    offload_optimizer: Mapped[str] = mapped_column(Text)
    offload_param: Mapped[str] = mapped_column(Text)
    precision: Mapped[str] = mapped_column(Text)
    world_size: Mapped[int] = mapped_column(Integer)
    engine: Mapped[str] = mapped_column(Text)
    engine_info: Mapped[dict[str, Any]] = mapped_column(JSON)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    param_count: Mapped[int] = mapped_column(BigInteger)
    hosts: Mapped[list[Any]] = mapped_column(JSON)
    torch_version: Mapped[str] = mapped_column(Text)
    zerowatch_version: Mapped[str] = mapped_column(Text)
    theory: Mapped[dict[str, Any]] = mapped_column(JSON)
    theory_comm: Mapped[dict[str, Any]] = mapped_column(JSON)
    started_at: Mapped[float] = mapped_column(Float)
    #: The job the run is part of (events.RunCreate.job): its restarts share it; "" none.
    job: Mapped[str] = mapped_column(Text, default="", server_default="", index=True)
    #: Server time the run was created.
    created_at: Mapped[float] = mapped_column(Float)
    #: Time of the newest event (its own timestamp, capped at the server's clock).
    last_event_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class RunTag(Base):
    __tablename__ = "run_tags"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    tag: Mapped[str] = mapped_column(Text, primary_key=True)

    __table_args__ = (Index("ix_run_tags_tag", "tag"),)


class RankState(Base):
    """Per-rank counters, updated by each ingest transaction."""

    __tablename__ = "rank_states"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    steps: Mapped[int] = mapped_column(BigInteger, default=0)
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    last_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    end_status: Mapped[str | None] = mapped_column(Text, nullable=True)
    end_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    end_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    dropped_events: Mapped[int] = mapped_column(BigInteger, default=0)
    agent_errors: Mapped[int] = mapped_column(BigInteger, default=0)
    #: The host the rank runs on and its rank there (from its step events).
    host: Mapped[str | None] = mapped_column(Text, nullable=True)
    local_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: A crashed rank's report (events.EndEvent.crash); NULL otherwise.
    crash: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class Step(Base):
    """One rank's optimizer step."""

    __tablename__ = "steps"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger)
    time: Mapped[float] = mapped_column(Float)
    step_time_s: Mapped[float] = mapped_column(Float)
    exposed_comm_s: Mapped[float] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    clipped: Mapped[bool] = mapped_column(Boolean)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_scale: Mapped[float | None] = mapped_column(Float, nullable=True)
    skipped: Mapped[bool] = mapped_column(Boolean)
    nonfinite: Mapped[bool] = mapped_column(Boolean)
    lr: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger)
    samples_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    mfu: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: {phase: seconds}
    phases: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: The exclusive decomposition {part: seconds} (events.STEP_PARTS); sums to step_time_s.
    parts: Mapped[dict[str, Any]] = mapped_column(JSON)
    hidden_comm_s: Mapped[float] = mapped_column(Float)
    #: CPU seconds of the step on the training thread and on the process's other threads
    #: (NULL: not measured: GPU runs, older agents).
    thread_cpu_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    other_cpu_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: {"d2h": {"bytes": n, "seconds": s, "bandwidth": b}, "h2d": {...}}
    offload: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: events.MemoryStats as a dict ({} when the step carried none).
    memory: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: User scalars from run.log().
    scalars: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: events.GpuTelemetry as a dict: the rank's GPU during the step (NVML); NULL or JSON
    #: null without one (CPU runs, no NVML, older agents).
    gpu: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: A flagged step's forensics on this rank (events.StepEvent.forensics); NULL otherwise.
    forensics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    # SQLite: clustered by the primary key, so one rank's steps lie together (migration 0002).
    __table_args__ = (Index("ix_steps_run_step", "run", "step"), {"sqlite_with_rowid": False})


class Collective(Base):
    """One step's aggregate of one (op, purpose) on one rank."""

    __tablename__ = "collectives"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    op: Mapped[str] = mapped_column(Text, primary_key=True)
    purpose: Mapped[str] = mapped_column(Text, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)
    latency_sum_s: Mapped[float] = mapped_column(Float)
    latency_max_s: Mapped[float] = mapped_column(Float)
    #: Non-cumulative counts per events.LATENCY_BUCKETS bucket, +Inf last.
    buckets: Mapped[list[Any]] = mapped_column(JSON)
    world_size: Mapped[int] = mapped_column(BigInteger)
    algbw: Mapped[float] = mapped_column(Float)
    busbw: Mapped[float] = mapped_column(Float)
    async_count: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (
        Index("ix_collectives_run_op_step", "run", "op", "step"),
        {"sqlite_with_rowid": False},
    )


class SpanSet(Base):
    """The raw spans of one sampled rank-step (a JSON list of events.Span dicts)."""

    __tablename__ = "spans"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger)
    spans: Mapped[list[Any]] = mapped_column(JSON)

    __table_args__ = (Index("ix_spans_run_step", "run", "step"),)


class StepRollup(Base):
    """One metric of one step, summarised over the step's ranks."""

    __tablename__ = "step_rollups"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    metric: Mapped[str] = mapped_column(Text, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    #: Ranks that reported a value.
    n: Mapped[int] = mapped_column(Integer)
    min: Mapped[float] = mapped_column(Float)
    p10: Mapped[float] = mapped_column(Float)
    p50: Mapped[float] = mapped_column(Float)
    p90: Mapped[float] = mapped_column(Float)
    max: Mapped[float] = mapped_column(Float)
    mean: Mapped[float] = mapped_column(Float)
    min_rank: Mapped[int] = mapped_column(Integer)
    max_rank: Mapped[int] = mapped_column(Integer)
    #: {"hi": [[rank, value], ...], "lo": [...]}: the ranks at both ends (ReadTuning.top_k
    #: each), for outlier tables and /metrics' per-rank series; for a collective op's
    #: latency also "hist": the step's latency histogram summed over ranks.
    extra: Mapped[dict[str, Any]] = mapped_column(JSON)

    # Clustered by (run, metric, step) on SQLite: a series reads one contiguous range.
    __table_args__ = ({"sqlite_with_rowid": False},)


class DirtyStep(Base):
    """A step whose rollups are stale (rows arrived since they were computed)."""

    __tablename__ = "dirty_steps"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger)
    #: Server time of the newest mark: the roll-up worker rolls a step up once no rank has
    #: written to it for a while (its ranks have arrived).
    since: Mapped[float] = mapped_column(Float)


class FreshBlock(Base):
    """Fresh rank-steps of one run, as metric columns, published by the server process that
    stored them for the one that rolls the run up (read/rollups/shared_blocks.py: `pack`)."""

    __tablename__ = "fresh_blocks"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    run: Mapped[int] = mapped_column(Integer, index=True)
    #: Rank-steps it holds.
    n: Mapped[int] = mapped_column(Integer)
    #: Server time it was published (old ones are deleted: nobody took them).
    created: Mapped[float] = mapped_column(Float)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class RunTotal(Base):
    """A running total of one run, kept by the roll-up worker (see the module docstring)."""

    __tablename__ = "run_totals"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(Text, primary_key=True)
    value: Mapped[float] = mapped_column(Float)
    #: Histogram counts (non-cumulative, events.LATENCY_BUCKETS then +Inf) where the total
    #: is a histogram; [] otherwise.
    buckets: Mapped[list[Any]] = mapped_column(JSON)


class RankHeartbeat(Base):
    """The newest heartbeat of each rank (events.Heartbeat, agent/heartbeat.py): replaced by
    each one that arrives; the collective forensics read them (read/forensics.py)."""

    __tablename__ = "heartbeats"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    #: Server time it arrived (a rank whose heartbeats stopped is silent).
    received_at: Mapped[float] = mapped_column(Float)
    #: The heartbeat as sent (JSON).
    body: Mapped[dict[str, Any]] = mapped_column(JSON)


class Checkpoint(Base):
    """One rank's checkpoint save or load (events.CheckpointTiming), keyed by the event that
    carried it (its seq) and its place in that event's list."""

    __tablename__ = "checkpoints"

    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    #: "save" or "load".
    op: Mapped[str] = mapped_column(Text)
    #: The engine's global step when the call returned.
    step: Mapped[int] = mapped_column(BigInteger)
    #: Unix time the call began, and its seconds on the rank.
    time: Mapped[float] = mapped_column(Float)
    seconds: Mapped[float] = mapped_column(Float)
    #: Bytes the rank wrote (save) or read (load); NULL where not counted.
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tag: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_checkpoints_run_op_step", "run", "op", "step"),)


runs = Run.__table__
run_tags = RunTag.__table__
rank_states = RankState.__table__
checkpoints = Checkpoint.__table__
steps = Step.__table__
collectives = Collective.__table__
spans = SpanSet.__table__
step_rollups = StepRollup.__table__
dirty_steps = DirtyStep.__table__
fresh_blocks = FreshBlock.__table__
run_totals = RunTotal.__table__
heartbeats = RankHeartbeat.__table__

__all__ = [
    "Base",
    "Checkpoint",
    "Collective",
    "DirtyStep",
    "FreshBlock",
    "RankHeartbeat",
    "RankState",
    "Run",
    "RunTag",
    "RunTotal",
    "SpanSet",
    "Step",
    "StepRollup",
    "checkpoints",
    "collectives",
    "dirty_steps",
    "fresh_blocks",
    "heartbeats",
    "rank_states",
    "run_tags",
    "run_totals",
    "runs",
    "spans",
    "step_rollups",
    "steps",
]
