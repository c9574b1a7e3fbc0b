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

Runs are referenced by an integer surrogate key (`runs.id`) to keep the big tables narrow.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, Index, Integer, Text
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
    #: running, finished or failed; "stalled" is derived when reading (no recent event).
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
    #: {"d2h": {"bytes": n, "seconds": s, "bandwidth": b}, "h2d": {...}}
    offload: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: events.MemoryStats as a dict ({} when the step carried none).
    memory: Mapped[dict[str, Any]] = mapped_column(JSON)
    #: User scalars from run.log().
    scalars: Mapped[dict[str, Any]] = mapped_column(JSON)

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


runs = Run.__table__
run_tags = RunTag.__table__
rank_states = RankState.__table__
steps = Step.__table__
collectives = Collective.__table__
spans = SpanSet.__table__

__all__ = [
    "Base",
    "Collective",
    "RankState",
    "Run",
    "RunTag",
    "SpanSet",
    "Step",
    "collectives",
    "rank_states",
    "run_tags",
    "runs",
    "spans",
    "steps",
]
