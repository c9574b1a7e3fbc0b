"""The step's CPU time on the training thread and on the process's other threads (CPU runs;
NULL for steps stored before, GPU runs and older agents).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as b:
        b.add_column(sa.Column("thread_cpu_s", sa.Float(), nullable=True))
        b.add_column(sa.Column("other_cpu_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as b:
        b.drop_column("other_cpu_s")
        b.drop_column("thread_cpu_s")
