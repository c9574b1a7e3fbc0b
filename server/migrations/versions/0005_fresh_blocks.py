"""Fresh rank-steps' metric columns shared between server processes (read/fresh.py).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fresh_blocks",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("run", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
    )
    op.create_index("ix_fresh_blocks_run", "fresh_blocks", ["run"])
    if op.get_bind().dialect.name == "postgresql":
        # Packed numbers: PostgreSQL's compression would spend its CPU for little.
        op.execute("ALTER TABLE fresh_blocks ALTER COLUMN data SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.drop_index("ix_fresh_blocks_run", table_name="fresh_blocks")
    op.drop_table("fresh_blocks")
