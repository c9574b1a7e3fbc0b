"""The collectives lose their (run, op, step) index: every read finds a rank-step's rows by
the primary key (run, rank, seq, op), from the steps rows it picked by their own indexes
(read/vocabulary.py `steps_with_collectives`). Two B-trees per row cost a tenth of the
server's ingest CPU on SQLite; the index served only reads that the join now serves.

Revision ID: 0005
Revises: 0004
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_collectives_run_op_step", table_name="collectives")
    # SQLite's planner statistics (server/db.py PLANNER_STATS) named the index.
    bind = op.get_bind()
    if bind.dialect.name == "sqlite" and bind.exec_driver_sql(
        "SELECT 1 FROM sqlite_master WHERE name = 'sqlite_stat1'"
    ).first():
        op.execute("DELETE FROM sqlite_stat1 WHERE idx = 'ix_collectives_run_op_step'")


def downgrade() -> None:
    op.create_index("ix_collectives_run_op_step", "collectives", ["run", "op", "step"])
