"""SQLite: store steps and collectives clustered by (run, rank, seq) (WITHOUT ROWID).

A series of one rank reads that rank's rows in step order. In a rowid table those rows lie
wherever they were appended, interleaved with every other rank's, so a 15,000-step series of
a 64-rank run touches 15,000 pages; clustered by the primary key it touches a few hundred.
PostgreSQL keeps its heap as is (this revision does nothing there).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _steps_columns() -> list[sa.Column]:
    return [
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
    ]


def _collectives_columns() -> list[sa.Column]:
    return [
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
    ]


TABLES = {
    "steps": (_steps_columns, "ix_steps_run_step", ["run", "step"]),
    "collectives": (_collectives_columns, "ix_collectives_run_op_step", ["run", "op", "step"]),
}


def _rebuild(with_rowid: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for name, (columns, index, index_cols) in TABLES.items():
        cols = columns()
        names = ", ".join(c.name for c in cols)
        op.create_table(f"{name}_new", *cols, sqlite_with_rowid=with_rowid)
        order = "run, rank, seq" + (", op, purpose" if name == "collectives" else "")
        op.execute(f"INSERT INTO {name}_new ({names}) SELECT {names} FROM {name} ORDER BY {order}")
        op.drop_index(index, table_name=name)
        op.drop_table(name)
        op.rename_table(f"{name}_new", name)
        op.create_index(index, name, index_cols)


def upgrade() -> None:
    _rebuild(with_rowid=False)


def downgrade() -> None:
    _rebuild(with_rowid=True)
