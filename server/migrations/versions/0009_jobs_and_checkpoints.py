"""The job a run belongs to (events.RunCreate.job: its restarts share it) and each rank's
checkpoint saves and loads (events.CheckpointTiming), for the job view (read/jobs.py).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as b:
        b.add_column(sa.Column("job", sa.Text(), nullable=False, server_default=""))
        b.create_index("ix_runs_job", ["job"])
    op.create_table(
        "checkpoints",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("rank", sa.Integer(), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True),
        sa.Column("idx", sa.Integer(), primary_key=True),
        sa.Column("op", sa.Text(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("tag", sa.Text(), nullable=False),
    )
    op.create_index("ix_checkpoints_run_op_step", "checkpoints", ["run", "op", "step"])


def downgrade() -> None:
    op.drop_table("checkpoints")
    with op.batch_alter_table("runs") as b:
        b.drop_index("ix_runs_job")
        b.drop_column("job")
