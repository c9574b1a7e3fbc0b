"""The read model: per-step rollups across ranks, dirty-step marks, run totals; each rank's
host; the exclusive step decomposition (parts, hidden communication).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    op.create_table(
        "step_rollups",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("metric", sa.Text(), primary_key=True),
        sa.Column("step", sa.BigInteger(), primary_key=True),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("min", sa.Float(), nullable=False),
        sa.Column("p10", sa.Float(), nullable=False),
        sa.Column("p50", sa.Float(), nullable=False),
        sa.Column("p90", sa.Float(), nullable=False),
        sa.Column("max", sa.Float(), nullable=False),
        sa.Column("mean", sa.Float(), nullable=False),
        sa.Column("min_rank", sa.Integer(), nullable=False),
        sa.Column("max_rank", sa.Integer(), nullable=False),
        sa.Column("extra", sa.JSON(), nullable=False),
        **({"sqlite_with_rowid": False} if sqlite else {}),
    )
    op.create_table(
        "dirty_steps",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("step", sa.BigInteger(), primary_key=True),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("since", sa.Float(), nullable=False),
    )
    op.create_table(
        "run_totals",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("key", sa.Text(), primary_key=True),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("buckets", sa.JSON(), nullable=False),
    )
    with op.batch_alter_table("rank_states") as b:
        b.add_column(sa.Column("host", sa.Text(), nullable=True))
        b.add_column(sa.Column("local_rank", sa.Integer(), nullable=True))
    with op.batch_alter_table("steps") as b:
        b.add_column(sa.Column("parts", sa.JSON(), nullable=False, server_default="{}"))
        b.add_column(sa.Column("hidden_comm_s", sa.Float(), nullable=False, server_default="0"))
    # Runs stored before this revision get their rollups from the compactor.
    op.execute(
        "INSERT INTO dirty_steps (run, step, version, since) "
        "SELECT run, step, 1, 0 FROM steps GROUP BY run, step"
    )


def downgrade() -> None:
    with op.batch_alter_table("steps") as b:
        b.drop_column("hidden_comm_s")
        b.drop_column("parts")
    with op.batch_alter_table("rank_states") as b:
        b.drop_column("local_rank")
        b.drop_column("host")
    op.drop_table("run_totals")
    op.drop_table("dirty_steps")
    op.drop_table("step_rollups")
