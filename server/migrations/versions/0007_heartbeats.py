"""The newest heartbeat of each rank (events.Heartbeat as JSON), for the hang and desync
findings (read/forensics.py).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "heartbeats",
        sa.Column("run", sa.Integer(), primary_key=True),
        sa.Column("rank", sa.Integer(), primary_key=True),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("heartbeats")
