"""The rank's GPU during the step (events.GpuTelemetry as JSON; NULL for steps stored
before, runs without a GPU or NVML, and older agents).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as b:
        b.add_column(sa.Column("gpu", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as b:
        b.drop_column("gpu")
