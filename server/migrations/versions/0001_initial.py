"""Initial schema: runs, run_tags, rank_states, steps, collectives, spans.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Text(), nullable=False, unique=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("project", sa.Text(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("zero_stage", sa.Integer(), nullable=False),
        sa.Column("offload_optimizer", sa.Text(), nullable=False),
        sa.Column("offload_param", sa.Text(), nullable=False),
        sa.Column("precision", sa.Text(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("engine", sa.Text(), nullable=False),
        sa.Column("engine_info", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("param_count", sa.BigInteger(), nullable=False),
        sa.Column("hosts", sa.JSON(), nullable=False),
        sa.Column("torch_version", sa.Text(), nullable=False),
        sa.Column("zerowatch_version", sa.Text(), nullable=False),
        sa.Column("theory", sa.JSON(), nullable=False),
        sa.Column("theory_comm", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_event_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_runs_project", "runs", ["project"])
    op.create_index("ix_runs_status", "runs", ["status"])

    op.create_table(
        "run_tags",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("tag", sa.Text(), primary_key=True),
    )
    op.create_index("ix_run_tags_tag", "run_tags", ["tag"])

    op.create_table(
        "rank_states",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("rank", sa.Integer(), primary_key=True),
        sa.Column("steps", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("last_time", sa.Float(), nullable=True),
        sa.Column("end_status", sa.Text(), nullable=True),
        sa.Column("end_seq", sa.BigInteger(), nullable=True),
        sa.Column("end_time", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("dropped_events", sa.BigInteger(), nullable=False),
        sa.Column("agent_errors", sa.BigInteger(), nullable=False),
    )

    op.create_table(
        "steps",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("rank", sa.Integer(), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("step_time_s", sa.Float(), nullable=False),
        sa.Column("exposed_comm_s", sa.Float(), nullable=False),
        sa.Column("grad_norm", sa.Float(), nullable=True),
        sa.Column("clipped", sa.Boolean(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("loss_scale", sa.Float(), nullable=True),
        sa.Column("skipped", sa.Boolean(), nullable=False),
        sa.Column("nonfinite", sa.Boolean(), nullable=False),
        sa.Column("lr", sa.Float(), nullable=True),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("samples_per_s", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("mfu", sa.Float(), nullable=True),
        sa.Column("phases", sa.JSON(), nullable=False),
        sa.Column("offload", sa.JSON(), nullable=False),
        sa.Column("memory", sa.JSON(), nullable=False),
        sa.Column("scalars", sa.JSON(), nullable=False),
    )
    op.create_index("ix_steps_run_step", "steps", ["run", "step"])

    op.create_table(
        "collectives",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("rank", sa.Integer(), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True),
        sa.Column("op", sa.Text(), primary_key=True),
        sa.Column("purpose", sa.Text(), primary_key=True),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("latency_sum_s", sa.Float(), nullable=False),
        sa.Column("latency_max_s", sa.Float(), nullable=False),
        sa.Column("buckets", sa.JSON(), nullable=False),
        sa.Column("world_size", sa.BigInteger(), nullable=False),
        sa.Column("algbw", sa.Float(), nullable=False),
        sa.Column("busbw", sa.Float(), nullable=False),
        sa.Column("async_count", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_collectives_run_op_step", "collectives", ["run", "op", "step"])

    op.create_table(
        "spans",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("rank", sa.Integer(), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("spans", sa.JSON(), nullable=False),
    )
    op.create_index("ix_spans_run_step", "spans", ["run", "step"])


def downgrade() -> None:
    for table in ("spans", "collectives", "steps", "rank_states", "run_tags", "runs"):
        op.drop_table(table)
