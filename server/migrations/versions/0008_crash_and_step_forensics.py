"""A crashed rank's last event (events.EndEvent.crash: the exception, its step and phase,
the memory waterfall on out-of-memory) and a flagged step's forensics (events.StepEvent.
forensics: the rank's local gradient norm, the first non-finite module); JSON, NULL for
everything stored before and every step with nothing to say.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rank_states") as b:
        b.add_column(sa.Column("crash", sa.JSON(), nullable=True))
    with op.batch_alter_table("steps") as b:
        b.add_column(sa.Column("forensics", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as b:
        b.drop_column("forensics")
    with op.batch_alter_table("rank_states") as b:
        b.drop_column("crash")
